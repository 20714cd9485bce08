"""A real HAProxy (Debian's, from `make tools`) in TCP mode, for the tests of the PROXY protocol.

Each frontend listens on `bind_host:listen_port` and relays every connection to its backend,
prepending a PROXY header (`send-proxy-v2` or `send-proxy`, i.e. v1) that names the client's address,
or none (`mode=None`: a plain relay, for "a header is required and none came"). `source` makes
HAProxy connect to the backends from that local address, so the backend sees the balancer at a
known address (e.g. 127.0.0.5, left out of `proxy_protocol_trusted` for the "untrusted sender" test).

The topology in front of kthrottle: the proxy listens on 127.0.0.1 at its bootstrap port P and one
port per broker (P + 1 + node id) and puts one host in every broker address it returns. So HAProxy
listens on *the same port numbers* on another loopback address (`PROXY_HOST`, 127.0.0.10; nothing
else binds there) and kthrottle runs with `--advertised-host 127.0.0.10`: a client bootstraps at
127.0.0.10:P, learns 127.0.0.10:P+1+N for broker N from Metadata, and every connection it makes,
to the bootstrap or to a broker's port, goes through HAProxy and arrives with a header.
`same_ports(proxy_port, node_ids)` builds that mapping. A test that only sends ApiVersions (a
storm) needs only the bootstrap frontend; `--advertised-host` matters once a real client follows
Metadata.

Readiness is read from /proc/net/tcp (the listening sockets), not by connecting: a probe connection
would reach the backend with a header and count against its connection quotas.
"""

from __future__ import annotations

import atexit
import errno
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal, Self

from harness.ports import free_port_block

Address = tuple[str, int]
Mode = Literal["send-proxy-v2", "send-proxy"] | None

#: Where HAProxy listens in front of kthrottle (see the module docstring): a loopback alias of its own.
PROXY_HOST = "127.0.0.10"

#: Connections HAProxy holds at once, per frontend and in all (global): above the tests' storms
#: (32 in flight, each held up to a second by a throttle) and bursts (a few hundred).
MAXCONN = 4096

_MODES = ("send-proxy-v2", "send-proxy", None)


def haproxy_executable() -> str:
    found = shutil.which("haproxy")
    if found is None and os.access("/usr/sbin/haproxy", os.X_OK):  # not on a non-root PATH
        found = "/usr/sbin/haproxy"
    if found is None:
        raise RuntimeError("haproxy is not installed: run `make tools` (harness/install_tools.sh)")
    return found


def same_ports(proxy_port: int, node_ids: Iterable[int],
               upstream_host: str = "127.0.0.1") -> dict[int, Address]:
    """Frontends for kthrottle's bootstrap port and each broker's port, on the same port numbers."""
    ports = [proxy_port, *(proxy_port + 1 + node for node in node_ids)]
    return {port: (upstream_host, port) for port in ports}


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _free_port(host: str) -> int:
    """A port for HAProxy's frontend on ``host``, from this worker's slice (``harness.ports``)."""
    try:
        return free_port_block(1, host)
    except OSError as exc:
        raise RuntimeError(f"HAProxy could not listen on {host}: {exc}") from exc


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise RuntimeError(f"HAProxy could not listen on {_hostport(host, port)}: {exc}") from exc
    return True


def _proc_address(host: str, port: int) -> str:
    """`host:port` as /proc/net/tcp{,6} spells a local address: 32-bit words in host byte order, hex."""
    packed = ipaddress.ip_address(host).packed
    words = "".join(f"{int.from_bytes(packed[i:i + 4], sys.byteorder):08X}" for i in range(0, len(packed), 4))
    return f"{words}:{port:04X}"


