"""Principal candidates from SASL first tokens, and when an exchange is complete."""

from __future__ import annotations

import base64
import json

import pytest

from protocol.sasl import ANONYMOUS, SCRAM_MECHANISMS, SaslExchange, candidate_principal


def plain(authcid: str, password: str = "secret", authzid: str = "") -> bytes:
    return f"{authzid}\x00{authcid}\x00{password}".encode()


def scram_first(saslname: str, gs2: str = "n,,") -> bytes:
    return f"{gs2}n={saslname},r=fyko+d2lbbFgONRv9qkxdawL".encode()


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def jwt(claims: object) -> str:
    header = b64url(json.dumps({"alg": "none"}).encode())
    return f"{header}.{b64url(json.dumps(claims).encode())}.sig"


def oauth_first(token: str, gs2: str = "n,,") -> bytes:
    return f"{gs2}\x01auth=Bearer {token}\x01\x01".encode()


def test_anonymous_name() -> None:
    assert ANONYMOUS == "ANONYMOUS"
    assert {"SCRAM-SHA-256", "SCRAM-SHA-512"} == SCRAM_MECHANISMS


# -- PLAIN ------------------------------------------------------------------------------------


def test_plain_authcid() -> None:
    assert candidate_principal("PLAIN", plain("alice")) == "alice"


def test_plain_with_authzid_uses_authcid() -> None:
    assert candidate_principal("PLAIN", plain("alice", authzid="alice")) == "alice"


def test_plain_utf8_name() -> None:
    assert candidate_principal("PLAIN", plain("j\u00fcrgen")) == "j\u00fcrgen"


@pytest.mark.parametrize("token", [b"", b"alice", b"\x00alice", b"\x00\x00pw", b"a\x00b\x00c\x00d",
                                   b"\x00\xff\xfe\x00pw"])
def test_plain_malformed_gives_none(token: bytes) -> None:
    assert candidate_principal("PLAIN", token) is None


# -- SCRAM ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_scram_name(mechanism: str) -> None:
    assert candidate_principal(mechanism, scram_first("bob")) == "bob"


def test_scram_name_unescaped() -> None:
    # RFC 5802: "," is sent as =2C and "=" as =3D.
    assert candidate_principal("SCRAM-SHA-256", scram_first("a=2Cb=3Dc")) == "a,b=c"


@pytest.mark.parametrize(("escaped", "name"), [
    ("=3D2C", "=2C"),      # a literal "=2C" in the name must not turn into ","
    ("=2C3D", ",3D"),
    ("=3D3D", "=3D"),
    ("x=3D=2C", "x=,"),
])
def test_scram_unescaping_is_not_applied_twice(escaped: str, name: str) -> None:
    assert candidate_principal("SCRAM-SHA-512", scram_first(escaped)) == name


def test_scram_with_authzid_in_gs2_header() -> None:
    assert candidate_principal("SCRAM-SHA-256", scram_first("carol", gs2="n,a=carol,")) == "carol"


def test_scram_with_extensions() -> None:
    token = b"n,,n=dave,r=abc,tokenauth=true"
    assert candidate_principal("SCRAM-SHA-256", token) == "dave"


@pytest.mark.parametrize("token", [b"n,,r=abc,x=1", b"n,,n=bob", b"garbage", b"\xff\xfe,,n=x,r=y"])
def test_scram_malformed_gives_none(token: bytes) -> None:
    assert candidate_principal("SCRAM-SHA-256", token) is None


# -- OAUTHBEARER ------------------------------------------------------------------------------


def test_oauthbearer_sub() -> None:
    assert candidate_principal("OAUTHBEARER", oauth_first(jwt({"sub": "service-x", "exp": 1}))) == "service-x"


def test_oauthbearer_with_authzid_and_extensions() -> None:
    token = f"n,a=service-y,\x01host=kafka\x01auth=Bearer {jwt({'sub': 'service-y'})}\x01\x01".encode()
    assert candidate_principal("OAUTHBEARER", token) == "service-y"


def test_oauthbearer_payload_needing_padding() -> None:
    for name in ("a", "ab", "abc", "abcd"):
        assert candidate_principal("OAUTHBEARER", oauth_first(jwt({"sub": name}))) == name


@pytest.mark.parametrize("token", [
    oauth_first(jwt({"iss": "x"})),              # no sub
    oauth_first(jwt({"sub": ""})),               # empty sub
    oauth_first(jwt({"sub": 42})),               # not a string
    oauth_first(jwt(["sub"])),                   # not an object
    oauth_first("nodots"),
    oauth_first("aaa.!!!notbase64!!!.sig"),
    oauth_first(f"aaa.{b64url(b'not json')}.sig"),
    b"n,,\x01host=x\x01\x01",                    # no auth=
    b"\xff\xfe",
])
def test_oauthbearer_malformed_gives_none(token: bytes) -> None:
    assert candidate_principal("OAUTHBEARER", token) is None


def test_unknown_mechanism_hides_name() -> None:
    assert candidate_principal("GSSAPI", plain("alice")) is None


# -- SaslExchange ----------------------------------------------------------------------------


def test_exchange_candidate_comes_from_first_client_token_only() -> None:
    exchange = SaslExchange("SCRAM-SHA-256")
    exchange.client_token(scram_first("erin"))
    exchange.client_token(b"c=biws,r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j,p=v0X8v3Bz2T0CJGbJQyF0X+HI4Ts=")
    assert exchange.candidate == "erin"
    assert exchange.client_tokens == 2


def test_plain_completes_on_first_answer() -> None:
    exchange = SaslExchange("PLAIN")
    exchange.client_token(plain("alice"))
    assert exchange.server_token(b"") is True
    assert exchange.server_tokens == 1


@pytest.mark.parametrize("mechanism", sorted(SCRAM_MECHANISMS))
def test_scram_completes_only_on_server_final(mechanism: str) -> None:
    exchange = SaslExchange(mechanism)
    exchange.client_token(scram_first("bob"))
    assert exchange.server_token(b"r=fyko+d2lbbFgONRv9qkxdawL3rfc,s=QSXCR+Q6sek8bf92,i=4096") is False
    exchange.client_token(b"c=biws,r=fyko,p=proof")
    assert exchange.server_token(b"v=rmF9pqV8S7suAoZWja4dJRkFsKQ=") is True
    assert exchange.server_tokens == 2


def test_oauthbearer_completes_on_empty_answer_not_on_error_challenge() -> None:
    exchange = SaslExchange("OAUTHBEARER")
    exchange.client_token(oauth_first(jwt({"sub": "svc"})))
    assert exchange.server_token(b'{"status":"invalid_token"}') is False
    assert exchange.server_token(b"") is True


def test_gssapi_never_names_a_principal() -> None:
    exchange = SaslExchange("GSSAPI")
    exchange.client_token(b"\x60\x82kerberos-ap-req")
    assert exchange.candidate is None
