"""The HAProxy PROXY protocol header (versions 1 and 2), read sans-I/O: bytes in, a decision out.

Why it exists: the proxy hides client addresses from the brokers, so whatever Kafka keys on a
client's address (`max.connections.per.ip`, KIP-612's per-`ip` connection creation rate) is
enforced here, and the address that quota keys on must be the client's. It comes from the socket,
or, behind a load balancer, from the PROXY header that balancer prepends to the connection. A
header is believed only from a load balancer the configuration trusts: the spec (section 5) warns
that letting any peer send one lets it pose as any address. That trust check is the caller's (it
knows the socket's peer and the settings); this module only reads the bytes, strictly, and says
exactly what was wrong.

Facts from haproxy's doc/proxy-protocol.txt (2020/03/05 revision) that decide the behaviour:

- A listener either requires the header or never reads one; guessing is forbidden (section 2). So
  bytes that cannot begin either signature are refused from the first byte.
- v1 is one US-ASCII line, at most 107 bytes with its CRLF (section 2.1); a lone CR or LF does not
  end it. No leading zeros in IPv4 octets or ports. "UNKNOWN" means "use the socket's addresses",
  and anything between it and the CRLF is ignored.
- v2 is a 16-byte fixed part (signature, version 2 and command, family and transport, length) and
  `length` more bytes: the address block (12, 36 or 216 bytes) and then TLVs (section 2.2).
  LOCAL (a balancer's health check) and AF_UNSPEC/AF_UNIX mean "use the socket's addresses".
  Family and transport values the spec does not list are refused, as it requires; DGRAM is
  refused because this is a TCP listener.
- A CRC32c TLV (type 0x03, 4 bytes, network order) is verified over the whole header with its own
  value zeroed (section 2.2.3, RFC 4960 appendix B), for LOCAL headers too. It is computed in pure
  Python: headers are small and read once per connection.

Addresses are returned as `ipaddress` normalises them ("2001:db8::1", never "2001:DB8:0::1"), so
a quota key does not depend on how the balancer spelled it. An IPv4-mapped IPv6 address (HAProxy
sends one when the two sides' families differ) is returned as such; mapping it to IPv4, as for a
dual-stack socket's peer, is the caller's rule.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Literal

#: v1 starts with "PROXY" (section 2.1); v2 with these 12 bytes, which contain a NUL and CRLFs
#: so that no text protocol mistakes them for a request (section 2.2).
V1_SIGNATURE = b"PROXY"
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"

#: The longest v1 line a receiver must accept, CRLF included: "PROXY UNKNOWN" with two full IPv6
#: addresses and two 5-digit ports (section 2.1). No CRLF within it: the line is invalid.
MAX_V1_LENGTH = 107

#: v2's fixed part: signature, version/command, family/transport, 2-byte length.
V2_FIXED_LENGTH = 16

#: The longest v2 header accepted. The protocol allows 16 + 65535 bytes, which would let any peer
#: that reaches the port make each connection hold 64 KiB before one byte is validated. Real
#: senders stay far below 4 KiB: the largest address block is 216 bytes (AF_UNIX), HAProxy's TLVs
#: are an authority (a host name, at most 255 bytes), a unique id (at most 128, section 2.2.5),
#: ALPN, CRC32c and an SSL TLV with a few short strings; AWS NLB adds a VPC-endpoint TLV of a few
#: dozen bytes. A larger header is refused, naming its size.
MAX_V2_LENGTH = V2_FIXED_LENGTH + 4096

#: The one TLV type this module acts on (section 2.2.3); the others are returned as they came.
PP2_TYPE_CRC32C = 0x03

#: v2 address block sizes by family nibble (section 2.2): AF_UNSPEC carries none.
_AF_UNSPEC, _AF_INET, _AF_INET6, _AF_UNIX = 0x0, 0x1, 0x2, 0x3
_ADDRESS_BLOCK = {_AF_UNSPEC: 0, _AF_INET: 12, _AF_INET6: 36, _AF_UNIX: 216}
_FAMILY_NAMES = {_AF_UNSPEC: "AF_UNSPEC", _AF_INET: "AF_INET", _AF_INET6: "AF_INET6", _AF_UNIX: "AF_UNIX"}
_UNSPEC, _STREAM, _DGRAM = 0x0, 0x1, 0x2
#: The family/transport bytes the spec lists as expected (section 2.2, "In practice"): UNSPEC,
#: and each family over STREAM. A family with transport UNSPEC, or the reverse, is none of them.
_STREAM_BYTES = frozenset({0x00, 0x11, 0x21, 0x31})

_V1_PROTOCOLS = (b"TCP4", b"TCP6", b"UNKNOWN")
_TLV_HEADER = 3  # type, 2-byte length

Command = Literal["PROXY", "LOCAL"]
Address = tuple[str, int]


class ProxyHeaderError(ValueError):
    """A PROXY header that is missing, malformed or not accepted; the connection is closed."""


@dataclass(frozen=True, slots=True)
class ProxyHeader:
    """What a load balancer said about the connection it relays.

    `source` and `destination` are None when the header says to use the socket's own addresses:
    v1 UNKNOWN, v2 LOCAL, v2 AF_UNSPEC or AF_UNIX. `length` is how many bytes of the stream the
    header took. `tlvs` are v2's (type, value) pairs in order, the CRC32c one included.
    """

    version: Literal[1, 2]
    command: Command
    source: Address | None
    destination: Address | None
    length: int
    tlvs: tuple[tuple[int, bytes], ...] = ()


class ProxyHeaderReader:
    """Reads the header a listener requires, fed as bytes arrive.

    `feed` returns None while more bytes are needed, the header once it is complete, and raises
    ProxyHeaderError as soon as the bytes cannot become a valid header (the first byte, when they
    are not a PROXY header at all). While incomplete it holds fewer than MAX_V1_LENGTH bytes (v1)
    or the header's declared length, itself at most MAX_V2_LENGTH (v2). Bytes after the header
    (the start of the Kafka stream) are kept for `rest()`; once the header is complete, later
    bytes belong to the Kafka stream and must not be fed here.
    """

    __slots__ = ("_buffer", "_error", "_header", "_rest", "_versions")

    def __init__(self, versions: frozenset[int] = frozenset({1, 2})) -> None:
        if not versions or not versions <= {1, 2}:
            raise ValueError(f"PROXY protocol versions must be a non-empty subset of {{1, 2}}, "
                             f"got {sorted(versions)}")
        self._versions = versions
        self._buffer = bytearray()
        self._header: ProxyHeader | None = None
        self._rest = b""
        self._error: ProxyHeaderError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held while the header is incomplete (0 once it is complete or refused)."""
        return len(self._buffer)

    @property
    def header(self) -> ProxyHeader | None:
        """The header, once complete."""
        return self._header

    def feed(self, data: bytes) -> ProxyHeader | None:
        """Take the next bytes of the connection; the header once complete, else None."""
        if self._header is not None:
            raise RuntimeError("the PROXY header is already complete: later bytes belong to the "
                               "Kafka stream")
        if self._error is not None:
            raise self._error
        if self._buffer:
            self._buffer += data
            pending: bytes | bytearray = self._buffer
        else:
            pending = data
        try:
            header = _parse(pending, self._versions)
        except ProxyHeaderError as error:
            self._error = error
            self._buffer = bytearray()
            raise
        if header is None:
            if pending is data:
                self._buffer = bytearray(data)
            return None
        self._header = header
        self._rest = bytes(memoryview(pending)[header.length:])
        self._buffer = bytearray()
        return header

    def rest(self) -> bytes:
        """The bytes that followed the header in what was fed: the start of the Kafka stream."""
        if self._header is None:
            raise RuntimeError("the PROXY header is not complete yet: nothing follows it")
        return self._rest


