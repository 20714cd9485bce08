"""Where quotas live when ZooKeeper is not configured: the quota file plus the admin file beside it.

The quota file (`[[quota]]` tables, DESIGN.md) belongs to the operator and is never rewritten:
comments and layout stay theirs. Changes made through the admin API (kafka-configs, `kthrottle
quotas`) go to `<quota file stem>.admin.toml` in the same directory, in the same format, one
table per entity the admin API has touched. An entity in the admin file replaces that entity's
table from the quota file as a whole; an admin-file table without values means "no quotas for
this entity" (it was deleted through the API). So the effective quotas are:

    quota file entities, overridden entity by entity by the admin file, empty entities dropped.

Both files are watched (polled, `poll()`), and SIGHUP forces a reload (`reload()`). An invalid
file is refused whole with a message naming the entity, key and value; the last good quotas stay.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from quotas.engine import QuotaTable
from quotas.entity import QuotaEntity
from quotas.partition_throttle import PartitionThrottle
from quotas.types import ConfigKey

from .admin import Changes, apply_changes
from .partition_throttles import load_partition_throttles
from .quotas import QuotaConfigError, load_quota_file

log = logging.getLogger("kthrottle.config")

_Signature = tuple[int, int, int] | None


class QuotaStoreError(RuntimeError):
    """A change could not be stored; the message says where and why."""


def admin_file_for(quota_file: Path) -> Path:
    return quota_file.with_name(f"{quota_file.stem}.admin.toml")


def _signature(path: Path) -> _Signature:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def merge(base: QuotaTable, overlay: QuotaTable) -> QuotaTable:
    """The quota file overridden entity by entity by the admin file; empty entities dropped."""
    merged = {**base, **overlay}
    return {entity: dict(values) for entity, values in merged.items() if values}


def _toml_string(text: str) -> str:
    # JSON string escapes are valid TOML basic-string escapes; raw UTF-8 avoids surrogate pairs.
    return json.dumps(text, ensure_ascii=False)


def _toml_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**63 else repr(float(value))


def render(table: QuotaTable, header: str = "") -> str:
    """`[[quota]]` tables for a quota table, entities in a stable order."""
    lines = [header] if header else []
    for entity in sorted(table, key=lambda e: (e.user or "", e.client_id or "", e.client_id_prefix or "",
                                               e.ip or "")):
        lines.append("[[quota]]")
        if entity.ip is not None:
            lines.append(f"ip = {_toml_string(entity.ip)}")
        if entity.user is not None:
            lines.append(f"user = {_toml_string(entity.user)}")
        if entity.client_id is not None:
            lines.append(f"client_id = {_toml_string(entity.client_id)}")
        if entity.client_id_prefix is not None:
            lines.append(f"client_id_prefix = {_toml_string(entity.client_id_prefix)}")
        for quota_type, value in sorted(table[entity].items(), key=lambda item: item[0].value):
            lines.append(f"{quota_type.value} = {_toml_number(value)}")
        lines.append("")
    return "\n".join(lines)


class FileQuotaStore:
    """The quota file and its admin file; `on_change` gets every new effective table."""

    #: the admin service applies a change at once; the file's reload confirms it
    applies_own_changes = False

    def __init__(self, quota_file: Path, on_change: Callable[[QuotaTable], None],
                 admin_file: Path | None = None,
                 on_partition_throttles: Callable[[list[PartitionThrottle]], None] | None = None) -> None:
        self.quota_file = quota_file
        self.admin_file = admin_file or admin_file_for(quota_file)
        self._on_change = on_change
        #: gets the quota file's [[partition_throttle]] tables with every load (only the quota file
        #: has them: the admin API changes client quotas, not partition throttles)
        self._on_partition_throttles = on_partition_throttles
        self._throttles: list[PartitionThrottle] = []
        self._table: QuotaTable = {}
        self._seen: tuple[_Signature, _Signature] = (None, None)

    def describe_source(self) -> str:
        return f"{self.quota_file} (admin changes in {self.admin_file})"

    def current(self) -> QuotaTable:
        return self._table

    def _read(self) -> tuple[QuotaTable, QuotaTable]:
        base = load_quota_file(self.quota_file)
        overlay = load_quota_file(self.admin_file) if self.admin_file.exists() else {}
        if self._on_partition_throttles is not None:
            # read with the quotas, so an invalid table refuses the whole file, as a bad [[quota]] does
            self._throttles = load_partition_throttles(self.quota_file)
        return base, overlay

    def start(self) -> None:
        """The first load: an invalid file is an error here, since there are no last good quotas."""
        self._seen = (_signature(self.quota_file), _signature(self.admin_file))
        base, overlay = self._read()
        self._publish(merge(base, overlay), base, overlay)

    def stop(self) -> None:
        pass

    def reload(self) -> bool:
        """Read both files again (SIGHUP); False, with the reason logged, if either is invalid."""
        self._seen = (_signature(self.quota_file), _signature(self.admin_file))
        try:
            base, overlay = self._read()
        except QuotaConfigError as exc:
            log.error("quota file refused, keeping the last good quotas: %s", exc)
            return False
        self._publish(merge(base, overlay), base, overlay)
        return True

    def poll(self) -> bool:
        """Reload when either file changed on disk since it was last read; True if it did."""
        if (_signature(self.quota_file), _signature(self.admin_file)) == self._seen:
            return False
        return self.reload()

    def _publish(self, table: QuotaTable, base: QuotaTable, overlay: QuotaTable) -> None:
        shadowed = sorted(e.describe() for e in base if e in overlay)
        if shadowed:
            log.info("set through the admin API, so %s wins over %s for: %s", self.admin_file.name,
                     self.quota_file.name, "; ".join(shadowed))
        self._table = table
        self._on_change(table)
        if self._on_partition_throttles is not None:
            self._on_partition_throttles(self._throttles)
        log.info("quotas from %s: %d entit%s", self.quota_file, len(table), "y" if len(table) == 1 else "ies")

    def alter(self, changes: Changes) -> None:
        """Apply admin-API changes: rewrite the admin file atomically, then publish."""
        try:
            base, overlay = self._read()
        except QuotaConfigError as exc:
            raise QuotaStoreError(f"cannot change quotas while a quota file is invalid: {exc}") from exc
        effective = merge(base, overlay)
        after = apply_changes(effective, changes)
        new_overlay: dict[QuotaEntity, dict[ConfigKey, float]] = {e: dict(v) for e, v in overlay.items()}
        for entity in changes:
            values = after.get(entity, {})
            if values or entity in base:
                new_overlay[entity] = dict(values)  # an empty table hides the quota file's entity
            else:
                new_overlay.pop(entity, None)
        header = ("# Written by kthrottle for quota changes made through the Kafka admin API\n"
                  f"# (kafka-configs, kthrottle quotas). Entities here override {self.quota_file.name}.\n")
        text = render(new_overlay, header)
        tmp: str | None = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{self.admin_file.name}.", dir=self.admin_file.parent)
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.admin_file)
        except OSError as exc:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            raise QuotaStoreError(f"cannot write {self.admin_file}: {exc}") from exc
        self._seen = (_signature(self.quota_file), _signature(self.admin_file))
        self._publish(merge(base, new_overlay), base, new_overlay)


__all__ = ["FileQuotaStore", "QuotaStoreError", "admin_file_for", "merge", "render"]
