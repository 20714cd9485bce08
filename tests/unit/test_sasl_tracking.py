"""SaslTracking on its own: following a SASL exchange from the frames, without a connection."""

from __future__ import annotations

import pytest
from kafka.protocol.sasl import (
    SaslAuthenticateRequest,
    SaslAuthenticateResponse,
    SaslHandshakeRequest,
    SaslHandshakeResponse,
)

from protocol.apis import ApiKey
from protocol.errors import MalformedBody, UnsupportedVersion
from protocol.headers import parse_request_header
from protocol.sasl_tracking import SASL_SETUP_APIS, SaslTracking

from .wire import request, response

PLAIN_ALICE = b"\x00alice\x00secret"


def handshake(tracking: SaslTracking, mechanism: str, version: int = 1, error_code: int = 0) -> None:
    frame = request(SaslHandshakeRequest, version, 1, mechanism=mechanism)
    tracking.handshake_request(frame, parse_request_header(frame))
    tracking.handshake_response(response(SaslHandshakeResponse, version, 1, error_code=error_code,
                                         mechanisms=["PLAIN", "GSSAPI"]), version)


def authenticate(tracking: SaslTracking, token: bytes) -> None:
    frame = request(SaslAuthenticateRequest, 2, 2, auth_bytes=token)
    tracking.authenticate_request(frame, parse_request_header(frame))


def answer(error_code: int = 0, token: bytes = b"") -> bytes:
    return response(SaslAuthenticateResponse, 2, 2, error_code=error_code, auth_bytes=token,
                    error_message=None if error_code == 0 else "bad password", session_lifetime_ms=0)


def test_setup_apis_are_those_a_broker_takes_mid_exchange() -> None:
    assert {ApiKey.API_VERSIONS, ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE} == SASL_SETUP_APIS


def test_plain_exchange_is_accepted_only_on_the_brokers_answer() -> None:
    tracking = SaslTracking()
    handshake(tracking, "PLAIN")
    assert tracking.in_progress and tracking.raw is None
    authenticate(tracking, PLAIN_ALICE)
    assert tracking.in_progress
    accepted = tracking.authenticate_response(answer(), 2)
    assert accepted is not None and accepted.candidate == "alice"


def test_refused_exchange_is_forgotten() -> None:
    tracking = SaslTracking()
    handshake(tracking, "PLAIN")
    authenticate(tracking, PLAIN_ALICE)
    assert tracking.authenticate_response(answer(error_code=58), 2) is None
    assert tracking.exchange is None
    assert tracking.in_progress  # the broker closes the connection; it never became established


def test_reauthentication_does_not_undo_settled() -> None:
    tracking = SaslTracking()
    handshake(tracking, "PLAIN")
    tracking.settle()
    handshake(tracking, "PLAIN")  # KIP-368 re-authentication
    assert tracking.settled and not tracking.in_progress


def test_authenticate_without_handshake_is_malformed() -> None:
    with pytest.raises(MalformedBody, match="without a SaslHandshake"):
        authenticate(SaslTracking(), PLAIN_ALICE)


def test_v0_handshake_switches_to_raw_tokens_until_the_broker_accepts() -> None:
    tracking = SaslTracking()
    frame = request(SaslHandshakeRequest, 0, 1, mechanism="PLAIN")
    tracking.handshake_request(frame, parse_request_header(frame))
    assert tracking.raw_possible
    tracking.handshake_response(response(SaslHandshakeResponse, 0, 1, error_code=0, mechanisms=["PLAIN"]), 0)
    assert not tracking.raw_possible and tracking.raw is tracking.exchange
    assert tracking.raw is not None
    tracking.raw.client_token(PLAIN_ALICE)
    accepted = tracking.raw_server_token(b"")
    assert accepted is not None and accepted.candidate == "alice"
    assert tracking.raw is None


def test_refused_v0_handshake_stays_framed() -> None:
    tracking = SaslTracking()
    handshake(tracking, "PLAIN", version=0, error_code=33)
    assert tracking.raw is None and not tracking.raw_possible


def test_v0_handshake_with_unfollowable_mechanism_is_refused() -> None:
    with pytest.raises(UnsupportedVersion, match="GSSAPI"):
        handshake(SaslTracking(), "GSSAPI", version=0)
