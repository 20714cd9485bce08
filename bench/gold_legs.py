"""Where gold's time goes through a proxy on an overload bed: each request timed on the wire.

tcpdump (Debian's, `make bench-tools`; as root) captures the loopback packets of the proxy's port for the
broker and of the broker's port while a phase runs. Each of gold's Produce requests then has three
legs, timed where its bytes crossed loopback:

    proxy in    reached the proxy -> sent on to the broker (a wait for a slot, the event loop)
    broker      sent to the broker -> the broker's answer came back (its queue, its work, its pauses)
    proxy out   the answer came back -> sent on to gold

Gold is told apart by its client id, and its requests and answers are paired by correlation id,
which the proxy keeps. The broker's leg may be TLS, whose bytes cannot be read: there a request is
the one record of over MIN_REQUEST bytes the proxy writes for it, and answers are paired in order
(a broker answers a connection's requests in order). A capture that does not add up (a packet the
kernel dropped, a leg that comes out negative) raises instead of printing a guess.

Used by `python -m bench.overload --legs` and `python -m bench.fetch_overload --legs`
(docs/protecting-the-cluster.md has their figures).
"""

from __future__ import annotations

import contextlib
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: gold's records are 1 KB, so each of its Produce requests is bigger; fetches and answers are not
MIN_REQUEST = 1000
#: an answer to a 1-record Produce is under 100 bytes (over TLS, under 200)
MAX_ANSWER = 200
#: packets over this are the consumers' data, which the legs do not need and the capture cannot keep
#: up with; gold's requests sent on together after a wait for a slot come to several KB
MAX_PACKET = 16_000
_PRODUCE = 0
_TLS_APPLICATION_DATA = 23


@dataclass(frozen=True)
class Leg:
    """One of gold's requests: when it reached the proxy (s, epoch) and its three legs (ms)."""

    at: float
    proxy_in: float
    broker: float
    proxy_out: float

    @property
    def whole(self) -> float:
        return self.proxy_in + self.broker + self.proxy_out


def _segments(pcap: Path) -> Iterator[tuple[float, int, int, int, bytes]]:
    """(time, source port, destination port, seq, payload) of each captured TCP segment with data."""
    data = pcap.read_bytes()
    magic, = struct.unpack_from("<I", data, 0)
    scale = 1e9 if magic == 0xA1B23C4D else 1e6
    link, = struct.unpack_from("<I", data, 20)
    link_header = {1: 14, 113: 16}.get(link)
    if link_header is None:
        raise ValueError(f"{pcap}: link type {link} (expected loopback's Ethernet or Linux cooked)")
    pos = 24
    while pos + 16 <= len(data):
        seconds, fraction, captured, _ = struct.unpack_from("<IIII", data, pos)
        packet = data[pos + 16:pos + 16 + captured]
        pos += 16 + captured
        ip = packet[link_header:]
        tcp = ip[(ip[0] & 0x0F) * 4:]
        source, destination, seq = struct.unpack_from(">HHI", tcp, 0)
        payload = tcp[(tcp[12] >> 4) * 4:]
        if payload:
            yield seconds + fraction / scale, source, destination, seq, bytes(payload)


def _streams(pcap: Path) -> dict[tuple[int, int], list[tuple[float, int, bytes]]]:
    """Each direction's segments in capture order, a retransmitted one kept once."""
    streams: dict[tuple[int, int], list[tuple[float, int, bytes]]] = {}
    seen: set[tuple[int, int, int]] = set()
    for at, source, destination, seq, payload in _segments(pcap):
        if (source, destination, seq) not in seen:
            seen.add((source, destination, seq))
            streams.setdefault((source, destination), []).append((at, seq, payload))
    return streams