# == parsing ======================================================================================


def _parse(buf: bytes | bytearray, versions: frozenset[int]) -> ProxyHeader | None:
    """The header at the start of `buf`, None if more bytes are needed; raises if it cannot be."""
    if not buf:
        return None
    v1 = buf[:len(V1_SIGNATURE)] == V1_SIGNATURE[:len(buf)]
    v2 = buf[:len(V2_SIGNATURE)] == V2_SIGNATURE[:len(buf)]
    if not v1 and not v2:
        if buf[0] in (V1_SIGNATURE[0], V2_SIGNATURE[0]):
            raise ProxyHeaderError(f"PROXY header: wrong signature: the connection began with "
                                   f"{_show(buf)}, which starts neither {V1_SIGNATURE!r} (v1) nor "
                                   f"{V2_SIGNATURE!r} (v2)")
        raise ProxyHeaderError(f"no PROXY header (the listener requires one): the connection began "
                               f"with {_show(buf)}{_hint(buf[0])}")
    signature, version = (V1_SIGNATURE, 1) if v1 else (V2_SIGNATURE, 2)
    if len(buf) < len(signature):
        return None
    if version not in versions:
        accepted = " or ".join(f"v{v}" for v in sorted(versions))
        raise ProxyHeaderError(f"PROXY v{version} header, but this listener accepts only {accepted}")
    return _parse_v1(buf) if version == 1 else _parse_v2(buf)


