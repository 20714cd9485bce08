"""The PROXY protocol header reader, pinned to haproxy's doc/proxy-protocol.txt.

Examples first: the spec's own lines (section 2.1), v2 headers laid out byte by byte from its
structs (section 2.2) so the encoder is pinned too, CRC32c against RFC 3720's test vectors, and one
test per way a header can be wrong, each checking the error names what was wrong. Then Hypothesis
properties: any valid header in any split parses the same and loses no following byte; any bytes
at all give a header, a request for more (only below the limit) or a ProxyHeaderError, the same
decision whatever the split.
"""

from __future__ import annotations

import ipaddress
import itertools

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from protocol.proxy_header import (
    MAX_V1_LENGTH,
    MAX_V2_LENGTH,
    PP2_TYPE_CRC32C,
    V2_SIGNATURE,
    Command,
    ProxyHeader,
    ProxyHeaderError,
    ProxyHeaderReader,
    crc32c,
    encode_v1,
    encode_v2,
)

BOTH = frozenset({1, 2})
ONLY_V1 = frozenset({1})
ONLY_V2 = frozenset({2})

#: What follows the header: the start of a Kafka ApiVersions request.
KAFKA = b"\x00\x00\x00\x1f\x00\x12\x00\x03\x00\x00\x00\x01\x00\x05kafka"


def read(data: bytes, versions: frozenset[int] = BOTH) -> tuple[ProxyHeader, bytes]:
    reader = ProxyHeaderReader(versions)
    header = reader.feed(data)
    assert header is not None
    return header, reader.rest()


def refused(data: bytes, versions: frozenset[int] = BOTH) -> str:
    with pytest.raises(ProxyHeaderError) as caught:
        ProxyHeaderReader(versions).feed(data)
    return str(caught.value)


def v2(ver_cmd: int, family: int, body: bytes) -> bytes:
    """A v2 header laid out by hand from the spec's struct proxy_hdr_v2."""
    return V2_SIGNATURE + bytes([ver_cmd, family]) + len(body).to_bytes(2, "big") + body


# == v1 (section 2.1) ==============================================================================


def test_v1_spec_example_keeps_what_follows() -> None:
    http = b"GET / HTTP/1.1\r\nHost: 192.168.0.11\r\n\r\n"
    header, rest = read(b"PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n" + http)
    assert header == ProxyHeader(1, "PROXY", ("192.168.0.1", 56324), ("192.168.0.11", 443), 47)
    assert rest == http


FULL_V6 = "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"


@pytest.mark.parametrize(("line", "length", "source", "destination"), [
    (b"PROXY TCP4 255.255.255.255 255.255.255.255 65535 65535\r\n", 56,  # the spec's longest TCP4
     ("255.255.255.255", 65535), ("255.255.255.255", 65535)),
    (f"PROXY TCP6 {FULL_V6} {FULL_V6} 65535 65535\r\n".encode(), 104,  # and TCP6
     (FULL_V6, 65535), (FULL_V6, 65535)),
    (b"PROXY TCP4 0.0.0.0 10.0.0.1 0 9092\r\n", 36, ("0.0.0.0", 0), ("10.0.0.1", 9092)),
])
def test_v1_longest_lines_of_the_spec(line: bytes, length: int, source: tuple[str, int],
                                      destination: tuple[str, int]) -> None:
    header, rest = read(line + KAFKA)
    assert header == ProxyHeader(1, "PROXY", source, destination, length)
    assert rest == KAFKA


def test_v1_tcp6_addresses_are_normalised_and_may_be_ipv4_mapped() -> None:
    header, _ = read(b"PROXY TCP6 2001:DB8:0:0::1 ::ffff:192.0.2.1 1234 9092\r\n")
    assert header.source == ("2001:db8::1", 1234)
    assert header.destination is not None and header.destination[0].startswith("::ffff:")


@pytest.mark.parametrize("line", [
    b"PROXY UNKNOWN\r\n",  # the short form, 15 bytes
    b"PROXY UNKNOWN ffff:f::f 10.0.0.1 1 2\r\n",  # anything before the CRLF is ignored
    b"PROXY UNKNOWN " + b"x" * (MAX_V1_LENGTH - 16) + b"\r\n",  # the worst case: 107 bytes
])
def test_v1_unknown_means_the_socket_addresses(line: bytes) -> None:
    header, rest = read(line + KAFKA)
    assert header == ProxyHeader(1, "PROXY", None, None, len(line))
    assert rest == KAFKA
    assert len(line) <= MAX_V1_LENGTH


