"""What the store can keep: each raw table's retention (its TTL), its partition key, and the most
partitions one insert may span; and the split of a block that respects that bound.

    limits = read_limits(store)                 # from system.tables / system.settings, once
    limits.retention["step"]                    # timedelta(days=180): older rows are refused at ingest
    for part in split_by_partitions(limits, "step", table): store.insert_arrow(...)

The store is the one declaration (sql/'s TTL and PARTITION BY, the server's
``max_partitions_per_insert_block``); ``DEFAULT`` reads the same from sql/'s files for a store that
cannot be asked yet (unreachable at start); tests/collector/test_limits.py checks the two agree.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from datetime import timedelta

import pyarrow as pa
import pyarrow.compute as pc

from collector.migrations import created_tables, table_engines
from collector.records import TABLES

log = logging.getLogger("livestep.collector.limits")

# partition keys the writer can compute on an Arrow ``ts`` column (a key it does not know: split by day,
# which is at least as fine as any of these)
_KEYS = {"toDate(ts)": "day", "toYYYYMMDD(ts)": "day", "toYYYYMM(ts)": "month", "toStartOfMonth(ts)": "month"}
_Y2000_MS = 946_684_800_000
INGEST_MARGIN = timedelta(days=1)  # refused this long before the TTL would drop it: never acked, then dropped
_TTL = re.compile(r"\bTTL toDateTime\(ts\) \+ toIntervalDay\((\d+)\)")


@dataclass(frozen=True)
class Limits:
    retention: dict[str, timedelta]  # kind -> rows older than this are dropped by the table's TTL (absent: none)
    partition: dict[str, str] = field(default_factory=dict)  # kind -> "day" | "month"
    max_partitions_per_insert: int = 100  # 0: no bound

    def oldest_ms(self, kind: str, now_ms: int) -> int:
        """The oldest ``ts`` (ms since the epoch) ingest accepts for ``kind`` at ``now_ms``: the table's
        retention less ``INGEST_MARGIN`` (a row acked is readable for at least that long), and never
        before 2000-01-01."""
        keep = self.retention.get(kind)
        if keep is None:
            return _Y2000_MS
        return max(_Y2000_MS, now_ms - int((keep - INGEST_MARGIN).total_seconds() * 1000))

    def window_text(self, kind: str) -> str:
        keep = self.retention.get(kind)
        if keep is None:
            return f"the {TABLES[kind]} table has no TTL; rows from 2000-01-01"
        return (f"the {TABLES[kind]} table keeps {keep.days} days (its TTL), so ingest takes rows up to "
                f"{(keep - INGEST_MARGIN).days} days old")


def _from_sql() -> Limits:
    """The limits as sql/'s ``CREATE TABLE`` statements declare them (a store not asked yet)."""
    retention: dict[str, timedelta] = {}
    partition: dict[str, str] = {}
    created = created_tables()
    for kind, table in TABLES.items():
        if table not in created:
            continue
        key = re.search(r"PARTITION BY (\S+)", created[table])
        partition[kind] = _KEYS.get(key.group(1), "day") if key else "day"
        ttl = re.search(r"TTL toDateTime\(ts\) \+ INTERVAL (\d+) DAY", created[table])
        if ttl:
            retention[kind] = timedelta(days=int(ttl.group(1)))
    return Limits(retention, partition)


def read_limits(store, strict: bool = False) -> Limits:
    """The limits as the store declares them; ``DEFAULT``'s value for anything it does not say (and for
    everything when the store cannot be asked, unless ``strict``: then the error is raised)."""
    try:
        rows = table_engines(store, list(TABLES.values()))
        setting = store.setting("max_partitions_per_insert_block")
    except Exception as e:
        if strict:
            raise
        log.warning("store limits not read (%s: %s); using sql/'s", type(e).__name__, str(e)[:200])
        return DEFAULT
    kind_of = {t: k for k, t in TABLES.items()}
    retention, partition = dict(DEFAULT.retention), dict(DEFAULT.partition)
    for name, key, engine in rows:
        kind = kind_of[name]
        ttl = _TTL.search(engine)
        if ttl:
            retention[kind] = timedelta(days=int(ttl.group(1)))
        partition[kind] = _KEYS.get(key.replace(" ", ""), "day")
    bound = int(setting) if setting and setting.isdigit() else DEFAULT.max_partitions_per_insert
    return Limits(retention, partition, bound)


DEFAULT = _from_sql()


def _partition_of(unit: str, ts: pa.ChunkedArray | pa.Array) -> pa.Array:
    ms = pc.cast(pc.cast(ts, pa.timestamp("ms", "UTC"), safe=False), pa.int64())
    days = pc.floor(pc.divide(pc.cast(ms, pa.float64()), 86_400_000.0))
    if unit == "day":
        return pc.cast(days, pa.int64())
    t = pc.cast(ts, pa.timestamp("ms", "UTC"), safe=False)
    return pc.add(pc.multiply(pc.cast(pc.year(t), pa.int64()), 12), pc.cast(pc.month(t), pa.int64()))


def split_by_partitions(limits: Limits, kind: str, table: pa.Table) -> list[pa.Table]:
    """``table`` as inserts of at most ``max_partitions_per_insert`` partitions each (one, untouched,
    when it spans no more). Deterministic: the same rows give the same parts (a replay's dedup
    tokens match), each a whole set of partitions, in partition order."""
    bound = limits.max_partitions_per_insert
    if bound <= 0 or table.num_rows <= bound:  # fewer rows than the bound: fewer partitions too
        return [table]
    part = _partition_of(limits.partition.get(kind, "day"), table.column("ts"))
    distinct = pc.unique(part)
    if len(distinct) <= bound:
        return [table]
    keys = pc.sort_indices(distinct)
    ordered = pc.take(distinct, keys)
    out = []
    for i in range(0, len(ordered), bound):
        chosen = ordered.slice(i, bound)
        out.append(table.filter(pc.is_in(part, value_set=chosen)))
    return out
