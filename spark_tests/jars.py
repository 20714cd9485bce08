"""Spark's Kafka connector jars, fetched from Maven Central once and cached outside the repository.

Why not `spark.jars.packages`: that resolves with Ivy at every session start and needs the network then;
the tests must run from local files. pyspark ships Spark itself but not the connector, so Maven fetches
`spark-sql-kafka-0-10_2.13` of pyspark's exact version plus the jars it needs beyond pyspark's own
(kafka-clients, commons-pool2, spark-token-provider-kafka) through ``harness/spark/pom.xml``, into
``~/.cache/kthrottle/spark-<version>/jars``. The fetch-once routine is ``harness.maven.fetch_once``.

Environment variables:
    KTHROTTLE_CACHE       cache root (default ``~/.cache/kthrottle``)
    KTHROTTLE_SPARK_JARS  use this directory of connector jars as is, skipping Maven
"""

from __future__ import annotations

import os
from pathlib import Path

from harness.maven import cache_root, fetch_once

SPARK_VERSION = "4.2.0"
"""pyspark and connector version. 4.3.0 is on PyPI but its connector is not on Maven Central."""

CONNECTOR = f"spark-sql-kafka-0-10_2.13-{SPARK_VERSION}.jar"

_POM = Path(__file__).resolve().parent.parent / "harness" / "spark" / "pom.xml"


def ensure_spark_kafka_jars() -> list[Path]:
    """Return the connector's jars (for ``spark.jars``), fetching them with Maven the first time."""
    override = os.environ.get("KTHROTTLE_SPARK_JARS")
    if override:
        jars = sorted(Path(override).expanduser().glob("*.jar"))
        if not any(jar.name == CONNECTOR for jar in jars):
            raise RuntimeError(f"KTHROTTLE_SPARK_JARS={override} holds no {CONNECTOR}")
        return jars
    libs = fetch_once(_POM, cache_root() / f"spark-{SPARK_VERSION}" / "jars",
                      what=f"Spark's Kafka connector {SPARK_VERSION}", expect=CONNECTOR,
                      hint="or set KTHROTTLE_SPARK_JARS")
    return sorted(libs.glob("*.jar"))


if __name__ == "__main__":
    print(",".join(str(jar) for jar in ensure_spark_kafka_jars()))