def test_v1_without_crlf_within_107_bytes_is_refused_at_byte_107() -> None:
    reader = ProxyHeaderReader(BOTH)
    line = b"PROXY UNKNOWN " + b"x" * (MAX_V1_LENGTH - 14)
    assert reader.feed(line[:-1]) is None  # 106 bytes: the CRLF may still come
    assert reader.buffered == MAX_V1_LENGTH - 1
    with pytest.raises(ProxyHeaderError, match="PROXY v1 header: no CRLF within 107 bytes"):
        reader.feed(line[-1:] + b"\r\n")


@pytest.mark.parametrize(("line", "named"), [
    (b"PROXY TCP4 192.168.0.1 192.168.0.11 0443 443\r\n", "source port '0443'"),
    (b"PROXY TCP4 192.168.0.1 192.168.0.11 +443 443\r\n", "source port '+443'"),
    (b"PROXY TCP4 192.168.0.1 192.168.0.11 -1 443\r\n", "source port '-1'"),
    (b"PROXY TCP4 192.168.0.1 192.168.0.11 443 65536\r\n", "destination port '65536'"),
    (b"PROXY TCP4 192.168.0.1 192.168.0.11 443 44a\r\n", "destination port '44a'"),
    (b"PROXY TCP4 192.168.0.1 192.168.0.11 443 000443\r\n", "destination port '000443'"),
    (b"PROXY TCP4 192.168.0.1 192.168.0.011 1 2\r\n", "destination address '192.168.0.011'"),
    (b"PROXY TCP4 192.168.1 192.168.0.11 1 2\r\n", "source address '192.168.1'"),
    (b"PROXY TCP4 256.1.1.1 192.168.0.11 1 2\r\n", "source address '256.1.1.1'"),
    (b"PROXY TCP4 ::1 192.168.0.11 1 2\r\n", "source address '::1' is not an IPv4 (TCP4)"),
    (b"PROXY TCP6 ::1 192.168.0.11 1 2\r\n", "destination address '192.168.0.11' is not an IPv6 (TCP6)"),
    (b"PROXY TCP6 fe80::1%eth0 ::1 1 2\r\n", "source address 'fe80::1%eth0'"),
    (b"PROXY TCP6 1::2::3 ::1 1 2\r\n", "source address '1::2::3'"),
    (b"PROXY TCP4  192.168.0.1 192.168.0.11 1 2\r\n", "single spaces"),
    (b"PROXY TCP4 192.168.0.1 192.168.0.11 1 2 \r\n", "single spaces"),
    (b"PROXY TCP4 192.168.0.1 192.168.0.11 1\r\n", "single spaces"),
    (b"PROXY TCP4 192.168.0.1\t192.168.0.11 1 2\r\n", "single spaces"),
    (b"PROXY  TCP4 192.168.0.1 192.168.0.11 1 2\r\n", "unknown protocol ''"),
    (b"PROXYTCP4 192.168.0.1 192.168.0.11 1 2\r\n", "expected one space after 'PROXY'"),
    (b"PROXY\r\n", "expected one space after 'PROXY'"),
    (b"PROXY TCP5 192.168.0.1 192.168.0.11 1 2\r\n", "unknown protocol 'TCP5'"),
    (b"PROXY tcp4 192.168.0.1 192.168.0.11 1 2\r\n", "unknown protocol 'tcp4'"),
    (b"PROXY UNKNOWNX\r\n", "unknown protocol 'UNKNOWNX'"),
    (b"PROXY TCP4 192.168.0.1 192.168.0.11 1 2\n", "LF without CR at offset 39"),
    (b"PROXY TCP4 192.168.0.1 192.168.0.11 1 2\r\r\n", "CR not followed by LF at offset 39"),
    (b"PROXY UNKNOWN a\nb\r\n", "LF without CR at offset 15"),
    (b"PROXY TCP6 \xc3\xa9::1 ::1 1 2\r\n", "non-ASCII"),
])
def test_v1_malformed_lines_are_refused_naming_the_fault(line: bytes, named: str) -> None:
    message = refused(line + KAFKA)
    assert message.startswith("PROXY v1 header: ")
    assert named in message


