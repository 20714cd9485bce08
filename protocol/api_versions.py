"""ApiVersions: clamping the broker's answer to what the proxy can handle.

For an API it knows (a kafka-python schema) the proxy may have to patch the throttle field or
decode the body, so it advertises the intersection of the broker's range and its schema's. An API
whose body must be read by hand for broker addresses (ShareFetch, ShareAcknowledge, DescribeQuorum)
is offered only in the versions that reader knows. Every other API key passes with the broker's
own range: the proxy forwards it opaque (headers are read the same way whatever the API, and
responses matched by correlation id), so a Kafka 4 client finds KIP-848 consumer groups, share
groups, client telemetry and whatever a newer broker adds, as it would on the broker.
"""

from __future__ import annotations

from collections.abc import Collection

from .apis import KNOWN_APIS, ApiKey, ApiSpec, api_name
from .client_quotas import QUOTA_ADMIN_APIS
from .errors import UnsupportedVersion
from .fetch_stream import FETCH_STREAM_VERSIONS
from .headers import RequestHeader, encode_response_header
from .node_endpoints import READABLE_VERSIONS
from .skim import decode_strict

#: Kafka's UNSUPPORTED_VERSION error code.
UNSUPPORTED_VERSION = 35

_API_VERSIONS: ApiSpec = KNOWN_APIS[ApiKey.API_VERSIONS]

#: Versions the proxy offers below its schemas' range, and why.
#: Fetch v16+ may end with KIP-951 NodeEndpoints (broker addresses) after all the records; the
#: proxy streams large responses while it follows their layout to rewrite that tail
#: (`fetch_stream.py`), so it offers only the versions whose layout that reader knows.
OFFERED_MAX_VERSION: dict[int, int] = {ApiKey.FETCH: FETCH_STREAM_VERSIONS[1]}


def offered_range(api_key: int) -> tuple[int, int] | None:
    """The versions the proxy can handle for an API key; None: any (forwarded opaque)."""
    spec = KNOWN_APIS.get(api_key)
    readable = READABLE_VERSIONS.get(api_key)
    if spec is None:
        return readable
    low = spec.min_version
    high = min(spec.max_version, OFFERED_MAX_VERSION.get(api_key, spec.max_version))
    if readable is not None:
        low, high = max(low, readable[0]), min(high, readable[1])
    return low, high


def clamp_api_versions(body: bytes, api_version: int) -> tuple[bytes, int]:
    """Clamp an ApiVersions response body; returns (new body, number of keys dropped).

    `api_version` is the version the body is encoded in: the request's for a success, 0 for an
    UNSUPPORTED_VERSION refusal (kafka-python's decoder reads any error body as v0).
    """
    cls = _API_VERSIONS.response_class
    # Any error body is read as v0, as kafka-python's decoder and Kafka's clients do (KIP-511).
    error_code = int.from_bytes(body[:2], "big", signed=True) if len(body) >= 2 else 0
    message = decode_strict(cls, body, 0, api_version if error_code == 0 else 0,
                            f"ApiVersions v{api_version} response")
    kept = []
    missing_local = set(QUOTA_ADMIN_APIS) if message.error_code == 0 else set()
    for entry in message.api_keys:
        offered = offered_range(entry.api_key)
        if offered is None:
            kept.append(entry)  # forwarded opaque: the broker's range as it is
            continue
        if entry.api_key in missing_local:
            # The proxy answers the quota admin APIs itself, whatever the brokers support.
            entry.min_version, entry.max_version = offered
            missing_local.discard(entry.api_key)
            kept.append(entry)
            continue
        low = max(entry.min_version, offered[0])
        high = min(entry.max_version, offered[1])
        if low > high:
            continue
        entry.min_version, entry.max_version = low, high
        kept.append(entry)
    original = {int(entry.api_key) for entry in message.api_keys}
    for key in sorted(missing_local):
        low, high = offered_range(key) or (0, 0)
        kept.append(cls.ApiVersion(api_key=int(key), min_version=low, max_version=high))
    message.api_keys = kept
    dropped = len(original - {int(entry.api_key) for entry in kept})
    return bytes(message.encode()), dropped  # decoded messages keep their version


def check_request_version(header: RequestHeader, decoded: Collection[int]) -> bytes | None:
    """Refuse a request version the proxy cannot handle, as its ApiVersions answer promised.

    An ApiVersions request newer than the schemas gets the answer a broker gives (returned, to
    be sent by the proxy): UNSUPPORTED_VERSION with the proxy's range, so the client retries
    older. Raises UnsupportedVersion for an API in `decoded` above its schemas, and for one whose
    response names broker addresses in a layout the proxy cannot read at that version.
    """
    spec = KNOWN_APIS.get(header.api_key)
    if spec is not None and header.api_version > spec.max_version:
        if header.api_key == ApiKey.API_VERSIONS:
            return unsupported_version_response(header.correlation_id)
        if header.api_key in decoded:
            raise UnsupportedVersion(
                f"{spec.name} v{header.api_version} is above v{spec.max_version}, the newest "
                "the proxy can decode (the client ignored the ApiVersions answer)")
    readable = READABLE_VERSIONS.get(header.api_key)
    if readable is not None and not readable[0] <= header.api_version <= readable[1]:
        # Its response names broker addresses where only a known layout can find them.
        raise UnsupportedVersion(
            f"{api_name(header.api_key)} v{header.api_version} is outside v{readable[0]} to "
            f"v{readable[1]}, the versions whose broker addresses the proxy can rewrite "
            "(the client ignored the ApiVersions answer)")
    return None


def unsupported_version_response(correlation_id: int) -> bytes:
    """What a broker answers to an ApiVersions request newer than it knows (KIP-511).

    A v0 body with UNSUPPORTED_VERSION and the proxy's own ApiVersions range, so the client
    retries with a version both sides speak.
    """
    cls = _API_VERSIONS.response_class
    entry = cls.ApiVersion(api_key=int(ApiKey.API_VERSIONS), min_version=_API_VERSIONS.min_version,
                           max_version=_API_VERSIONS.max_version)
    body = cls(error_code=UNSUPPORTED_VERSION, api_keys=[entry]).encode(version=0)
    return encode_response_header(correlation_id, 0) + bytes(body)
