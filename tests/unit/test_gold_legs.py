"""bench/gold_legs.py's reading of a capture: built packet by packet here, as tcpdump writes them."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from bench.gold_legs import MAX_ANSWER, legs

GOLD, PROXY, UPSTREAM, BROKER = 40001, 9192, 40002, 9092


class Capture:
    """A pcap of loopback TCP segments (Ethernet link type, as Linux writes `lo`)."""

    def __init__(self) -> None:
        self.packets: list[bytes] = []
        self.seq: dict[tuple[int, int], int] = {}

    def send(self, at: float, source: int, destination: int, payload: bytes, *,
             captured: bool = True) -> None:
        seq = self.seq.get((source, destination), 1000)
        self.seq[(source, destination)] = seq + len(payload)
        if not captured:  # over the capture's size filter
            return
        tcp = struct.pack(">HHIIBBHHH", source, destination, seq, 0, 5 << 4, 0x18, 65535, 0, 0) + payload
        ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0, 0, 64, 6, 0, bytes([127, 0, 0, 1]),
                         bytes([127, 0, 0, 1])) + tcp
        frame = bytes(12) + b"\x08\x00" + ip
        seconds, micros = int(at), round((at - int(at)) * 1e6)
        self.packets.append(struct.pack("<IIII", seconds, micros, len(frame), len(frame)) + frame)

    def write(self, path: Path) -> Path:
        path.write_bytes(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1) + b"".join(self.packets))
        return path


def produce(correlation: int, client_id: str = "gold", records: int = 1100) -> bytes:
    body = struct.pack(">hhih", 0, 9, correlation, len(client_id)) + client_id.encode() + bytes(records)
    return struct.pack(">i", len(body)) + body


def answer(correlation: int) -> bytes:
    body = struct.pack(">i", correlation) + bytes(50)
    return struct.pack(">i", len(body)) + body


def test_each_leg_is_timed_by_correlation_id(tmp_path: Path) -> None:
    capture = Capture()
    for n in range(1, 4):
        t = 100.0 + n
        capture.send(t, GOLD, PROXY, produce(n))
        capture.send(t + 0.001, UPSTREAM, BROKER, produce(n))
        capture.send(t + 0.001 + 0.005 * n, BROKER, UPSTREAM, answer(n))
        capture.send(t + 0.0015 + 0.005 * n, PROXY, GOLD, answer(n))
    capture.send(104.0, 40003, PROXY, produce(9, "bronze"))  # another client's: not gold's
    timed = legs(capture.write(tmp_path / "legs.pcap"), PROXY, BROKER)
    assert [round(leg.at, 3) for leg in timed] == [101.0, 102.0, 103.0]
    assert [round(leg.proxy_in, 1) for leg in timed] == [1.0, 1.0, 1.0]
    assert [round(leg.broker, 1) for leg in timed] == [5.0, 10.0, 15.0]
    assert [round(leg.proxy_out, 1) for leg in timed] == [0.5, 0.5, 0.5]


def test_a_lost_segment_costs_only_its_own_requests(tmp_path: Path) -> None:
    """A segment over the capture's size limit holds the end of request 2 and the start of request 3:
    reading starts again at request 4, found by gold's client id, and 38 of 40 requests are timed."""
    capture = Capture()
    for n in range(1, 41):
        capture.send(200.0 + n, GOLD, PROXY, produce(n))
        capture.send(200.5 + n, PROXY, GOLD, answer(n))
        capture.send(200.1 + n, BROKER, UPSTREAM, answer(n))
    for n in [1, *range(4, 41)]:
        capture.send(200.01 + n, UPSTREAM, BROKER, produce(n) if n != 1 else produce(1))
        if n == 1:  # 2 and the head of 3 in one segment, over the size limit, then the rest of 3
            two_three = produce(2) + produce(3)
            capture.send(202.01, UPSTREAM, BROKER, two_three[:len(produce(2)) + 100], captured=False)
            capture.send(203.01, UPSTREAM, BROKER, two_three[len(produce(2)) + 100:])
    timed = legs(capture.write(tmp_path / "legs.pcap"), PROXY, BROKER)
    assert len(timed) == 38
    assert round(timed[0].at) == 201 and round(timed[1].at) == 204


def test_a_tls_leg_that_does_not_add_up_is_refused(tmp_path: Path) -> None:
    """Over TLS requests are counted, not read: one record short, and nothing is paired by guess."""
    capture = Capture()

    def record(size: int) -> bytes:
        return bytes([23, 3, 3]) + struct.pack(">H", size) + bytes(size)

    for n in range(1, 4):
        capture.send(300.0 + n, GOLD, PROXY, produce(n))
        if n != 2:
            capture.send(300.001 + n, UPSTREAM, BROKER, record(1200))
        capture.send(300.003 + n, BROKER, UPSTREAM, record(MAX_ANSWER - 100))
        capture.send(300.004 + n, PROXY, GOLD, answer(n))
    with pytest.raises(ValueError, match="3 requests of 'gold', 2 records sent on to the broker"):
        legs(capture.write(tmp_path / "legs.pcap"), PROXY, BROKER, tls_upstream=True)
