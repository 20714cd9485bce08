"""Splitting a TCP byte stream into Kafka frames (4-byte big-endian size, then that many bytes).

Kept separate from everything else because both directions use it and it is the only place
that buffers partial data.
"""

from __future__ import annotations

from .errors import FrameSizeError

#: Kafka's own default for `socket.request.max.bytes`; a larger request frame is refused.
DEFAULT_MAX_REQUEST_BYTES = 100 * 1024 * 1024

#: The first bytes of a TLS record that carries a handshake: content type 22, then protocol major
#: version 3 (RFC 8446 section 5.1; every TLS and SSLv3 ClientHello starts so). Read as a Kafka size
#: prefix they are at least 0x16030000 = 369,295,360 bytes, above any sane request limit, so they are
#: only looked for once a size has been refused: the check costs nothing on valid frames.
TLS_HANDSHAKE_RECORD = b"\x16\x03"
#: What the refusal says, so a client configured for SSL against a plaintext port is recognised
#: (the I/O layer also uses it to count such connections apart).
TLS_ON_PLAINTEXT = "TLS handshake on a plaintext listener"

#: Responses are not limited by the broker's request limit (a Fetch may return up to
#: `fetch.max.bytes` and more), so only the protocol's own int32 bound applies.
MAX_RESPONSE_BYTES = 2**31 - 1


class FrameSplitter:
    """Accumulates bytes and returns every complete frame body (without its size prefix).

    A frame of size zero is legal at this level (SASL v0 raw tokens may be empty).

    Bytes of an incomplete frame are kept as the chunks they came in and joined once, when the
    frame is complete: a 1 MB Produce arriving in 256 KB reads is copied once, not grown in a
    buffer and copied out again (the bench showed that costing about 1 ms per MB).
    """

    __slots__ = ("_chunks", "_have", "_max_bytes", "_name", "_need")

    def __init__(self, max_bytes: int, name: str = "frame") -> None:
        self._chunks: list[bytes] = []
        #: bytes in `_chunks`, and how many the head frame needs (its prefix included; 4 while
        #: its size is not known yet)
        self._have = 0
        self._need = 4
        self._max_bytes = max_bytes
        self._name = name

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return self._have

    @property
    def declared_size(self) -> int | None:
        """The size (without its prefix) of an incomplete head frame whose prefix has arrived.

        What the head frame will hold once complete, so a caller can budget memory before it
        arrives (Kafka's `queued.max.request.bytes` counts a request's declared size too).
        """
        return self._need - 4 if self._have >= 4 else None

    def _size(self, prefix: bytes) -> int:
        size = int.from_bytes(prefix, "big", signed=True)
        if size < 0 or size > self._max_bytes:
            if prefix[:2] == TLS_HANDSHAKE_RECORD:
                raise FrameSizeError(
                    f"{TLS_ON_PLAINTEXT}: the bytes {bytes(prefix[:4]).hex(' ')} are a TLS record where a "
                    f"Kafka {self._name} size belongs (the client uses security.protocol=SSL or SASL_SSL; "
                    "this listener is plaintext)")
            raise FrameSizeError(f"{self._name} size {size} is outside 0..{self._max_bytes} bytes")
        return size

    def feed(self, data: bytes) -> list[bytes]:
        frames: list[bytes] = []
        if self._chunks:
            self._chunks.append(data)
            self._have += len(data)
            if self._have < self._need:
                return frames
            if self._need == 4:  # the head frame's size is known now: start over from the joined bytes
                data = b"".join(self._chunks)
            else:
                # The head frame is complete: join exactly its body, once, and go on with the rest.
                chunks = self._chunks
                over = self._have - self._need
                last = chunks[-1]
                rest = last[len(last) - over:] if over else b""
                if over:
                    chunks[-1] = last[: len(last) - over]
                chunks[0] = chunks[0][4:]
                frames.append(b"".join(chunks))
                data = rest
            self._chunks = []
            self._have = 0
            self._need = 4
        pos = 0
        end = len(data)
        while end - pos >= 4:
            size = self._size(data[pos : pos + 4])
            if end - pos - 4 < size:
                self._need = 4 + size
                break
            frames.append(data[pos + 4 : pos + 4 + size])
            pos += 4 + size
        if pos < end:
            self._chunks.append(data[pos:] if pos else data)
            self._have = end - pos
        return frames

    def partial(self) -> tuple[int, int, bytes] | None:
        """An incomplete frame at the head: its size, the bytes buffered so far, and up to its
        first 8 bytes (enough for a correlation id). Cheap: it copies at most 12 bytes."""
        if self._have < 4:
            return None
        head = b""
        for chunk in self._chunks:
            head += chunk[: 12 - len(head)]
            if len(head) >= 12:
                break
        return self._size(head[:4]), self._have - 4, head[4:12]

    def take_partial(self) -> bytes:
        """The buffered part of a head frame whose rest will pass through unbuffered."""
        head = b"".join(self._chunks)[4:]
        self._chunks = []
        self._have = 0
        self._need = 4
        return head


def frame(payload: bytes) -> bytes:
    """Prefix `payload` with its size, as Kafka frames it."""
    return len(payload).to_bytes(4, "big") + payload
