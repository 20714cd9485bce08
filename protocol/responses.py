"""Response bodies the client must see differently from what the broker sent.

Broker addresses point at the proxy's listeners (Metadata, FindCoordinator, DescribeCluster,
NodeEndpoints of Produce, Fetch, ShareFetch and ShareAcknowledge), DescribeQuorum names no
controller, and ApiVersions offers no version above what the proxy can handle. Kept apart from the
connection so each rewrite stays one small rule; every other response passes untouched.
"""

from __future__ import annotations

from .actions import Action, BrokersSeen
from .addresses import needs_rewrite, rewrite_addresses
from .api_versions import UNSUPPORTED_VERSION, clamp_api_versions
from .apis import ApiKey, response_header_version
from .broker_array import Advertise
from .headers import response_body_offset
from .in_flight import InFlight


def rewrite_response(entry: InFlight, frame: bytes, advertise: Advertise, actions: list[Action]) -> bytes:
    """The response frame to send on; broker addresses it names are reported as BrokersSeen."""
    key, version = entry.api_key, entry.api_version
    if needs_rewrite(key, version):
        header_version = response_header_version(key, version)
        assert header_version is not None  # every address-bearing API has a known layout
        result = rewrite_addresses(key, version, frame, header_version, advertise)
        if result.discovered:
            actions.append(BrokersSeen(result.discovered))
        return result.frame
    if key == ApiKey.API_VERSIONS:
        start = response_body_offset(frame, 0)
        error_code = int.from_bytes(frame[start : start + 2], "big", signed=True)
        if error_code == UNSUPPORTED_VERSION:
            # The broker refuses the client's version with a v0 body and its range (KIP-511).
            body, _ = clamp_api_versions(frame[start:], 0)
            return frame[:start] + body
        if error_code != 0:
            return frame  # any other error is in the request's version, with no ranges to clamp
        body, _ = clamp_api_versions(frame[start:], version)
        return frame[:start] + body
    return frame


__all__ = ["rewrite_response"]