def _frames(segments: list[tuple[float, int, bytes]], tls: bool,
            marker: bytes | None = None) -> list[tuple[float, bytes]]:
    """Kafka frames (or TLS records), each timed by the segment that brought its last byte.

    After a gap (a segment over MAX_PACKET was not captured) parsing starts again where `marker`
    (the bytes a frame holds at MARKER_AT) says a frame starts, else at the next segment."""
    frames: list[tuple[float, bytes]] = []
    buffer, ends, start, expected, lost = b"", [], 0, None, False
    header = 5 if tls else 4
    for at, seq, payload in segments:
        if expected is not None and seq != expected:
            buffer, ends, start, lost = b"", [], 0, marker is not None
        buffer += payload
        ends.append((len(buffer), at))
        expected = (seq + len(payload)) & 0xFFFFFFFF
        if lost and marker is not None:
            found = buffer.find(marker, MARKER_AT)
            if found < 0:
                buffer, ends = b"", []
                continue
            start, lost = found - MARKER_AT, False
        while start + header <= len(buffer):
            size = header + (struct.unpack_from(">H", buffer, start + 3)[0] if tls
                             else struct.unpack_from(">i", buffer, start)[0])
            if size <= header or start + size > len(buffer):
                break
            end = start + size
            frames.append((next(t for offset, t in ends if offset >= end), buffer[start:end]))
            start = end
    return frames


#: where a request's client id (int16 length, then its bytes) starts: after the size, the API key
#: and version and the correlation id
MARKER_AT = 12


def _client_id(frame: bytes) -> str:
    length, = struct.unpack_from(">h", frame, MARKER_AT)
    return frame[MARKER_AT + 2:MARKER_AT + 2 + length].decode(errors="replace") if length > 0 else ""


def _correlation(frame: bytes, request: bool) -> int:
    return int(struct.unpack_from(">i", frame, 8 if request else 4)[0])


def legs(pcap: Path, proxy_port: int, broker_port: int, *, client_id: str = "gold",
         tls_upstream: bool = False) -> list[Leg]:
    """Gold's requests in `pcap` (captured by `capture`), timed on each leg."""
    streams = _streams(pcap)
    marker = struct.pack(">h", len(client_id)) + client_id.encode()

    def produce(segments: list[tuple[float, int, bytes]]) -> dict[int, float]:
        return {_correlation(frame, True): at for at, frame in _frames(segments, False, marker)
                if len(frame) > MIN_REQUEST and struct.unpack_from(">h", frame, 4)[0] == _PRODUCE
                and _client_id(frame) == client_id}

    def answers(segments: list[tuple[float, int, bytes]]) -> dict[int, float]:
        return {_correlation(frame, False): at for at, frame in _frames(segments, False)
                if len(frame) < MAX_ANSWER}

    to_proxy = {source: produce(segments) for (source, destination), segments in streams.items()
                if destination == proxy_port}
    gold = [port for port, requests in to_proxy.items() if requests]
    if len(gold) != 1:
        raise ValueError(f"{len(gold)} connections of {client_id!r} produced through port {proxy_port}")
    arrived = to_proxy[gold[0]]
    answered = answers(streams.get((proxy_port, gold[0]), []))
    first = min(arrived.values())
    sent_at: dict[int, float] = {}
    back_at: dict[int, float] = {}
    if not tls_upstream:  # the proxy keeps correlation ids: each request is paired on both legs
        for (source, destination), segments in streams.items():
            if destination == broker_port and (forwarded := produce(segments)):
                sent_at.update(forwarded)
                back_at.update(answers(streams.get((broker_port, source), [])))
    else:  # one record over MIN_REQUEST per request, answers in order
        def records(port: int) -> list[float]:
            return [at for at, frame in _frames(streams[(port, broker_port)], True)
                    if len(frame) > MIN_REQUEST and at >= first and frame[0] == _TLS_APPLICATION_DATA]

        upstream = max((port for port, destination in streams if destination == broker_port),
                       key=lambda port: len(records(port)), default=None)
        if upstream is None:
            raise ValueError(f"nothing reached the broker's port {broker_port}")
        sent = records(upstream)
        ordered = sorted(arrived, key=arrived.__getitem__)
        if len(sent) != len(ordered):
            raise ValueError(f"the capture does not add up: {len(ordered)} requests of {client_id!r}, "
                             f"{len(sent)} records sent on to the broker")
        sent_at = dict(zip(ordered, sent, strict=True))
        # answers paired from the last one back: the broker's last record may be TLS's close
        last = max(answered.values(), default=0.0)
        back = [at for at, frame in _frames(streams.get((broker_port, upstream), []), True)
                if len(frame) < MAX_ANSWER and sent[0] < at <= last]
        done = sorted((c for c in answered if c in arrived), key=answered.__getitem__)
        back_at = dict(zip(reversed(done), reversed(back), strict=False))
    out = []
    for correlation in sorted(arrived, key=arrived.__getitem__):
        if not {correlation} <= answered.keys() & sent_at.keys() & back_at.keys():
            continue  # a packet of it over MAX_PACKET, or unanswered at the end
        leg = Leg(arrived[correlation], (sent_at[correlation] - arrived[correlation]) * 1000,
                  (back_at[correlation] - sent_at[correlation]) * 1000,
                  (answered[correlation] - back_at[correlation]) * 1000)
        if min(leg.proxy_in, leg.broker, leg.proxy_out) < -0.05:
            raise ValueError(f"the capture does not add up: request {correlation} has a negative leg {leg}")
        out.append(leg)
    if len(out) < 0.95 * len(arrived):
        raise ValueError(f"only {len(out)} of {len(arrived)} requests of {client_id!r} seen on every leg")
    return out