def test_v1_refused_as_soon_as_the_protocol_cannot_match() -> None:
    reader = ProxyHeaderReader(BOTH)
    assert reader.feed(b"PROXY TC") is None
    with pytest.raises(ProxyHeaderError, match="unknown protocol 'TCX'"):
        reader.feed(b"X")


# == v2 (section 2.2) ==============================================================================

IPV4_BLOCK = bytes([192, 0, 2, 1, 198, 51, 100, 7]) + (56324).to_bytes(2, "big") + (9092).to_bytes(2, "big")
IPV6_BLOCK = (bytes.fromhex("20010db8000000000000000000000001")
              + bytes.fromhex("20010db8000000000000000000000002")
              + (40000).to_bytes(2, "big") + (9093).to_bytes(2, "big"))


def test_v2_ipv4_byte_layout() -> None:
    raw = v2(0x21, 0x11, IPV4_BLOCK)
    assert len(raw) == 28
    assert raw == encode_v2(("192.0.2.1", 56324), ("198.51.100.7", 9092))
    header, rest = read(raw + KAFKA)
    assert header == ProxyHeader(2, "PROXY", ("192.0.2.1", 56324), ("198.51.100.7", 9092), 28)
    assert rest == KAFKA


def test_v2_ipv6_byte_layout() -> None:
    raw = v2(0x21, 0x21, IPV6_BLOCK)
    assert len(raw) == 52
    assert raw == encode_v2(("2001:db8::1", 40000), ("2001:db8::2", 9093))
    header, rest = read(raw + KAFKA, ONLY_V2)
    assert header == ProxyHeader(2, "PROXY", ("2001:db8::1", 40000), ("2001:db8::2", 9093), 52)
    assert rest == KAFKA


def test_v2_local_is_a_health_check_with_no_addresses() -> None:
    raw = v2(0x20, 0x00, b"")
    assert raw == encode_v2(None, None, command="LOCAL")
    header, rest = read(raw + KAFKA)
    assert header == ProxyHeader(2, "LOCAL", None, None, 16)
    assert rest == KAFKA


def test_v2_local_skips_an_address_block_it_was_given() -> None:
    """'Receivers MUST always consider this field to skip the appropriate number of bytes'."""
    header, rest = read(v2(0x20, 0x11, IPV4_BLOCK + b"\x04\x00\x01z") + KAFKA)
    assert header == ProxyHeader(2, "LOCAL", None, None, 32, ((0x04, b"z"),))
    assert rest == KAFKA


@pytest.mark.parametrize(("family", "block"), [(0x00, b""), (0x31, b"/run/a.sock".ljust(108, b"\0") * 2)])
def test_v2_unspec_and_unix_mean_the_socket_addresses(family: int, block: bytes) -> None:
    header, _ = read(v2(0x21, family, block + b"\x05\x00\x02id"))
    assert (header.command, header.source, header.destination) == ("PROXY", None, None)
    assert header.tlvs == ((0x05, b"id"),)


def test_v2_tlvs_in_order() -> None:
    tlvs = ((0x01, b"h2"), (0x02, b"kafka.example.com"), (0x04, b""), (0x05, b"u" * 128),
            (0xEA, b"\x01vpce-0123456789abcdef0"))
    body = IPV4_BLOCK + b"".join(bytes([t]) + len(v).to_bytes(2, "big") + v for t, v in tlvs)
    raw = v2(0x21, 0x11, body)
    assert raw == encode_v2(("192.0.2.1", 56324), ("198.51.100.7", 9092), tlvs=tlvs)
    header, rest = read(raw + KAFKA)
    assert header.tlvs == tlvs
    assert header.length == len(raw)
    assert rest == KAFKA


def test_crc32c_matches_the_rfc_3720_vectors() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC catalogue's check value
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert crc32c(b"\xff" * 32) == 0x62A8AB43  # 32 bytes of ones
    assert crc32c(bytes(range(32))) == 0x46DD794E  # 32 incrementing bytes


