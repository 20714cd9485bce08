"""ApiVersions: the proxy advertises only what both it and the broker speak."""

from __future__ import annotations

import pytest
from kafka.protocol.metadata import ApiVersionsResponse

from protocol.api_versions import UNSUPPORTED_VERSION, clamp_api_versions, unsupported_version_response
from protocol.apis import KNOWN_APIS, ApiKey
from protocol.errors import MalformedBody

from .wire import body

AV = ApiVersionsResponse.ApiVersion

UNKNOWN_KEY = 9999
assert UNKNOWN_KEY not in KNOWN_APIS

BROKER_RANGES = [
    (ApiKey.PRODUCE, 0, 99),            # broker newer than the proxy: max clamped, min raised
    (ApiKey.FETCH, 0, 3),               # proxy needs Fetch v4+: empty intersection, dropped
    (ApiKey.METADATA, 0, 7),            # broker older: kept as is
    (UNKNOWN_KEY, 0, 2),                # no schema in the proxy: forwarded opaque, the broker's range
    (ApiKey.API_VERSIONS, 0, 3),
    (ApiKey.SASL_HANDSHAKE, 0, 1),
]


def proxy_range(key: int) -> tuple[int, int]:
    spec = KNOWN_APIS[key]
    return spec.min_version, spec.max_version


def entries(ranges: list[tuple[int, int, int]]) -> list[object]:
    return [AV(api_key=k, min_version=lo, max_version=hi) for k, lo, hi in ranges]


def expected_ranges() -> list[tuple[int, int, int]]:
    produce_min, produce_max = proxy_range(ApiKey.PRODUCE)
    return [
        (ApiKey.PRODUCE, produce_min, produce_max),
        (ApiKey.METADATA, 0, 7),
        (UNKNOWN_KEY, 0, 2),
        (ApiKey.API_VERSIONS, 0, 3),
        (ApiKey.SASL_HANDSHAKE, 0, 1),
        # answered by the proxy itself, so offered even by brokers that lack them
        (ApiKey.DESCRIBE_CLIENT_QUOTAS, *proxy_range(ApiKey.DESCRIBE_CLIENT_QUOTAS)),
        (ApiKey.ALTER_CLIENT_QUOTAS, *proxy_range(ApiKey.ALTER_CLIENT_QUOTAS)),
    ]


def test_quota_admin_apis_offered_with_the_proxy_range_not_the_brokers() -> None:
    raw = body(ApiVersionsResponse, 3, error_code=0, throttle_time_ms=0, api_keys=entries(
        [(ApiKey.METADATA, 0, 7), (ApiKey.DESCRIBE_CLIENT_QUOTAS, 0, 0), (ApiKey.ALTER_CLIENT_QUOTAS, 0, 9)]))
    clamped, dropped = clamp_api_versions(raw, 3)
    assert dropped == 0
    decoded = ApiVersionsResponse.decode(clamped, version=3)
    assert [(e.api_key, e.min_version, e.max_version) for e in decoded.api_keys] == [
        (ApiKey.METADATA, 0, 7), (ApiKey.DESCRIBE_CLIENT_QUOTAS, 0, 1), (ApiKey.ALTER_CLIENT_QUOTAS, 0, 1)]


def test_proxy_ranges_used_by_these_tests() -> None:
    assert proxy_range(ApiKey.PRODUCE)[0] > 0
    assert proxy_range(ApiKey.PRODUCE)[1] < 99
    assert proxy_range(ApiKey.FETCH)[0] > 3


@pytest.mark.parametrize("version", [0, 1, 2])
def test_clamp_non_flexible(version: int) -> None:
    extra = {} if version == 0 else {"throttle_time_ms": 12}
    raw = body(ApiVersionsResponse, version, error_code=0, api_keys=entries(BROKER_RANGES), **extra)
    clamped, dropped = clamp_api_versions(raw, version)
    assert dropped == 1
    assert clamped == body(ApiVersionsResponse, version, error_code=0, api_keys=entries(expected_ranges()),
                           **extra)


