"""Apache Kafka's jars (fetched from Maven Central once) and the JVM that runs them, for the harness.

Why a module of its own: the local cluster, ZooKeeper, the test tools and the telemetry plugin all need
the same jars, the same ``java`` and the same class-data archives, and none of them needs the others.

Environment variables:
    KTHROTTLE_CACHE       cache root for the jars (default ``~/.cache/kthrottle``)
    KTHROTTLE_KAFKA_LIBS  use this directory of Kafka jars as is, skipping Maven
    KTHROTTLE_KAFKA_CDS   set to 0 to turn off the JVM class-data-sharing archives (see ``ClassArchive``)
    JAVA_HOME             the JVM to run (else ``java`` on PATH)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from .maven import cache_root, fetch_once

KAFKA_VERSION = "4.3.1"

_POM = Path(__file__).resolve().parent / "pom.xml"
_CDS_STALE_S = 3600.0



def ensure_kafka_jars() -> Path:
    """Return the directory holding Kafka's runtime jars, fetching them with Maven the first time."""
    override = os.environ.get("KTHROTTLE_KAFKA_LIBS")
    if override:
        libs = Path(override).expanduser()
        if not any(libs.glob("kafka_2.13-*.jar")):
            raise RuntimeError(f"KTHROTTLE_KAFKA_LIBS={override} holds no kafka_2.13-*.jar")
        return libs
    return fetch_once(_POM, cache_root() / f"kafka-{KAFKA_VERSION}" / "libs",
                      what=f"the Kafka {KAFKA_VERSION} jars", expect="kafka_2.13-*.jar",
                      hint="or point KTHROTTLE_KAFKA_LIBS at a Kafka distribution's libs/ directory")


def kafka_classpath() -> str:
    """The ``java -cp`` argument for every Kafka class (the JVM expands the ``*`` itself)."""
    return str(ensure_kafka_jars() / "*")


def java_executable() -> str:
    """Pick ``$JAVA_HOME/bin/java`` when set, else ``java`` on PATH; fail with a clear message."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise RuntimeError("no 'java' on PATH and JAVA_HOME is unset: Kafka needs a JDK/JRE 17+")
    return java




def java_tool(name: str) -> str:
    """Another JDK tool (``javac``) beside the ``java`` that runs Kafka, so both are one JDK."""
    java = Path(java_executable())
    for candidate in (java.parent / name, java.resolve().parent / name):
        if candidate.is_file():
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"no '{name}' beside {java} nor on PATH: a JDK 17+ (not only a JRE) is needed")
    return found


class ClassArchive:
    """A dynamic class-data-sharing (AppCDS) archive of the classes one kind of Kafka JVM loads.

    Why: on a 2-core machine three brokers starting at once are CPU-bound, mostly loading and verifying
    classes; mapping them from an archive cuts each broker's start-up CPU by about 40%. The first run
    records the archive when a JVM exits cleanly (``-XX:ArchiveClassesAtExit``, into a private file
    renamed into place, so concurrent runs never see half a file); later runs map it. The key covers the
    JVM and the jars, so a new JDK or refetched jars simply record a new archive. If the JVM rejects an
    archive it only logs a warning and starts without it (``-Xshare:auto``, the default).
    """

    def __init__(self, kind: str, java: str, libs: Path) -> None:
        self.enabled = os.environ.get("KTHROTTLE_KAFKA_CDS", "1") != "0"
        key = "none"
        try:
            real_java = Path(java).resolve()
            jars = sorted((p.name, p.stat().st_size) for p in libs.glob("*.jar"))
            key = hashlib.sha256(
                f"{real_java}|{real_java.stat().st_mtime_ns}|{libs.resolve()}|{jars}".encode()
            ).hexdigest()[:16]
        except OSError:
            self.enabled = False  # an optimisation only: never a reason to fail
        self.path = cache_root() / f"kafka-{KAFKA_VERSION}" / "cds" / f"{kind}-{key}.jsa"

    def flags(self, record: bool) -> tuple[list[str], Path | None]:
        """JVM flags to map the archive, or (when ``record`` and none exists) to record it at exit.

        Returns the flags and the private file a recording JVM writes, to ``publish`` after a clean exit.
        """
        if not self.enabled:
            return [], None
        if self.path.is_file():
            return [f"-XX:SharedArchiveFile={self.path}"], None
        if not record:
            return [], None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for stale in self.path.parent.glob("*.tmp"):  # left by a run that was SIGKILLed
                if time.time() - stale.stat().st_mtime > _CDS_STALE_S:
                    stale.unlink(missing_ok=True)
            fd, name = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
            os.close(fd)
        except OSError:  # read-only cache: run without an archive
            return [], None
        # The dump lists every class it cannot archive as a warning: keep that noise out of the log.
        return [f"-XX:ArchiveClassesAtExit={name}", "-Xlog:cds=off", "-Xlog:cds+dynamic=off"], Path(name)

    def publish(self, recorded: Path, ok: bool) -> None:
        """Move a recorded archive into place if the JVM exited cleanly; drop it otherwise."""
        with contextlib.suppress(OSError):
            if ok and recorded.stat().st_size > 0:
                os.replace(recorded, self.path)
            else:
                recorded.unlink()