def _show(buf: bytes | bytearray) -> str:
    head = bytes(buf[:16]).hex(" ")
    return head + (" ..." if len(buf) > 16 else "")


def _hint(first: int) -> str:
    if first == 0x00:
        return " (a Kafka request? the client may have bypassed the load balancer)"
    if first == 0x16:
        return " (a TLS handshake? the client may have bypassed the load balancer)"
    return ""


# -- v1 -------------------------------------------------------------------------------------------


def _parse_v1(buf: bytes | bytearray) -> ProxyHeader | None:
    window = bytes(buf[:MAX_V1_LENGTH])
    end = window.find(b"\r\n")
    _check_line_breaks(window, end)
    if end < 0:
        _check_v1_prefix(window)
        if len(buf) >= MAX_V1_LENGTH:
            raise ProxyHeaderError(f"PROXY v1 header: no CRLF within {MAX_V1_LENGTH} bytes")
        return None
    line = window[:end]
    _check_v1_prefix(line + b"\r")
    length = end + 2
    protocol = line[6:].split(b" ", 1)[0]
    if protocol == b"UNKNOWN":  # the rest of the line is to be ignored (section 2.1)
        return ProxyHeader(1, "PROXY", None, None, length)
    fields = line.split(b" ")
    shape = "'PROXY TCP4|TCP6 <source> <destination> <source port> <destination port>'"
    if len(fields) != 6 or not all(fields):
        raise ProxyHeaderError(f"PROXY v1 header: expected {shape} with single spaces, got "
                               f"{_text(line)}")
    try:
        source_ip, destination_ip, source_port, destination_port = (f.decode("ascii") for f in fields[2:])
    except UnicodeDecodeError:
        raise ProxyHeaderError(f"PROXY v1 header: non-ASCII bytes in {_text(line)}") from None
    six = protocol == b"TCP6"
    return ProxyHeader(1, "PROXY",
                       (_v1_address("source address", source_ip, six),
                        _v1_port("source port", source_port)),
                       (_v1_address("destination address", destination_ip, six),
                        _v1_port("destination port", destination_port)),
                       length)


def _check_line_breaks(window: bytes, end: int) -> None:
    """A lone LF, or a CR followed by anything but LF, before the CRLF: refused (section 2.1)."""
    limit = len(window) if end < 0 else end
    lf = window.find(b"\n", 0, limit)
    if lf >= 0:
        raise ProxyHeaderError(f"PROXY v1 header: LF without CR at offset {lf} of {_text(window[:lf + 1])}")
    cr = window.find(b"\r", 0, limit)
    if cr >= 0 and cr + 1 < len(window):
        raise ProxyHeaderError(f"PROXY v1 header: CR not followed by LF at offset {cr} of "
                               f"{_text(window[:cr + 2])}")


def _check_v1_prefix(head: bytes) -> None:
    """Refuse as soon as the bytes after "PROXY" cannot start " TCP4 ", " TCP6 " or " UNKNOWN"."""
    if len(head) > 5 and head[5:6] != b" ":
        raise ProxyHeaderError(f"PROXY v1 header: expected one space after 'PROXY', got {_text(head[:8])}")
    rest = head[6:]
    cut = min((i for i in (rest.find(b" "), rest.find(b"\r")) if i >= 0), default=-1)
    token = rest if cut < 0 else rest[:cut]
    known = token in _V1_PROTOCOLS if cut >= 0 else any(p.startswith(token) for p in _V1_PROTOCOLS)
    if not known:
        raise ProxyHeaderError(f"PROXY v1 header: unknown protocol {_text(token)} (TCP4, TCP6 or UNKNOWN)")


def _text(raw: bytes) -> str:
    return repr(raw.decode("ascii", "backslashreplace"))


def _v1_address(what: str, text: str, six: bool) -> str:
    family = "IPv6 (TCP6)" if six else "IPv4 (TCP4)"
    # IPv6 as hex groups (an IPv4-mapped tail allowed, HAProxy sends one); no zone ids or others.
    allowed = "0123456789abcdefABCDEF:." if six else "0123456789."
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address
    try:
        if any(c not in allowed for c in text):
            raise ValueError(text)
        ip = ipaddress.IPv6Address(text) if six else ipaddress.IPv4Address(text)
    except ValueError:
        raise ProxyHeaderError(f"PROXY v1 header: {what} {text!r} is not an {family} address") from None
    return str(ip)


