"""A TLS client on a plaintext listener is named as such, from its first four bytes.

The ClientHello is a real one, written by Python's ssl into a memory buffer (no socket), for
each TLS version a client may start with.
"""

from __future__ import annotations

import ssl

import pytest

from protocol.connection import Close, ProxyConnection
from protocol.errors import FrameSizeError
from protocol.frames import DEFAULT_MAX_REQUEST_BYTES, TLS_ON_PLAINTEXT, FrameSplitter, frame


def client_hello(version: ssl.TLSVersion, server_hostname: str | None = "broker.example") -> bytes:
    """The first flight of a TLS client, as it would arrive on the proxy's socket."""
    context = ssl.create_default_context()
    context.minimum_version = version
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_side=False, server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def advertise(node_id: int) -> tuple[str, int]:
    return "127.0.0.1", 9000 + node_id


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
@pytest.mark.parametrize("hostname", ["broker.example", None])
def test_client_hello_is_named_a_tls_handshake(version: ssl.TLSVersion, hostname: str | None) -> None:
    hello = client_hello(version, hostname)
    assert hello[:2] == b"\x16\x03"
    with pytest.raises(FrameSizeError, match=TLS_ON_PLAINTEXT) as raised:
        FrameSplitter(DEFAULT_MAX_REQUEST_BYTES, "request").feed(hello)
    assert hello[:4].hex(" ") in str(raised.value)


def test_client_hello_split_before_its_fourth_byte_is_named_too() -> None:
    hello = client_hello(ssl.TLSVersion.TLSv1_2)
    splitter = FrameSplitter(DEFAULT_MAX_REQUEST_BYTES, "request")
    assert splitter.feed(hello[:3]) == []
    with pytest.raises(FrameSizeError, match=TLS_ON_PLAINTEXT):
        splitter.feed(hello[3:])


def test_other_oversized_prefixes_keep_the_size_message() -> None:
    # 0x16 0x04... and 0x17 0x03... are too large as well but are not a TLS handshake record.
    for prefix in (b"\x16\x04\x00\x00", b"\x17\x03\x03\x00", b"\x7f\xff\xff\xff", b"\xff\xff\xff\xff"):
        with pytest.raises(FrameSizeError) as raised:
            FrameSplitter(DEFAULT_MAX_REQUEST_BYTES, "request").feed(prefix)
        assert TLS_ON_PLAINTEXT not in str(raised.value)
        assert "request size" in str(raised.value)


def test_a_valid_frame_starting_like_tls_is_not_refused_when_the_limit_allows_it() -> None:
    # The check runs only once a size is refused: a limit above 0x16030000 takes such a size as a
    # size (the documented trade for keeping valid frames free of any extra test).
    splitter = FrameSplitter(0x16030100, "request")
    assert splitter.feed(b"\x16\x03\x01\x00" + b"x" * 10) == []
    assert splitter.declared_size == 0x16030100


def test_connection_closes_with_the_tls_reason() -> None:
    conn = ProxyConnection(advertise)
    actions = conn.receive_from_client(client_hello(ssl.TLSVersion.TLSv1_3))
    assert len(actions) == 1 and isinstance(actions[0], Close)
    assert TLS_ON_PLAINTEXT in actions[0].reason
    assert conn.closed is not None and TLS_ON_PLAINTEXT in conn.closed


def test_plaintext_requests_are_untouched_by_the_check() -> None:
    splitter = FrameSplitter(DEFAULT_MAX_REQUEST_BYTES, "request")
    # A request whose size prefix starts with 0x16 0x03 cannot exist under the default limit, but
    # bodies beginning with those bytes are ordinary data.
    assert splitter.feed(frame(b"\x16\x03\x01rest") + frame(b"")) == [b"\x16\x03\x01rest", b""]
