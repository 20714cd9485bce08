"""Spark's Kafka connector jars, fetched from Maven Central once and cached outside the repository.

Why not `spark.jars.packages`: that resolves with Ivy at every session start and needs the network then;
the tests must run from local files. pyspark ships Spark itself but not the connector, so Maven fetches
`spark-sql-kafka-0-10_2.13` of pyspark's exact version plus the jars it needs beyond pyspark's own
(kafka-clients, commons-pool2, spark-token-provider-kafka) through ``harness/spark/pom.xml``, into
``~/.cache/kthrottle/spark-<version>/jars``. The same fetch-once pattern as ``proxy.local_kafka``: a
marker written after a complete copy (recording the pom it came from) and a file lock around the fetch.

Environment variables:
    KTHROTTLE_CACHE       cache root (default ``~/.cache/kthrottle``)
    KTHROTTLE_SPARK_JARS  use this directory of connector jars as is, skipping Maven
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SPARK_VERSION = "4.2.0"
"""pyspark and connector version. 4.3.0 is on PyPI but its connector is not on Maven Central."""

CONNECTOR = f"spark-sql-kafka-0-10_2.13-{SPARK_VERSION}.jar"

_POM = Path(__file__).resolve().parent.parent / "harness" / "spark" / "pom.xml"
_MARKER = ".complete"


def _cache_root() -> Path:
    return Path(os.environ.get("KTHROTTLE_CACHE") or Path.home() / ".cache" / "kthrottle").expanduser()


def _pom_digest() -> str:
    """The marker records the pom it was fetched with, so editing the pom refetches."""
    return hashlib.sha256(_POM.read_bytes()).hexdigest()


def ensure_spark_kafka_jars() -> list[Path]:
    """Return the connector's jars (for ``spark.jars``), fetching them with Maven the first time."""
    override = os.environ.get("KTHROTTLE_SPARK_JARS")
    if override:
        jars = sorted(Path(override).expanduser().glob("*.jar"))
        if not any(jar.name == CONNECTOR for jar in jars):
            raise RuntimeError(f"KTHROTTLE_SPARK_JARS={override} holds no {CONNECTOR}")
        return jars
    if not _POM.is_file():
        raise RuntimeError(f"cannot fetch Spark's Kafka connector: {_POM} is missing")
    base = _cache_root() / f"spark-{SPARK_VERSION}"
    libs = base / "jars"
    marker = base / _MARKER
    digest = _pom_digest()
    if not (marker.is_file() and marker.read_text().strip() == digest):
        base.mkdir(parents=True, exist_ok=True)
        with open(base / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (marker.is_file() and marker.read_text().strip() == digest):
                _fetch(base, libs, marker, digest)
    return sorted(libs.glob("*.jar"))


def _fetch(base: Path, libs: Path, marker: Path, digest: str) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise RuntimeError(
            "Apache Maven ('mvn') is not on PATH: it is needed once to fetch Spark's Kafka connector "
            f"{SPARK_VERSION} from Maven Central into {libs} (or set KTHROTTLE_SPARK_JARS)"
        )
    marker.unlink(missing_ok=True)
    partial = base / "jars.partial"
    shutil.rmtree(partial, ignore_errors=True)
    cmd = [
        mvn, "-q", "-B", "-f", str(_POM), "dependency:copy-dependencies",
        f"-DoutputDirectory={partial}", "-DincludeScope=runtime",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (partial / CONNECTOR).is_file():
        output = (done.stdout + done.stderr).strip()[-4000:]
        raise RuntimeError(f"fetching Spark's Kafka connector failed ({' '.join(cmd)}):\n{output}")
    shutil.rmtree(libs, ignore_errors=True)
    partial.rename(libs)
    marker.write_text(digest + "\n")


if __name__ == "__main__":
    print(",".join(str(jar) for jar in ensure_spark_kafka_jars()))