def test_v2_with_a_right_crc32c() -> None:
    without = v2(0x21, 0x11, IPV4_BLOCK + bytes([PP2_TYPE_CRC32C, 0, 4]) + bytes(4))
    checksum = crc32c(without).to_bytes(4, "big")  # over the header with the field zeroed
    raw = without[:-4] + checksum
    assert raw == encode_v2(("192.0.2.1", 56324), ("198.51.100.7", 9092), crc=True)
    header, rest = read(raw + KAFKA)
    assert header.tlvs == ((PP2_TYPE_CRC32C, checksum),)
    assert header.source == ("192.0.2.1", 56324)
    assert rest == KAFKA


#: address, port, the ALPN TLV's value, the CRC32c value: a flipped bit anywhere is caught
@pytest.mark.parametrize("at", [16, 27, 31, 38])
def test_v2_with_a_wrong_crc32c_is_refused(at: int) -> None:
    raw = bytearray(encode_v2(("192.0.2.1", 56324), ("198.51.100.7", 9092), tlvs=((0x01, b"h2!"),), crc=True))
    assert raw[28:34] == b"\x01\x00\x03h2!" and raw[34:37] == bytes([PP2_TYPE_CRC32C, 0, 4])
    read(bytes(raw))  # right as built
    raw[at] ^= 0x01
    assert "PROXY v2 header: CRC32c mismatch: the header says 0x" in refused(bytes(raw))


def test_v2_crc32c_verified_on_local_headers_too() -> None:
    raw = bytearray(encode_v2(None, None, command="LOCAL", crc=True))
    assert read(bytes(raw))[0].command == "LOCAL"
    raw[-1] ^= 0x80
    assert "CRC32c mismatch" in refused(bytes(raw))


@pytest.mark.parametrize(("body", "named"), [
    (IPV4_BLOCK + b"\x03\x00\x03abc", "CRC32c TLV of 3 bytes, not 4"),
    (IPV4_BLOCK + b"\x03\x00\x04abcd\x03\x00\x04abcd", "more than one CRC32c TLV"),
    (IPV4_BLOCK + b"\x05\x00", "truncated TLV at offset 28: 2 bytes left, a TLV needs 3"),
    (IPV4_BLOCK + b"\x05\x00\x05abc", "TLV 0x05 at offset 28 declares 5 bytes, only 3 remain"),
    (IPV4_BLOCK[:8], "length 8 is shorter than the 12-byte AF_INET address block"),
    (IPV6_BLOCK[:35], "length 35 is shorter than the 36-byte AF_INET6 address block"),
])
def test_v2_malformed_blocks_are_refused_naming_the_fault(body: bytes, named: str) -> None:
    family = 0x21 if len(body) == 35 else 0x11
    message = refused(v2(0x21, family, body) + KAFKA)
    assert message.startswith("PROXY v2 header: ")
    assert named in message


@pytest.mark.parametrize(("ver_cmd", "family", "named"), [
    (0x21, 0x41, "unknown address family 0x4 in byte 14 (0x41)"),
    (0x21, 0xF1, "unknown address family 0xf in byte 14 (0xf1)"),
    (0x21, 0x13, "unknown transport protocol 0x3 in byte 14 (0x13)"),
    (0x21, 0x12, "DGRAM (UDP) transport in byte 14 (0x12) on a TCP listener"),
    (0x21, 0x22, "DGRAM (UDP) transport in byte 14 (0x22)"),
    (0x20, 0x32, "DGRAM (UDP) transport in byte 14 (0x32)"),
    (0x21, 0x10, "AF_INET with transport UNSPEC (byte 14 is 0x10) is not a combination the spec defines"),
    (0x21, 0x01, "AF_UNSPEC with transport STREAM (byte 14 is 0x01)"),
    (0x22, 0x11, "unknown command 0x2 in byte 13 (0x22)"),
    (0x2F, 0x11, "unknown command 0xf in byte 13 (0x2f)"),
    (0x11, 0x11, "version 1 in byte 13 (0x11); only 2 is defined"),
    (0x31, 0x11, "version 3 in byte 13 (0x31)"),
])
def test_v2_bad_fixed_bytes_are_refused_at_once(ver_cmd: int, family: int, named: str) -> None:
    raw = v2(ver_cmd, family, IPV4_BLOCK)
    reader = ProxyHeaderReader(BOTH)
    assert reader.feed(raw[:12]) is None
    with pytest.raises(ProxyHeaderError) as caught:  # by byte 14 at the latest, length unseen
        reader.feed(raw[12:14])
    assert str(caught.value).startswith("PROXY v2 header: ")
    assert named in str(caught.value)


