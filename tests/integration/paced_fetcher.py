"""One consumer that reads a backlog evenly, one Fetch at a time: the fetch bed's floor.

The produce bed judges the proxy against `direct paced F` (gold beside one producer sending F x
direct's goodput evenly: what the broker allows gold when nothing queues ahead of it). This is the
consumer case's equivalent: one connection to the broker's listener, one Fetch in flight, each
asking for at most ASK_BYTES (what the concurrency limit lets a catching-up consumer ask for,
protocol/broker_admission.py), sent no sooner than the bytes already read allow at
`offered_rate`. It is what a perfect front end would make of the consumers' load: the broker
encrypts one bounded piece at a time and idles whenever the pace allows.

A client of its own rather than librdkafka: librdkafka prefetches up to `queued.max.messages.kbytes`
per partition whatever the application consumes, so a paced librdkafka consumer still sends its
fetches in bursts. Fetch v12 (topic names), every partition in the request, their order rotated
each time as KIP-74 asks of a client (the broker fills partitions in request order up to
max_bytes). Only complete record batches are counted and read past; the next offset of a partition
is its last complete batch's last offset + 1, and a partition read to its end is read again from
its start (the broker's work per byte is the same; one consumer at the three's pace would need
three backlogs). The bytes counted are whole batches: on the bed's backlog (six 10 KB records a
batch) 0.2 % more than the record values librdkafka's consumers count.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from typing import Any

from kafka.protocol.consumer import FetchRequest, FetchResponse

from protocol.broker_admission import FETCH_BYTES_WHILE_LIMITED
from protocol.frames import frame
from protocol.headers import encode_request_header
from tests.integration.clients import recv_exact

FETCH_VERSION = 12
ASK_BYTES = FETCH_BYTES_WHILE_LIMITED
#: what a partition may bring at most, librdkafka's default max.partition.fetch.bytes
PARTITION_MAX_BYTES = 1_048_576
_BATCH_HEADER = struct.Struct(">qi")  # baseOffset, batchLength
_LAST_OFFSET_DELTA = struct.Struct(">i")  # at 23 bytes into a batch (KIP-98's v2 batch header)


def complete_batches(records: bytes) -> tuple[int, int | None]:
    """The bytes of the complete record batches at the start of `records` (a broker may end a
    partition's data with part of a batch), and the offset after the last of them (None: none)."""
    pos, next_offset = 0, None
    while pos + 27 <= len(records):
        base, length = _BATCH_HEADER.unpack_from(records, pos)
        end = pos + 12 + length
        if length < 15 or end > len(records):
            break
        (delta,) = _LAST_OFFSET_DELTA.unpack_from(records, pos + 23)
        next_offset, pos = base + delta + 1, end
    return pos, next_offset


def _request(topic: str, offsets: list[int], first: int, correlation_id: int) -> bytes:
    r = FetchRequest[FETCH_VERSION]
    order = [(first + n) % len(offsets) for n in range(len(offsets))]
    wanted = [r.FetchTopic.FetchPartition(partition=p, current_leader_epoch=-1, fetch_offset=offsets[p],
                                          last_fetched_epoch=-1, log_start_offset=-1,
                                          partition_max_bytes=PARTITION_MAX_BYTES) for p in order]
    body = r(max_wait_ms=500, min_bytes=1, max_bytes=ASK_BYTES, isolation_level=0, session_id=0,
             session_epoch=-1, topics=[r.FetchTopic(topic=topic, partitions=wanted)],
             forgotten_topics_data=[], rack_id="")
    return frame(encode_request_header(1, FETCH_VERSION, correlation_id, "best-effort-paced")
                 + bytes(body.encode()))


def fetch_paced(bootstrap: str, topic: str, partitions: int, seconds: float, offered_rate: float,
                ssl_ca: str | None) -> dict[str, Any]:
    """Read `topic` from its start at `offered_rate` bytes/s for `seconds`; the record bytes
    received in each second (as bed_clients.consume reports them, one consumer)."""
    host, port = bootstrap.rsplit(":", 1)
    response = FetchResponse[FETCH_VERSION]
    decode = response._struct.compiled_decode_from(FETCH_VERSION, compact=True, tagged=True,
                                                   data_class=response[None])
    per_second = [0] * (int(seconds) + 1)
    offsets = [0] * partitions
    raw = socket.create_connection((host, int(port)), timeout=30)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock = (raw if ssl_ca is None
            else ssl.create_default_context(cafile=ssl_ca).wrap_socket(raw, server_hostname=host))
    start = time.monotonic()
    read = 0
    n = 0
    with sock:
        while (now := time.monotonic()) - start < seconds:
            due = start + read / offered_rate
            if due > now:
                time.sleep(min(due - now, start + seconds - now))
                continue
            n += 1
            sock.sendall(_request(topic, offsets, n, n))
            (size,) = struct.unpack(">i", recv_exact(sock, 4))
            message, _end = decode(memoryview(recv_exact(sock, size)), 5)  # after the v1 header
            if message.error_code:
                raise RuntimeError(f"Fetch answered error {message.error_code}")
            got = 0
            for found in message.responses:
                for part in found.partitions:
                    if part.error_code:
                        raise RuntimeError(f"Fetch of {topic}-{part.partition_index} answered error "
                                           f"{part.error_code}")
                    length, next_offset = complete_batches(part.records or b"")
                    if next_offset is not None:
                        offsets[part.partition_index] = next_offset
                    if offsets[part.partition_index] >= part.high_watermark:  # read to its end: again
                        offsets[part.partition_index] = part.log_start_offset
                    got += length
            if got == 0:
                raise RuntimeError(f"a Fetch of {topic} at offsets {offsets} brought no whole batch")
            read += got
            per_second[min(int(time.monotonic() - start), int(seconds))] += got
    return {"consumed": [per_second], "errors": []}


__all__ = ["ASK_BYTES", "complete_batches", "fetch_paced"]
