"""The fetch bed's paced consumer reads past whole record batches only (paced_fetcher.py)."""

from __future__ import annotations

from kafka.record.default_records import DefaultRecordBatchBuilder

from tests.integration.paced_fetcher import complete_batches


def _batch(base_offset: int, records: int, value: bytes = b"v" * 100) -> bytes:
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=False, producer_id=-1,
                                        producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
    for n in range(records):
        builder.append(n, timestamp=1, key=None, value=value, headers=[])
    out = bytearray(builder.build())
    out[0:8] = base_offset.to_bytes(8, "big")  # the broker assigns the offsets
    return bytes(out)


def test_whole_batches_are_counted_and_the_next_offset_follows_the_last() -> None:
    first, second = _batch(0, 3), _batch(3, 6)
    assert complete_batches(first + second) == (len(first) + len(second), 9)


def test_a_partial_batch_at_the_end_is_neither_counted_nor_read_past() -> None:
    first, second = _batch(40, 2), _batch(42, 5)
    for cut in (1, 12, 27, len(second) - 1):  # inside the header, at its length, one byte short
        assert complete_batches(first + second[:cut]) == (len(first), 42)


def test_no_batch_means_no_offset() -> None:
    assert complete_batches(b"") == (0, None)
    assert complete_batches(_batch(7, 1)[:30]) == (0, None)