def test_v2_oversized_is_refused_from_the_fixed_part_naming_size_and_limit() -> None:
    declared = MAX_V2_LENGTH - 16 + 1
    reader = ProxyHeaderReader(BOTH)
    with pytest.raises(ProxyHeaderError) as caught:
        reader.feed(V2_SIGNATURE + b"\x21\x11" + declared.to_bytes(2, "big"))
    assert str(caught.value) == (f"PROXY v2 header: {MAX_V2_LENGTH + 1} bytes (16 + length {declared}), "
                                 f"above the limit of {MAX_V2_LENGTH}")
    assert "65551 bytes" in refused(V2_SIGNATURE + b"\x21\x11\xff\xff")


def test_v2_at_the_limit_is_read() -> None:
    filler = MAX_V2_LENGTH - 28 - 3
    raw = encode_v2(("192.0.2.1", 1), ("192.0.2.2", 2), tlvs=((0x04, bytes(filler)),))
    assert len(raw) == MAX_V2_LENGTH
    reader = ProxyHeaderReader(BOTH)
    assert reader.feed(raw[:-1]) is None
    assert reader.buffered == MAX_V2_LENGTH - 1
    assert reader.feed(raw[-1:] + KAFKA) is not None
    assert reader.rest() == KAFKA


# == which header, and none ========================================================================


@pytest.mark.parametrize(("data", "named"), [
    (KAFKA, "no PROXY header (the listener requires one): the connection began with 00 00 00 1f"),
    (b"\x16\x03\x01\x02\x00", "no PROXY header (the listener requires one): the connection began with 16 03"),
    (b"GET / HTTP/1.1\r\n", "no PROXY header (the listener requires one)"),
    (b"PRXY TCP4", "PROXY header: wrong signature: the connection began with 50 52 58"),
    (b"\r\n\r\n\x00\r\nQUIX\n\x21", "PROXY header: wrong signature"),
    (b"\r\nGET", "PROXY header: wrong signature"),
])
def test_no_or_wrong_signature_is_refused(data: bytes, named: str) -> None:
    assert named in refused(data)


def test_no_header_is_refused_from_the_first_byte() -> None:
    reader = ProxyHeaderReader(BOTH)
    with pytest.raises(ProxyHeaderError, match=r"^no PROXY header \(the listener requires one\)"):
        reader.feed(KAFKA[:1])
    assert reader.buffered == 0


@pytest.mark.parametrize(("data", "versions", "named"), [
    (b"PROXY TCP4 192.0.2.1 192.0.2.2 1 2\r\n", ONLY_V2,
     "PROXY v1 header, but this listener accepts only v2"),
    (encode_v2(None, None, command="LOCAL"), ONLY_V1,
     "PROXY v2 header, but this listener accepts only v1"),
])
def test_a_version_the_listener_does_not_accept(data: bytes, versions: frozenset[int], named: str) -> None:
    reader = ProxyHeaderReader(versions)
    signature = 5 if data.startswith(b"PROXY") else 12
    assert reader.feed(data[:signature - 1]) is None
    with pytest.raises(ProxyHeaderError, match=named):  # decided by the signature alone
        reader.feed(data[signature - 1:signature])


def test_listener_versions_must_be_1_or_2() -> None:
    for bad in (frozenset(), frozenset({3}), frozenset({1, 2, 3})):
        with pytest.raises(ValueError, match="non-empty subset"):
            ProxyHeaderReader(bad)


# == feeding =======================================================================================

EXAMPLES = [
    b"PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n",
    b"PROXY TCP6 2001:db8::1 2001:db8::2 40000 9093\r\n",
    b"PROXY UNKNOWN\r\n",
    v2(0x21, 0x11, IPV4_BLOCK),
    v2(0x21, 0x21, IPV6_BLOCK),
    v2(0x20, 0x00, b""),
    encode_v2(("192.0.2.1", 1), ("192.0.2.2", 2), tlvs=((0x02, b"kafka.example.com"),), crc=True),
]