def _socket_inodes(pid: int) -> set[str]:
    """The inodes of a process's sockets, as /proc/<pid>/fd links name them ("socket:[inode]")."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _listening(pid: int, host: str, port: int) -> bool:
    """Whether process `pid` itself listens on host:port (not some other process that took the port)."""
    table = "/proc/net/tcp6" if ipaddress.ip_address(host).version == 6 else "/proc/net/tcp"
    want = _proc_address(host, port)
    with open(table) as lines:
        next(lines)
        listening = {fields[9] for fields in map(str.split, lines)
                     if fields[1] == want and fields[3] == "0A"}  # TCP_LISTEN; [9] is the inode
    if not listening:
        return False
    try:
        return bool(listening & _socket_inodes(pid))
    except FileNotFoundError:  # exited: the caller sees it
        return False


#: Instances not stopped yet: stopped at interpreter exit, so a test that forgot (or a run that
#: failed between start and `with`) leaves no haproxy holding its ports. HAProxy retries a busy
#: port at start, so an orphan can even bind after the test's process is gone.
_running: weakref.WeakSet[RunningHaproxy] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for running in list(_running):
        running.stop()


class RunningHaproxy:
    """`haproxy -f <cfg> -db` (foreground) as a subprocess; its stderr goes to a temporary file,
    `log()`: alerts, and a tcplog line for each connection that ended abnormally (a backend refused or
    closed it first), or for every connection with `log_connections`.

    `backends`: {listen port: backend address}, or one backend address (then a free port is picked:
    `port`). `mode`: the PROXY header HAProxy sends, or None for none. `bind_host`: where every
    frontend listens. `source`: the local address HAProxy connects to the backends from.

    Returns once every frontend listens; raises RuntimeError with the log if haproxy is missing,
    refuses its configuration or exits early. `stop()` (or leaving the `with`): SIGTERM, then
    SIGKILL after 5 s.
    """

    def __init__(self, backends: Mapping[int, Address] | Address, mode: Mode = "send-proxy-v2", *,
                 bind_host: str = "127.0.0.1", source: str | None = None,
                 log_connections: bool = False, start_timeout: float = 15.0) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode {mode!r} is none of {_MODES}")
        executable = haproxy_executable()
        if isinstance(backends, tuple):
            self.frontends: dict[int, Address] = {_free_port(bind_host): backends}
        else:
            self.frontends = dict(backends)
        if not self.frontends:
            raise ValueError("RunningHaproxy needs at least one frontend")
        busy = [port for port in self.frontends if not _port_free(bind_host, port)]
        if busy:
            raise RuntimeError(f"ports {busy} are already in use on {bind_host}: HAProxy cannot listen there")
        self.bind_host = bind_host
        self.mode = mode
        self.source = source
        self.workdir = Path(tempfile.mkdtemp(prefix="haproxy-"))
        self.config_path = self.workdir / "haproxy.cfg"
        self.config_path.write_text(self.config(log_connections))
        self.log_path = self.workdir / "haproxy.log"
        # Open for haproxy's whole life (closed in stop()), so no context manager.
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.process = subprocess.Popen([executable, "-f", str(self.config_path), "-db"],
                                        stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        _running.add(self)
        deadline = time.monotonic() + start_timeout
        waiting = list(self.frontends)
        while waiting:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"haproxy exited with {self.process.returncode} at start; config "
                                   f"{self.config_path}:\n{self.config_path.read_text()}\nlog:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"haproxy did not listen on {bind_host} ports {waiting} within "
                                   f"{start_timeout}s:\n{self.log()}")
            waiting = [port for port in waiting if not _listening(self.process.pid, bind_host, port)]
            if waiting:
                time.sleep(0.05)

    @property
    def port(self) -> int:
        """The first frontend's port (the only one when a single backend was given)."""
        return next(iter(self.frontends))

    @property
    def address(self) -> Address:
        return self.bind_host, self.port

    @property
    def bootstrap(self) -> str:
        return _hostport(self.bind_host, self.port)

    def config(self, log_connections: bool) -> str:
        header = "" if self.mode is None else f" {self.mode}"
        source = "" if self.source is None else f" source {self.source}"
        lines = [
            "global",
            f"    maxconn {MAXCONN}",
            "    log stderr format raw local0 info",
            "",
            "defaults",
            "    mode tcp",
            "    log global",
            "    option tcplog",
            *([] if log_connections else ["    option dontlog-normal"]),
            "    timeout connect 5s",
            "    timeout client 60s",
            "    timeout server 60s",
            f"    maxconn {MAXCONN}",
        ]
        for port, (host, backend_port) in self.frontends.items():
            lines += [
                "",
                f"frontend fe_{port}",
                f"    bind {_hostport(self.bind_host, port)}",
                f"    default_backend be_{port}",
                "",
                f"backend be_{port}",
                f"    server s1 {_hostport(host, backend_port)}{header}{source}",
            ]
        return "\n".join(lines) + "\n"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        _running.discard(self)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self._log.close()
