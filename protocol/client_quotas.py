"""DescribeClientQuotas (48) and AlterClientQuotas (49): the codecs for the admin quota APIs.

The proxy answers these itself (Kafka's own tools manage the proxy's quotas through them), so
this module turns request frames into plain values and plain values into response frames, with
kafka-python's schema-generated classes doing the byte work. What the requests *mean* (filter
matching, validation) lives in `config/admin.py`; here an entity is just what the wire carries:
(entity type, name) pairs, a name of None meaning the default entity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kafka.protocol.admin.client_quotas import (
    AlterClientQuotasRequest,
    AlterClientQuotasResponse,
    DescribeClientQuotasRequest,
    DescribeClientQuotasResponse,
)

from .apis import KNOWN_APIS, ApiKey
from .headers import RequestHeader, encode_response_header
from .skim import decode_strict

#: DescribeClientQuotas filter match types (DescribeClientQuotasRequest.MATCH_TYPE_* in Kafka).
MATCH_EXACT, MATCH_DEFAULT, MATCH_SPECIFIED = 0, 1, 2

#: (entity type, name) pairs as on the wire: ("user", "alice"), ("client-id", None) = default.
EntityParts = tuple[tuple[str, str | None], ...]


@dataclass(frozen=True, slots=True)
class FilterComponent:
    entity_type: str
    match_type: int
    match: str | None


@dataclass(frozen=True, slots=True)
class DescribeQuotas:
    components: tuple[FilterComponent, ...]
    strict: bool


@dataclass(frozen=True, slots=True)
class QuotaOp:
    key: str
    value: float
    remove: bool


@dataclass(frozen=True, slots=True)
class AlterEntry:
    entity: EntityParts
    ops: tuple[QuotaOp, ...]


@dataclass(frozen=True, slots=True)
class AlterQuotas:
    entries: tuple[AlterEntry, ...]
    validate_only: bool


@dataclass(frozen=True, slots=True)
class DescribedEntry:
    entity: EntityParts
    values: tuple[tuple[str, float], ...]


@dataclass(frozen=True, slots=True)
class AlterResult:
    entity: EntityParts
    error_code: int
    error_message: str | None


QuotaAdminRequest = DescribeQuotas | AlterQuotas

#: The API keys the proxy answers itself instead of forwarding.
QUOTA_ADMIN_APIS = frozenset({ApiKey.DESCRIBE_CLIENT_QUOTAS, ApiKey.ALTER_CLIENT_QUOTAS})


def _decode(cls: Any, frame: bytes, header: RequestHeader) -> Any:
    return decode_strict(cls, frame, header.body_offset, header.api_version,
                         f"{cls.__name__} v{header.api_version}")


def decode_quota_admin_request(frame: bytes, header: RequestHeader) -> QuotaAdminRequest:
    """A DescribeClientQuotas or AlterClientQuotas request frame as plain values.

    A null or negative array length, or a null where the schema wants a string, raises
    `MalformedBody` naming the field: Kafka's readers refuse the same request and the broker
    closes the connection, which is what the proxy then does.
    """
    if header.api_key == ApiKey.DESCRIBE_CLIENT_QUOTAS:
        message = _decode(DescribeClientQuotasRequest, frame, header)
        return DescribeQuotas(
            tuple(FilterComponent(c.entity_type, c.match_type, c.match) for c in message.components),
            bool(message.strict))
    if header.api_key == ApiKey.ALTER_CLIENT_QUOTAS:
        message = _decode(AlterClientQuotasRequest, frame, header)
        return AlterQuotas(
            tuple(AlterEntry(tuple((e.entity_type, e.entity_name) for e in entry.entity),
                             tuple(QuotaOp(op.key, float(op.value), bool(op.remove)) for op in entry.ops))
                  for entry in message.entries),
            bool(message.validate_only))
    raise ValueError(f"api key {header.api_key} is not a quota admin API")


def _frame(api_key: int, version: int, correlation_id: int, body: bytes) -> bytes:
    header_version = KNOWN_APIS[api_key].response_header_version(version)
    return encode_response_header(correlation_id, header_version) + body


def describe_quotas_response(correlation_id: int, version: int, entries: Sequence[DescribedEntry], *,
                             error_code: int = 0, error_message: str | None = None) -> bytes:
    """A DescribeClientQuotas response (header and body, without the size prefix)."""
    cls = DescribeClientQuotasResponse
    message = cls(
        throttle_time_ms=0, error_code=error_code, error_message=error_message,
        # Kafka sends a null entry list with an error.
        entries=None if error_code else [
            cls.EntryData(
                entity=[cls.EntryData.EntityData(entity_type=t, entity_name=n) for t, n in e.entity],
                values=[cls.EntryData.ValueData(key=k, value=v) for k, v in e.values])
            for e in entries])
    body = bytes(message.encode(version=version))
    return _frame(ApiKey.DESCRIBE_CLIENT_QUOTAS, version, correlation_id, body)


def alter_quotas_response(correlation_id: int, version: int, results: Sequence[AlterResult]) -> bytes:
    """An AlterClientQuotas response (header and body, without the size prefix)."""
    cls = AlterClientQuotasResponse
    message = cls(throttle_time_ms=0, entries=[
        cls.EntryData(error_code=r.error_code, error_message=r.error_message,
                      entity=[cls.EntryData.EntityData(entity_type=t, entity_name=n) for t, n in r.entity])
        for r in results])
    body = bytes(message.encode(version=version))
    return _frame(ApiKey.ALTER_CLIENT_QUOTAS, version, correlation_id, body)


__all__ = [
    "MATCH_DEFAULT", "MATCH_EXACT", "MATCH_SPECIFIED", "QUOTA_ADMIN_APIS", "AlterEntry", "AlterQuotas",
    "AlterResult", "DescribeQuotas", "DescribedEntry", "EntityParts", "FilterComponent", "QuotaAdminRequest",
    "QuotaOp", "alter_quotas_response", "decode_quota_admin_request", "describe_quotas_response",
]