@contextlib.contextmanager
def capture(work: Path, *ports: int) -> Iterator[Path]:
    """tcpdump on loopback for the packets of `ports` up to MAX_PACKET bytes while the block runs,
    into `work`/legs.pcap (complete once the block has ended)."""
    pcap, log = work / "legs.pcap", work / "tcpdump.log"
    ports_filter = " or ".join(f"port {port}" for port in ports)
    with log.open("w") as err:
        dump = subprocess.Popen(["tcpdump", "-i", "lo", "-n", "-s", str(MAX_PACKET + 200), "-B", "65536",
                                 "-w", str(pcap), f"tcp and ({ports_filter}) and less {MAX_PACKET}"],
                                stderr=err)
    deadline = time.monotonic() + 10
    while "listening on" not in log.read_text():
        if dump.poll() is not None or time.monotonic() > deadline:
            dump.kill()
            raise RuntimeError(f"tcpdump did not start: {log.read_text()[-500:]}")
        time.sleep(0.05)
    try:
        yield pcap
    finally:
        time.sleep(0.5)  # the last answers
        dump.terminate()
        dump.wait(10)
    dropped = [line for line in log.read_text().splitlines() if "dropped by kernel" in line]
    if dropped and not dropped[0].startswith("0 "):
        raise RuntimeError(f"tcpdump lost packets: {dropped[0]}")


def summary(timed: list[Leg], after_s: float) -> str:
    """Each leg's p50/p99 over the requests that reached the proxy `after_s` after the first, and
    which leg was the longest in the slowest 1 %."""
    start = timed[0].at
    kept = [leg for leg in timed if leg.at - start >= after_s]

    def p(values: list[float]) -> str:
        ordered = sorted(values)
        return f"{ordered[len(ordered) // 2]:.1f}/{ordered[int(0.99 * (len(ordered) - 1))]:.1f}"

    slowest = sorted(kept, key=lambda leg: -leg.whole)[:max(1, len(kept) // 100)]
    at_broker = sum(1 for leg in slowest if leg.broker >= max(leg.proxy_in, leg.proxy_out))
    return (f"gold's legs p50/p99 ms ({len(kept)} requests): proxy in {p([x.proxy_in for x in kept])}, "
            f"broker {p([x.broker for x in kept])}, proxy out {p([x.proxy_out for x in kept])}, "
            f"in all {p([x.whole for x in kept])}; the broker's leg the longest in {at_broker} of "
            f"the slowest {len(slowest)}")


__all__ = ["Leg", "capture", "legs", "summary"]
