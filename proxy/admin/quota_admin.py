"""Answering DescribeClientQuotas and AlterClientQuotas: who may, and storing the change.

Kafka's tools (`kafka-configs --bootstrap-server <proxy>`) and `kthrottle quotas` manage the
proxy's quotas through these APIs. Only the principals in `proxy.quota_admins` may alter; the
principal is what the broker authenticated (SASL) or ANONYMOUS, never a claimed name. Describing
needs the same unless `proxy.quota_describe = "everyone"`. Admin answers are not charged to quotas.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from config.admin import (
    CLUSTER_AUTHORIZATION_FAILED,
    NONE,
    UNKNOWN_SERVER_ERROR,
    AdminError,
    Changes,
    apply_changes,
    describe,
    plan_alter,
)
from config.settings import ProxySettings
from protocol.client_quotas import (
    AlterQuotas,
    AlterResult,
    DescribeQuotas,
    alter_quotas_response,
    describe_quotas_response,
)
from protocol.connection import QuotaAdmin
from quotas.engine import QuotaTable

log = logging.getLogger("kthrottle.admin")


class QuotaStore(Protocol):
    """A place quotas live: the quota file (config.store) or ZooKeeper (config.zookeeper)."""

    #: whether `alter` hands the new table on itself, in the store's own order (else the admin
    #: service applies the change at once and the store's notification confirms it later)
    applies_own_changes: bool

    def current(self) -> QuotaTable: ...

    def alter(self, changes: Changes) -> None: ...

    def stop(self) -> None: ...


class QuotaAdminService:
    def __init__(self, settings: ProxySettings, store: QuotaStore | None,
                 in_force: Callable[[], QuotaTable], apply: Callable[[QuotaTable], None]) -> None:
        self.admins = frozenset(settings.quota_admins)
        self.describe_open = settings.quota_describe == "everyone"
        self.store = store
        self._in_force = in_force
        self._apply = apply
        self._lock = asyncio.Lock()  # one read-modify-write at a time in this process

    def _is_admin(self, principal: str) -> bool:
        return f"User:{principal}" in self.admins

    def _denied(self, principal: str, what: str) -> str:
        return (f"principal User:{principal} may not {what} quotas on this proxy "
                "(it is not in proxy.quota_admins)")

    async def answer(self, request: QuotaAdmin) -> bytes:
        """The response frame (header and body) for one admin request."""
        if isinstance(request.request, DescribeQuotas):
            return self._describe(request, request.request)
        assert isinstance(request.request, AlterQuotas)
        results = await self._alter(request, request.request)
        return alter_quotas_response(request.correlation_id, request.api_version, results)

    def _describe(self, request: QuotaAdmin, body: DescribeQuotas) -> bytes:
        cid, version = request.correlation_id, request.api_version
        if not (self.describe_open or self._is_admin(request.principal)):
            log.warning("DescribeClientQuotas refused: %s", self._denied(request.principal, "describe"))
            return describe_quotas_response(cid, version, [], error_code=CLUSTER_AUTHORIZATION_FAILED,
                                            error_message=self._denied(request.principal, "describe"))
        try:
            entries = describe(self._in_force(), body)  # what is enforced now, changes included
        except AdminError as exc:
            return describe_quotas_response(cid, version, [], error_code=exc.code, error_message=exc.message)
        return describe_quotas_response(cid, version, entries)

    async def _alter(self, request: QuotaAdmin, body: AlterQuotas) -> list[AlterResult]:
        if not self._is_admin(request.principal):
            message = self._denied(request.principal, "alter")
            log.warning("AlterClientQuotas refused: %s", message)
            return [AlterResult(entry.entity, CLUSTER_AUTHORIZATION_FAILED, message)
                    for entry in body.entries]
        plan = plan_alter(body)
        for result in plan.results:
            if result.error_code != NONE:
                log.warning("AlterClientQuotas from User:%s: %s refused: %s", request.principal,
                            result.entity, result.error_message)
        if not plan.changes:
            return plan.results
        store = self.store
        if store is None:
            message = "this proxy has no quota store (run it with --config FILE or proxy.zookeeper)"
            return [AlterResult(r.entity, UNKNOWN_SERVER_ERROR, message) if r.error_code == NONE else r
                    for r in plan.results]
        async with self._lock:
            try:
                await asyncio.get_running_loop().run_in_executor(None, store.alter, plan.changes)
            except Exception as exc:
                log.error("AlterClientQuotas from User:%s not stored: %s", request.principal, exc)
                message = f"quotas not stored: {exc}"
                return [AlterResult(r.entity, UNKNOWN_SERVER_ERROR, message) if r.error_code == NONE else r
                        for r in plan.results]
            if not store.applies_own_changes:
                # Live at once on this proxy; the store's own notification confirms it later.
                self._apply(apply_changes(self._in_force(), plan.changes))
        log.info("AlterClientQuotas from User:%s applied: %s", request.principal,
                 "; ".join(f"{e.describe()}: " + ", ".join(
                     f"{t.value}={'removed' if v is None else v}" for t, v in ops.items())
                     for e, ops in plan.changes.items()))
        return plan.results


__all__ = ["QuotaAdminService", "QuotaStore"]
