"""Seeded hostile PROXY protocol headers against a real proxy that requires them (issue 20).

Connection n draws everything it sends from `Random(f"{SEED}/{n}")` (KTHROTTLE_FUZZ_SEED overrides
the seed): a valid v1 or v2 header (random addresses, ports, TLVs, a CRC sometimes) then ApiVersions,
sent whole or in small pieces; or such a header mutated (bytes flipped, inserted, deleted, cut, the
v2 length overwritten). What must hold: every valid header's request is answered; every mutated one
is answered or closed, within the setup timeout, never hung; the proxy logs no traceback and no
internal error, names what was wrong for each closed connection, and still serves a fresh client.
"""

from __future__ import annotations

import os
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness.local_kafka import LocalKafka
from protocol.proxy_header import ProxyHeaderError, ProxyHeaderReader, encode_v1, encode_v2

from .proxies import RunningProxy
from .storms import api_versions_request

SEED = int(os.environ.get("KTHROTTLE_FUZZ_SEED", "7"))
CONNECTIONS = 300
#: Connections in flight at once (a cut header waits out the setup timeout).
PARALLEL = 16
#: The proxy's connection_setup_timeout_ms in this test: a header cut short is closed after it.
SETUP_TIMEOUT_MS = 2000


def _address(rng: random.Random, v6: bool) -> tuple[str, int]:
    if v6:
        return ":".join(f"{rng.randrange(0x10000):x}" for _ in range(8)), rng.randrange(65536)
    return ".".join(str(rng.randrange(256)) for _ in range(4)), rng.randrange(65536)


def _header(rng: random.Random) -> bytes:
    v6 = rng.random() < 0.3
    source, destination = _address(rng, v6), _address(rng, v6)
    if rng.random() < 0.4:
        return encode_v1(source, destination)
    tlvs = tuple((rng.choice([0x01, 0x02, 0x04, 0x05, 0xE0]), rng.randbytes(rng.randrange(0, 40)))
                 for _ in range(rng.randrange(0, 3)))
    return encode_v2(source, destination, tlvs=tlvs, crc=rng.random() < 0.3)


def _mutate(rng: random.Random, data: bytes) -> bytes:
    raw = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        kind = rng.choice(["flip", "insert", "delete", "cut", "length"])
        at = rng.randrange(len(raw)) if raw else 0
        if kind == "flip" and raw:
            raw[at] ^= 1 << rng.randrange(8)
        elif kind == "insert":
            raw[at:at] = rng.randbytes(rng.randrange(1, 8))
        elif kind == "delete" and raw:
            del raw[at:at + rng.randrange(1, 8)]
        elif kind == "cut":
            del raw[at:]
        elif kind == "length" and len(raw) >= 16:
            raw[14:16] = rng.randrange(65536).to_bytes(2, "big")
    return bytes(raw)


def _parses(data: bytes) -> bool:
    """Whether the proxy's own reader takes these bytes as a whole, valid header."""
    try:
        return ProxyHeaderReader().feed(data) is not None
    except ProxyHeaderError:
        return False


def _exchange(port: int, rng: random.Random, payload: bytes) -> str:
    """Send `payload` (whole or in pieces); 'answered', 'closed' or 'hung'."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            if rng.random() < 0.3:
                for i in range(0, len(payload), 3):
                    sock.sendall(payload[i:i + 3])
                    time.sleep(0.001)
            else:
                sock.sendall(payload)
            sock.settimeout(SETUP_TIMEOUT_MS / 1000 + 5)
            data = sock.recv(4)
        except (ConnectionResetError, BrokenPipeError):
            return "closed"
        except TimeoutError:
            return "hung"
    return "answered" if len(data) == 4 else "closed"


def _one(port: int, n: int) -> tuple[str, str, str | None]:
    """(kind, outcome, what was wrong or None) of connection n."""
    rng = random.Random(f"{SEED}/{n}")
    header = _header(rng)
    mutated = rng.random() < 0.6
    sent = _mutate(rng, header) if mutated else header
    kind = "mutated" if mutated else "valid"
    outcome = _exchange(port, rng, sent + api_versions_request(n))
    problem = None
    if outcome == "hung" or (not mutated and outcome != "answered"):
        problem = f"connection {n} ({kind}, {sent[:40].hex()}): {outcome}"
    elif mutated and outcome == "answered" and not _parses(sent):
        problem = f"connection {n}: answered after bytes the reader refuses: {sent[:40].hex()}"
    return kind, outcome, problem


def test_seeded_proxy_headers_are_answered_or_closed_never_hung(kafka_cluster: LocalKafka,
                                                                tmp_path: Path) -> None:
    config = tmp_path / "pp.toml"
    config.write_text(f'[proxy]\nproxy_protocol = "v1,v2"\nproxy_protocol_trusted = ["127.0.0.1"]\n'
                      f"connection_setup_timeout_ms = {SETUP_TIMEOUT_MS}\n")
    proxy = RunningProxy(kafka_cluster.bootstrap, extra_args=["--config", str(config)])
    outcomes: dict[str, dict[str, int]] = {"valid": {}, "mutated": {}}
    try:
        with ThreadPoolExecutor(PARALLEL) as pool:
            results = list(pool.map(lambda n: _one(proxy.port, n), range(CONNECTIONS)))
        fresh = _exchange(proxy.port, random.Random(0), encode_v2(("10.0.0.1", 1), ("10.0.0.2", 2))
                          + api_versions_request(1))
        log = proxy.log()
        assert proxy.alive(), log[-3000:]
    finally:
        proxy.stop()
    for kind, outcome, _ in results:
        outcomes[kind][outcome] = outcomes[kind].get(outcome, 0) + 1
    print(f"PROXY header fuzz, seed {SEED}: {outcomes}")
    wrong = [problem for _, _, problem in results if problem is not None]
    assert not wrong, wrong[:10]
    assert fresh == "answered"
    assert outcomes["valid"].get("answered", 0) > 60 and outcomes["mutated"].get("closed", 0) > 60, outcomes
    assert "Traceback" not in log and "internal error" not in log.lower(), log[-3000:]
    assert "closed a connection from 127.0.0.1" in log, "a closed connection's reason is logged"