def _v1_port(what: str, text: str) -> int:
    """Decimal 0-65535, no sign, no leading zero (section 2.1)."""
    if (text.isascii() and text.isdigit() and len(text) <= 5 and (text == "0" or text[0] != "0")
            and int(text) <= 0xFFFF):
        return int(text)
    raise ProxyHeaderError(f"PROXY v1 header: {what} {text!r} is not a decimal 0-65535 without "
                           f"sign or leading zero")


# -- v2 -------------------------------------------------------------------------------------------


def _parse_v2(buf: bytes | bytearray) -> ProxyHeader | None:
    if len(buf) > 12:
        ver_cmd = buf[12]
        if ver_cmd >> 4 != 2:
            raise ProxyHeaderError(f"PROXY v2 header: version {ver_cmd >> 4} in byte 13 (0x{ver_cmd:02x}); "
                                   f"only 2 is defined")
        if ver_cmd & 0x0F not in (0x0, 0x1):
            raise ProxyHeaderError(f"PROXY v2 header: unknown command 0x{ver_cmd & 0x0F:x} in byte 13 "
                                   f"(0x{ver_cmd:02x}); 0 is LOCAL, 1 is PROXY")
    if len(buf) > 13:
        _check_family(buf[13])
    if len(buf) < V2_FIXED_LENGTH:
        return None
    declared = int.from_bytes(buf[14:16], "big")
    total = V2_FIXED_LENGTH + declared
    if total > MAX_V2_LENGTH:
        raise ProxyHeaderError(f"PROXY v2 header: {total} bytes ({V2_FIXED_LENGTH} + length {declared}), "
                               f"above the limit of {MAX_V2_LENGTH}")
    family = buf[13] >> 4
    block = _ADDRESS_BLOCK[family]
    if declared < block:
        raise ProxyHeaderError(f"PROXY v2 header: length {declared} is shorter than the {block}-byte "
                               f"{_FAMILY_NAMES[family]} address block")
    if len(buf) < total:
        return None
    header = bytes(buf[:total])
    tlvs = _tlvs(header, V2_FIXED_LENGTH + block)
    command: Command = "PROXY" if header[12] & 0x0F else "LOCAL"
    source: Address | None = None
    destination: Address | None = None
    if command == "PROXY" and family in (_AF_INET, _AF_INET6):
        size = 4 if family == _AF_INET else 16
        ip = ipaddress.IPv4Address if family == _AF_INET else ipaddress.IPv6Address
        at = V2_FIXED_LENGTH
        ports = at + 2 * size
        source = (str(ip(header[at:at + size])), int.from_bytes(header[ports:ports + 2], "big"))
        destination = (str(ip(header[at + size:ports])), int.from_bytes(header[ports + 2:ports + 4], "big"))
    return ProxyHeader(2, command, source, destination, total, tlvs)


def _check_family(byte: int) -> None:
    family, transport = byte >> 4, byte & 0x0F
    if family not in _ADDRESS_BLOCK:
        raise ProxyHeaderError(f"PROXY v2 header: unknown address family 0x{family:x} in byte 14 "
                               f"(0x{byte:02x})")
    if transport == _DGRAM:
        raise ProxyHeaderError(f"PROXY v2 header: DGRAM (UDP) transport in byte 14 (0x{byte:02x}) on a "
                               f"TCP listener")
    if transport not in (_UNSPEC, _STREAM):
        raise ProxyHeaderError(f"PROXY v2 header: unknown transport protocol 0x{transport:x} in byte 14 "
                               f"(0x{byte:02x})")
    if byte not in _STREAM_BYTES:
        raise ProxyHeaderError(f"PROXY v2 header: {_FAMILY_NAMES[family]} with transport "
                               f"{'UNSPEC' if transport == _UNSPEC else 'STREAM'} (byte 14 is "
                               f"0x{byte:02x}) is not a combination the spec defines")


