"""A small client for the admin quota APIs, on kafka-python's admin client.

Used by `kthrottle quotas` (for people without Kafka's shell tools) and by the tests. kafka-python's
KafkaAdminClient has no client-quota methods, so the requests (its schema-generated
DescribeClientQuotas / AlterClientQuotas classes) go through the admin client's own connection
manager: the same bootstrap, SASL and retry handling as every other admin call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: An entity as {"user": name, "client-id": name}; None is the default entity.
Entity = dict[str, str | None]
#: (key, value, remove)
Op = tuple[str, float, bool]

CLUSTER_AUTHORIZATION_FAILED = 31


def _send(bootstrap: str, request: Any, **config: Any) -> Any:
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(
        bootstrap_servers=bootstrap, client_id=config.pop("client_id", "kthrottle-quotas"), **config
    )
    try:
        manager = admin._manager  # no public method sends an arbitrary request (kafka-python 3.0)

        async def call() -> Any:
            return await manager.send(request)

        return manager.run(call)
    finally:
        admin.close()


def describe(
    bootstrap: str, *, strict: bool = False, **selector_and_config: Any
) -> list[tuple[Entity, dict[str, float]]]:
    """Entities and their quotas; `user=` / `client_id=` select (None = the default entity).

    Raises PermissionError when the proxy refuses (CLUSTER_AUTHORIZATION_FAILED), RuntimeError
    for any other error, with the proxy's message.
    """
    from kafka.protocol.admin.client_quotas import DescribeClientQuotasRequest as Req

    components = []
    for arg, entity_type in (("user", "user"), ("client_id", "client-id")):
        if arg in selector_and_config:
            name = selector_and_config.pop(arg)
            components.append(
                Req.ComponentData(
                    entity_type=entity_type, match_type=0 if name is not None else 1, match=name
                )
            )
    response = _send(bootstrap, Req(components=components, strict=strict), **selector_and_config)
    if response.error_code == CLUSTER_AUTHORIZATION_FAILED:
        raise PermissionError(response.error_message)
    if response.error_code:
        raise RuntimeError(
            f"DescribeClientQuotas failed with error {response.error_code}: {response.error_message}"
        )
    return sorted(
        (
            (({e.entity_type: e.entity_name for e in entry.entity}), {v.key: v.value for v in entry.values})
            for entry in response.entries or []
        ),
        key=lambda item: sorted((k, v or "") for k, v in item[0].items()),
    )


def alter(
    bootstrap: str,
    entries: Sequence[tuple[Entity, Sequence[Op]]],
    *,
    validate_only: bool = False,
    **config: Any,
) -> list[tuple[int, str | None]]:
    """(error code, message) per entry, in order."""
    from kafka.protocol.admin.client_quotas import AlterClientQuotasRequest as Req

    request = Req(
        validate_only=validate_only,
        entries=[
            Req.EntryData(
                entity=[Req.EntryData.EntityData(entity_type=t, entity_name=n) for t, n in entity.items()],
                ops=[Req.EntryData.OpData(key=k, value=v, remove=r) for k, v, r in ops],
            )
            for entity, ops in entries
        ],
    )
    response = _send(bootstrap, request, **config)
    return [(entry.error_code, entry.error_message) for entry in response.entries]


__all__ = ["alter", "describe"]
