"""A small client for the admin quota APIs, on kafka-python's admin client.

Used by `kthrottle quotas` (for people without Kafka's shell tools) and by the tests. kafka-python's
KafkaAdminClient has no client-quota methods, so the requests (its schema-generated
DescribeClientQuotas / AlterClientQuotas classes) go through the admin client's own connection
manager: the same bootstrap, SASL and retry handling as every other admin call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: An entity as {"user": name, "client-id": name} (or "client-id-prefix": prefix); None is the default
#: entity.
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
    """Entities and their quotas; `user=` / `client_id=` / `client_id_prefix=` select (None = the
    default entity).

    Raises PermissionError when the proxy refuses (CLUSTER_AUTHORIZATION_FAILED), RuntimeError
    for any other error, with the proxy's message.
    """
    from kafka.protocol.admin.client_quotas import DescribeClientQuotasRequest as Req

    components = []
    for arg, entity_type in (("user", "user"), ("client_id", "client-id"),
                             ("client_id_prefix", "client-id-prefix")):
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


# -- `kthrottle quotas` ---------------------------------------------------------------------------


def _entity_from_args(args: Any) -> Entity:
    entity: Entity = {}
    if args.default_user:
        entity["user"] = None
    elif args.user is not None:
        entity["user"] = args.user
    if args.default_client_id:
        entity["client-id"] = None
    elif args.client_id is not None:
        entity["client-id"] = args.client_id
    if getattr(args, "client_id_prefix", None) is not None:
        entity["client-id-prefix"] = args.client_id_prefix
    return entity


def _connection_config(args: Any) -> dict[str, Any]:
    """kafka-python settings from the command line: SASL and/or TLS, as Kafka's security.protocol.

    TLS always verifies the proxy's certificate chain (against --tls-ca) and its host name, as
    Kafka clients do by default (ssl.endpoint.identification.algorithm=https).
    """
    tls = getattr(args, "tls_ca", None) is not None
    certificate, key = getattr(args, "tls_certificate", None), getattr(args, "tls_key", None)
    if (certificate is None) != (key is None):
        raise ValueError("--tls-certificate and --tls-key go together")
    if certificate is not None and not tls:
        raise ValueError("--tls-certificate needs --tls-ca (the CA that signed the proxy's certificate)")
    config: dict[str, Any] = {}
    if args.sasl_mechanism:
        config.update(sasl_mechanism=args.sasl_mechanism, sasl_plain_username=args.sasl_username,
                      sasl_plain_password=args.sasl_password)
    config["security_protocol"] = ("SASL_" if args.sasl_mechanism else "") + ("SSL" if tls else "PLAINTEXT")
    if tls:
        config.update(ssl_cafile=str(args.tls_ca), ssl_check_hostname=True)
        if certificate is not None:
            config.update(ssl_certfile=str(certificate), ssl_keyfile=str(key))
    return config


def _selector(entity: Entity) -> dict[str, str | None]:
    return {kind.replace("-", "_"): name for kind, name in entity.items()}


def _number(value: float) -> str:
    """1048576, not 1.04858e+06: byte rates are whole numbers and people compare them exactly."""
    return str(int(value)) if float(value).is_integer() else repr(value)


def format_entity(entity: Entity) -> str:
    return ", ".join(f"{kind}={'<default>' if name is None else name}" for kind, name in entity.items())


def run_command(args: Any) -> int:
    """`kthrottle quotas describe|set|delete`; prints what happened, returns the exit code."""
    import sys

    try:
        config = _connection_config(args)
    except ValueError as exc:
        print(f"kthrottle quotas: {exc}", file=sys.stderr)
        return 2
    entity = _entity_from_args(args)
    try:
        if args.action == "describe":
            found = describe(args.bootstrap_server, **_selector(entity), **config)
            for described, values in found:
                quotas = ", ".join(f"{key}={_number(value)}" for key, value in sorted(values.items()))
                print(f"{format_entity(described)}: {quotas}")
            if not found:
                print("no quotas match")
            return 0
        if not entity:
            print("kthrottle quotas: name an entity: --user/--default-user and/or "
                  "--client-id/--default-client-id/--client-id-prefix", file=sys.stderr)
            return 2
        ops: list[Op] = []
        if args.action == "set":
            for item in args.quotas:
                key, sep, value = item.partition("=")
                try:
                    number = float(value)
                except ValueError:
                    number = float("nan")
                if not sep or number != number:
                    print(f"kthrottle quotas: {item!r} is not KEY=NUMBER", file=sys.stderr)
                    return 2
                ops.append((key, number, False))
        else:
            keys = list(args.keys)
            if not keys:  # every quota the entity has
                found = describe(args.bootstrap_server, strict=True, **_selector(entity), **config)
                keys = sorted({key for _, values in found for key in values})
            ops = [(key, 0.0, True) for key in keys]
            if not ops:
                print(f"{format_entity(entity)}: no quotas to delete")
                return 0
        ((code, message),) = alter(args.bootstrap_server, [(entity, ops)],
                                   validate_only=getattr(args, "validate_only", False), **config)
    except PermissionError as exc:
        print(f"kthrottle quotas: not allowed: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        print(f"kthrottle quotas: {exc}", file=sys.stderr)
        return 1
    if code != 0:
        print(f"kthrottle quotas: refused (error {code}): {message}", file=sys.stderr)
        return 1
    done = "validated" if getattr(args, "validate_only", False) else "done"
    print(f"{format_entity(entity)}: {args.action} {', '.join(op[0] for op in ops)}: {done}")
    return 0