def _tlvs(header: bytes, offset: int) -> tuple[tuple[int, bytes], ...]:
    found: list[tuple[int, bytes]] = []
    crc_at = -1
    while offset < len(header):
        if len(header) - offset < _TLV_HEADER:
            raise ProxyHeaderError(f"PROXY v2 header: truncated TLV at offset {offset}: "
                                   f"{len(header) - offset} bytes left, a TLV needs {_TLV_HEADER}")
        kind = header[offset]
        size = int.from_bytes(header[offset + 1:offset + 3], "big")
        start = offset + _TLV_HEADER
        if start + size > len(header):
            raise ProxyHeaderError(f"PROXY v2 header: TLV 0x{kind:02x} at offset {offset} declares {size} "
                                   f"bytes, only {len(header) - start} remain in the header")
        if kind == PP2_TYPE_CRC32C:
            if size != 4:
                raise ProxyHeaderError(f"PROXY v2 header: CRC32c TLV of {size} bytes, not 4")
            if crc_at >= 0:
                raise ProxyHeaderError("PROXY v2 header: more than one CRC32c TLV")
            crc_at = start
        found.append((kind, header[start:start + size]))
        offset = start + size
    if crc_at >= 0:
        sent = int.from_bytes(header[crc_at:crc_at + 4], "big")
        computed = crc32c(header[:crc_at] + bytes(4) + header[crc_at + 4:])
        if sent != computed:
            raise ProxyHeaderError(f"PROXY v2 header: CRC32c mismatch: the header says 0x{sent:08x}, its "
                                   f"bytes give 0x{computed:08x}")
    return tuple(found)


# == CRC32c (Castagnoli; RFC 4960 appendix B, RFC 3720 section B.4) ================================


def _crc32c_table() -> tuple[int, ...]:
    table: list[int] = []
    for n in range(256):
        crc = n
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # the reflected polynomial
        table.append(crc)
    return tuple(table)


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes | bytearray) -> int:
    """CRC32c of `data`, as the PROXY v2 checksum TLV carries it (before network byte order)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# == building headers (tests, the fuzzer, a demo balancer) =========================================


def _ip(address: Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    host, port = address
    if not 0 <= port <= 0xFFFF:
        raise ValueError(f"port {port} is outside 0-65535")
    return ipaddress.ip_address(host)


def _pair(source: Address | None, destination: Address | None) -> tuple[
        ipaddress.IPv4Address | ipaddress.IPv6Address, ipaddress.IPv4Address | ipaddress.IPv6Address] | None:
    if source is None and destination is None:
        return None
    if source is None or destination is None:
        raise ValueError("give both addresses or neither")
    ips = _ip(source), _ip(destination)
    if ips[0].version != ips[1].version:
        raise ValueError(f"source {source[0]} and destination {destination[0]} differ in family")
    return ips


def encode_v1(source: Address | None, destination: Address | None) -> bytes:
    """A v1 line: TCP4 or TCP6 from the addresses' family, "PROXY UNKNOWN" when both are None."""
    ips = _pair(source, destination)
    if ips is None or source is None or destination is None:
        return b"PROXY UNKNOWN\r\n"
    protocol = "TCP4" if ips[0].version == 4 else "TCP6"
    return f"PROXY {protocol} {ips[0]} {ips[1]} {source[1]} {destination[1]}\r\n".encode("ascii")


def encode_v2(source: Address | None, destination: Address | None, *, command: Command = "PROXY",
              tlvs: tuple[tuple[int, bytes], ...] = (), crc: bool = False) -> bytes:
    """A v2 header: AF_INET or AF_INET6 over STREAM, or AF_UNSPEC when both addresses are None;
    then `tlvs`, then (with `crc`) a CRC32c TLV over the whole. No MAX_V2_LENGTH check: tests
    build oversized headers with it."""
    ips = _pair(source, destination)
    block = b""
    family = 0x00
    if ips is not None and source is not None and destination is not None:
        family = 0x11 if ips[0].version == 4 else 0x21
        block = (ips[0].packed + ips[1].packed + source[1].to_bytes(2, "big")
                 + destination[1].to_bytes(2, "big"))
    body = bytearray(block)
    for kind, value in tlvs:
        if not 0 <= kind <= 0xFF or len(value) > 0xFFFF:
            raise ValueError(f"TLV type {kind} or length {len(value)} does not fit")
        body += bytes([kind]) + len(value).to_bytes(2, "big") + value
    crc_at = -1
    if crc:
        body += bytes([PP2_TYPE_CRC32C, 0, 4])
        crc_at = V2_FIXED_LENGTH + len(body)
        body += bytes(4)
    if len(body) > 0xFFFF:
        raise ValueError(f"v2 header body of {len(body)} bytes does not fit the 2-byte length")
    ver_cmd = 0x21 if command == "PROXY" else 0x20
    header = bytearray(V2_SIGNATURE + bytes([ver_cmd, family]) + len(body).to_bytes(2, "big") + body)
    if crc_at >= 0:
        header[crc_at:crc_at + 4] = crc32c(header).to_bytes(4, "big")
    return bytes(header)
