"""Splitting a TCP byte stream into Kafka frames (4-byte big-endian size, then that many bytes).

Kept separate from everything else because both directions use it and it is the only place
that buffers partial data.
"""

from __future__ import annotations

from .errors import FrameSizeError

#: Kafka's own default for `socket.request.max.bytes`; a larger request frame is refused.
DEFAULT_MAX_REQUEST_BYTES = 100 * 1024 * 1024

#: Responses are not limited by the broker's request limit (a Fetch may return up to
#: `fetch.max.bytes` and more), so only the protocol's own int32 bound applies.
MAX_RESPONSE_BYTES = 2**31 - 1


class FrameSplitter:
    """Accumulates bytes and returns every complete frame body (without its size prefix).

    A frame of size zero is legal at this level (SASL v0 raw tokens may be empty).
    """

    __slots__ = ("_buf", "_max_bytes", "_name")

    def __init__(self, max_bytes: int, name: str = "frame") -> None:
        self._buf = bytearray()
        self._max_bytes = max_bytes
        self._name = name

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        frames: list[bytes] = []
        pos = 0
        end = len(buf)
        while end - pos >= 4:
            size = int.from_bytes(buf[pos : pos + 4], "big", signed=True)
            if size < 0 or size > self._max_bytes:
                raise FrameSizeError(
                    f"{self._name} size {size} is outside 0..{self._max_bytes} bytes"
                )
            if end - pos - 4 < size:
                break
            pos += 4
            with memoryview(buf) as view:  # one copy per frame, not two
                frames.append(bytes(view[pos : pos + size]))
            pos += size
        if pos:
            del buf[:pos]
        return frames


    def partial(self) -> tuple[int, int, bytes] | None:
        """An incomplete frame at the head: its size, the bytes buffered so far, and up to its
        first 8 bytes (enough for a correlation id). Cheap: it copies at most 8 bytes."""
        if len(self._buf) < 4:
            return None
        size = int.from_bytes(self._buf[0:4], "big", signed=True)
        return size, len(self._buf) - 4, bytes(self._buf[4:12])

    def take_partial(self) -> bytes:
        """The buffered part of a head frame whose rest will pass through unbuffered."""
        head = bytes(self._buf[4:])
        self._buf.clear()
        return head


def frame(payload: bytes) -> bytes:
    """Prefix `payload` with its size, as Kafka frames it."""
    return len(payload).to_bytes(4, "big") + payload