@pytest.mark.parametrize("raw", EXAMPLES)
def test_byte_by_byte_completes_on_the_last_header_byte_and_keeps_every_following_byte(raw: bytes) -> None:
    whole, _ = read(raw + KAFKA)
    stream = raw + KAFKA
    reader = ProxyHeaderReader(BOTH)
    for i in range(len(raw) - 1):
        assert reader.feed(stream[i:i + 1]) is None
        assert reader.buffered == i + 1
    assert reader.feed(stream[len(raw) - 1:len(raw)]) == whole
    assert reader.rest() == b""
    assert reader.buffered == 0


@pytest.mark.parametrize("raw", EXAMPLES)
def test_truncated_waits_then_completes(raw: bytes) -> None:
    reader = ProxyHeaderReader(BOTH)
    assert reader.feed(raw[:-1]) is None
    assert reader.feed(b"") is None
    header = reader.feed(raw[-1:] + KAFKA)
    assert header is not None and header.length == len(raw)
    assert reader.rest() == KAFKA
    assert reader.header == header


def test_misuse_is_loud_and_errors_stick() -> None:
    reader = ProxyHeaderReader(BOTH)
    with pytest.raises(RuntimeError, match="not complete"):
        reader.rest()
    assert reader.feed(EXAMPLES[0]) is not None
    with pytest.raises(RuntimeError, match="belong to the Kafka stream"):
        reader.feed(KAFKA)
    broken = ProxyHeaderReader(BOTH)
    with pytest.raises(ProxyHeaderError) as first:
        broken.feed(b"X")
    with pytest.raises(ProxyHeaderError) as again:
        broken.feed(EXAMPLES[0])
    assert again.value is first.value


def test_encoders_refuse_what_no_header_can_say() -> None:
    with pytest.raises(ValueError, match="differ in family"):
        encode_v1(("192.0.2.1", 1), ("::1", 2))
    with pytest.raises(ValueError, match="both addresses or neither"):
        encode_v2(("192.0.2.1", 1), None)
    with pytest.raises(ValueError, match="outside 0-65535"):
        encode_v1(("192.0.2.1", 65536), ("192.0.2.2", 2))
    assert encode_v1(None, None) == b"PROXY UNKNOWN\r\n"


# == properties ====================================================================================

#: Bounded and derandomized like tests/unit/test_protocol_properties.py: the same cases every run.
PROPERTIES = settings(max_examples=300, derandomize=True, deadline=None, database=None,
                      phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

COMMANDS: tuple[Command, ...] = ("PROXY", "LOCAL")
ports = st.integers(0, 65535)
v4 = st.tuples(st.ip_addresses(v=4).map(str), ports)
v6 = st.tuples(st.ip_addresses(v=6).map(str), ports)
#: Any TLV but CRC32c (added by the encoder when drawn); values small enough to stay under the limit.
tlv = st.tuples(st.integers(0, 255).filter(lambda t: t != PP2_TYPE_CRC32C), st.binary(max_size=40))


@st.composite
def valid_header(draw: st.DrawFn) -> tuple[bytes, ProxyHeader]:
    """A header as a balancer would send it, and what reading it must give."""
    pair = draw(st.none() | st.tuples(v4, v4) | st.tuples(v6, v6))
    source, destination = pair if pair is not None else (None, None)
    if draw(st.booleans()):
        raw = encode_v1(source, destination)
        return raw, ProxyHeader(1, "PROXY", _normal(source), _normal(destination), len(raw))
    command = draw(st.sampled_from(COMMANDS))
    tlvs = tuple(draw(st.lists(tlv, max_size=4)))
    crc = draw(st.booleans())
    raw = encode_v2(source, destination, command=command, tlvs=tlvs, crc=crc)
    if crc:
        tlvs += ((PP2_TYPE_CRC32C, raw[-4:]),)
    proxied = command == "PROXY"
    return raw, ProxyHeader(2, command, _normal(source) if proxied else None,
                            _normal(destination) if proxied else None, len(raw), tlvs)


def _normal(address: tuple[str, int] | None) -> tuple[str, int] | None:
    return None if address is None else (str(ipaddress.ip_address(address[0])), address[1])


def splits(data: st.DataObject, stream: bytes) -> list[bytes]:
    """`stream` cut at drawn points (none, every byte, anything between)."""
    if not stream:
        return []
    if data.draw(st.integers(0, 9)) == 0:
        return [stream[i:i + 1] for i in range(len(stream))]
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(stream)), max_size=8))))
    bounds = [0, *cuts, len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds) if b > a]


