"""Jars from Maven Central, fetched once with Maven into a cache outside the repository.

Kafka, ZooKeeper and Spark's Kafka connector all come this way: each has a pom under `harness/`
whose runtime dependencies are copied into `<cache>/<name>/<dir>`. A marker file written only after
a complete copy records the pom's digest, so an interrupted download is redone and an edited pom
refetches; a file lock keeps two processes (parallel test runs) from fetching into one directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

_MARKER = ".complete"


def cache_root() -> Path:
    """`$KTHROTTLE_CACHE`, or `~/.cache/kthrottle`: a clean checkout does not refetch."""
    return Path(os.environ.get("KTHROTTLE_CACHE") or Path.home() / ".cache" / "kthrottle").expanduser()


def fetch_once(pom: Path, dest: Path, *, what: str, expect: str, hint: str) -> Path:
    """`dest` holding the runtime dependencies of `pom`, copied there by Maven the first time.

    `expect` is a file-name pattern that must match in a good copy (the main jar); `what` and `hint`
    name the jars and the way around Maven in error messages.
    """
    if not pom.is_file():
        raise RuntimeError(f"cannot fetch {what}: {pom} is missing (run from a source checkout)")
    base = dest.parent
    marker = base / _MARKER
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()
    if marker.is_file() and marker.read_text().strip() == digest:
        return dest
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file() and marker.read_text().strip() == digest:
            return dest
        mvn = shutil.which("mvn")
        if mvn is None:
            raise RuntimeError(f"Apache Maven ('mvn') is not on PATH: it is needed once to fetch {what} "
                               f"from Maven Central into {dest} ({hint})")
        marker.unlink(missing_ok=True)
        partial = base / f"{dest.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        cmd = [mvn, "-q", "-B", "-f", str(pom), "dependency:copy-dependencies",
               f"-DoutputDirectory={partial}", "-DincludeScope=runtime"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not any(partial.glob(expect)):
            output = (done.stdout + done.stderr).strip()[-4000:]
            raise RuntimeError(f"fetching {what} failed ({' '.join(cmd)}):\n{output}")
        shutil.rmtree(dest, ignore_errors=True)
        partial.rename(dest)
        marker.write_text(digest + "\n")
    return dest
