"""The quota table that a set of entity znodes stands for, and the data an alteration writes to one.

Pure (no ZooKeeper client): ``config/zookeeper.py`` reads the nodes and writes the data; this module
decides what they mean. Kept apart so that the watching source holds one job (talking to ZooKeeper)
and the format's rules (bad names, duplicates, invalid data keeping the last good values) are readable
and testable without an ensemble.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from quotas.engine import QuotaTable
from quotas.entity import QuotaEntity
from quotas.types import ConfigKey

from .config_form import decode_config, entity_for_path, entity_path, format_value, parse_quota_config
from .quotas import QuotaConfigError

log = logging.getLogger("kthrottle.config.zookeeper")


class QuotaTree:
    """Turns each full read of the entity nodes into a table, remembering what it parsed last.

    An entity whose node holds invalid data keeps its values from the last table (an error names the
    entity, key and value, once per distinct data); a node that disappears takes its entity out. A
    node under a non-canonical path that names an entity already seen is ignored, as Kafka would
    never write it.
    """

    def __init__(self, where: str, root: str) -> None:
        #: for log lines: the ensemble and chroot, and the config root under it
        self._where = where
        self._root = root
        #: Per entity path: the node data last parsed and its result (None when invalid), so unchanged
        #: nodes are neither parsed nor reported again on every re-read.
        self._parsed: dict[str, tuple[bytes, dict[ConfigKey, float] | None]] = {}

    def table(self, nodes: Mapping[str, bytes], last: QuotaTable) -> QuotaTable:
        """The table for `nodes` (entity path relative to the root -> data); `last` is the one in force."""
        table: QuotaTable = {}
        canonical: dict[QuotaEntity, bool] = {}
        parsed: dict[str, tuple[bytes, dict[ConfigKey, float] | None]] = {}
        for relative, data in sorted(nodes.items()):
            try:
                entity = entity_for_path(relative)
            except (ValueError, UnicodeDecodeError) as exc:
                if relative not in self._parsed:
                    log.error("ZooKeeper %s: ignoring %s/%s: not a sanitized entity name (%s)",
                              self._where, self._root, relative, exc)
                parsed[relative] = (data, None)
                continue
            previous = self._parsed.get(relative)
            if previous is not None and previous[0] == data:
                values = previous[1]
            else:
                values = self._parse(entity, relative, data, last)
            parsed[relative] = (data, values)
            is_canonical = entity_path(entity) == relative
            if entity in canonical and (canonical[entity] or not is_canonical):
                log.warning("ZooKeeper %s: %s/%s names %s again; ignored",
                            self._where, self._root, relative, entity.describe())
                continue
            canonical[entity] = is_canonical
            if values is None:
                values = last.get(entity)
            if values:
                table[entity] = dict(values)
            else:
                table.pop(entity, None)
        self._parsed = parsed
        return table

    def _parse(self, entity: QuotaEntity, relative: str, data: bytes,
               last: QuotaTable) -> dict[ConfigKey, float] | None:
        """One node's quotas, or None (with an error naming the entity, key and value) when invalid."""
        try:
            return parse_quota_config(entity, decode_config(data))
        except QuotaConfigError as exc:
            problem = str(exc)
        except (ValueError, UnicodeDecodeError) as exc:
            problem = (f"quota for {entity.describe()}: node data {data[:200]!r} is not Kafka's config "
                       f"JSON ({exc})")
        kept = last.get(entity)
        log.error("ZooKeeper %s: %s/%s: %s; %s", self._where, self._root, relative, problem,
                  f"keeping its last good quotas {_show(kept)}" if kept else "it has no last good quotas")
        return None


def altered_config(data: bytes | None, ops: Mapping[ConfigKey, float | None], path: str,
                   where: str) -> dict[str, object]:
    """The config an entity node holds after `ops` (None removes a key), keeping its other keys (SCRAM
    credentials). Data that is not Kafka's config JSON is overwritten, with a warning."""
    try:
        config = decode_config(data)
    except ValueError as exc:
        log.warning("ZooKeeper %s: %s holds invalid data (%s); overwriting it", where, path, exc)
        config = {}
    for quota_type, value in ops.items():
        if value is None:
            config.pop(quota_type.value, None)
        else:
            config[quota_type.value] = format_value(quota_type, value)
    return config


def _show(values: Mapping[ConfigKey, float] | None) -> str:
    """Quotas as one log fragment: {producer_byte_rate=1e+06, ...}."""
    return "{" + ", ".join(f"{t.value}={v:g}" for t, v in (values or {}).items()) + "}"