@PROPERTIES
@given(data=st.data(), header=valid_header(), payload=st.binary(max_size=64))
def test_any_valid_header_in_any_split_parses_the_same_and_loses_no_byte(
        data: st.DataObject, header: tuple[bytes, ProxyHeader], payload: bytes) -> None:
    raw, expected = header
    pieces = splits(data, raw + payload)
    reader = ProxyHeaderReader(BOTH)
    got = None
    while got is None:
        got = reader.feed(pieces.pop(0))
    assert got == expected
    assert reader.rest() + b"".join(pieces) == payload


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid header with up to three edits: a bit flipped, bytes inserted or deleted, a cut, a
    byte or a length field overwritten; then some payload."""
    raw, _ = draw(valid_header())
    data = bytearray(raw)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "byte", "length"]))
        at = draw(st.integers(0, len(data)))
        if kind == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4) | st.sampled_from([b"\r", b"\n", b" "]))
        elif kind == "delete":
            del data[at:at + draw(st.integers(1, 4))]
        elif kind == "truncate":
            del data[at:]
        elif kind == "byte" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif kind == "length" and len(data) >= 16 and data.startswith(V2_SIGNATURE):
            data[14:16] = draw(st.integers(0, 0xFFFF)).to_bytes(2, "big")
    return bytes(data) + draw(st.binary(max_size=16))


any_bytes = st.one_of(
    st.binary(max_size=64),
    st.binary(max_size=120).map(lambda b: b"PROXY " + b),
    # long lines with no CRLF at all, to just past the v1 limit
    st.binary(min_size=80, max_size=100).map(
        lambda b: b"PROXY UNKNOWN " + b.replace(b"\r", b"").replace(b"\n", b"")),
    st.binary(max_size=300).map(lambda b: V2_SIGNATURE + b),
    st.sampled_from([b"PROXY TCP4 ", b"PROXY TCP6 ", b"PROXY UNKNOWN"]).flatmap(
        lambda head: st.text("0123456789abcdef.: \r\n", max_size=110).map(lambda t: head + t.encode())),
    mutated(),
)


def decide(pieces: list[bytes], versions: frozenset[int]) -> tuple[str, ProxyHeader | None, bytes]:
    """Feed `pieces`: ("header", it, what followed), ("more", None, b""), or ("refused", None, b"").
    Checks on the way that nothing but ProxyHeaderError escapes and nothing is held past a limit."""
    reader = ProxyHeaderReader(versions)
    fed = b""
    for i, piece in enumerate(pieces):
        fed += piece
        try:
            header = reader.feed(piece)
        except ProxyHeaderError:
            assert reader.buffered == 0
            return "refused", None, b""
        if header is not None:
            assert header.length <= (MAX_V1_LENGTH if header.version == 1 else MAX_V2_LENGTH)
            assert fed[:header.length] + reader.rest() == fed
            return "header", header, reader.rest() + b"".join(pieces[i + 1:])
        assert reader.buffered == len(fed)
        assert len(fed) < (MAX_V1_LENGTH if fed.startswith(b"P") else MAX_V2_LENGTH)
    return "more", None, b""


@settings(PROPERTIES, max_examples=600)
@given(data=st.data(), stream=any_bytes,
       versions=st.sampled_from([BOTH, ONLY_V1, ONLY_V2]))
def test_any_bytes_in_any_split_give_one_decision(data: st.DataObject, stream: bytes,
                                                 versions: frozenset[int]) -> None:
    """A header, a wait (only below the limit) or a ProxyHeaderError, never another exception; and
    the same decision whether the bytes came at once or in pieces."""
    at_once = decide([stream] if stream else [], versions)
    in_pieces = decide(splits(data, stream), versions)
    assert in_pieces == at_once