@pytest.mark.parametrize("version", [3, 4])
def test_clamp_flexible_keeps_feature_tagged_fields(version: int) -> None:
    features = {
        "throttle_time_ms": 0,
        "supported_features": [ApiVersionsResponse.SupportedFeatureKey(name="metadata.version", min_version=1,
                                                                       max_version=21)],
        "finalized_features_epoch": 77,
        "finalized_features": [ApiVersionsResponse.FinalizedFeatureKey(name="metadata.version",
                                                                       max_version_level=21,
                                                                       min_version_level=21)],
        "zk_migration_ready": True,
    }
    raw = body(ApiVersionsResponse, version, error_code=0, api_keys=entries(BROKER_RANGES), **features)
    clamped, dropped = clamp_api_versions(raw, version)
    assert dropped == 1
    assert clamped == body(ApiVersionsResponse, version, error_code=0, api_keys=entries(expected_ranges()),
                           **features)
    decoded = ApiVersionsResponse.decode(clamped, version=version)
    assert decoded.finalized_features_epoch == 77
    assert decoded.supported_features[0].name == "metadata.version"
    assert decoded.zk_migration_ready is True


def test_clamp_nothing_to_drop() -> None:
    raw = body(ApiVersionsResponse, 3, error_code=0, throttle_time_ms=0,
               api_keys=entries([(ApiKey.METADATA, 0, 7), (ApiKey.FIND_COORDINATOR, 0, 2),
                                 (ApiKey.DESCRIBE_CLIENT_QUOTAS, 0, 1), (ApiKey.ALTER_CLIENT_QUOTAS, 0, 1)]))
    clamped, dropped = clamp_api_versions(raw, 3)
    assert dropped == 0
    assert clamped == raw


def test_clamp_broker_error_v0_body() -> None:
    # KIP-511: a broker refusing the request's ApiVersions version answers with a v0 body.
    raw = body(ApiVersionsResponse, 0, error_code=UNSUPPORTED_VERSION,
               api_keys=entries([(ApiKey.API_VERSIONS, 0, 2), (UNKNOWN_KEY, 0, 1)]))
    clamped, dropped = clamp_api_versions(raw, 0)
    assert dropped == 0
    assert clamped == raw


def test_clamp_garbage_raises_malformed_body() -> None:
    with pytest.raises(MalformedBody, match="ApiVersions v3 response: api_keys has length 4 but only 1 "):
        clamp_api_versions(b"\x00\x00\x05\x00", 3)
    with pytest.raises(MalformedBody, match="ApiVersions v3 response does not parse: truncated varint"):
        clamp_api_versions(b"\x00\x00\x01\x00\x00\x00\x00", 3)


@pytest.mark.parametrize("version", [0, 1, 2, 3, 4])
def test_clamp_null_api_keys_raises_malformed_body(version: int) -> None:
    """Found by the property tests: a null array was a TypeError, not a clean close."""
    raw = body(ApiVersionsResponse, version, error_code=0, api_keys=None, throttle_time_ms=0)
    with pytest.raises(MalformedBody, match=rf"ApiVersions v{version} response: api_keys is null"):
        clamp_api_versions(raw, version)


def test_unsupported_version_response() -> None:
    frame = unsupported_version_response(4321)
    assert frame[:4] == (4321).to_bytes(4, "big")  # response header v0: no tagged fields
    decoded = ApiVersionsResponse.decode(frame[4:], version=0)
    assert decoded.error_code == UNSUPPORTED_VERSION == 35
    assert [(e.api_key, e.min_version, e.max_version) for e in decoded.api_keys] == [
        (ApiKey.API_VERSIONS, *proxy_range(ApiKey.API_VERSIONS)),
    ]
    # Nothing after the v0 body: a client decodes it as v0 because the error code is set.
    assert frame[4:] == body(ApiVersionsResponse, 0, error_code=35, api_keys=decoded.api_keys)
