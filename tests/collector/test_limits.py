"""collector/limits.py: the store's retention and partitions as the store declares them, and the split."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pyarrow.compute as pc

from collector import records
from collector.limits import DEFAULT, Limits, read_limits, split_by_partitions
from tests.collector.helpers import step_rows


def test_the_defaults_are_what_the_migrated_store_declares(store):
    assert read_limits(store) == DEFAULT  # sql/001_raw_tables.sql's TTL and PARTITION BY, ClickHouse's 100


def test_split_keeps_whole_partitions_at_most_the_bound_per_part_and_is_deterministic():
    now = datetime(2026, 11, 30, 12, tzinfo=UTC)
    rows = [r | {"ts": now - timedelta(days=i % 7, hours=i)} for i, r in enumerate(step_rows(70))]
    table = records.to_arrow("step", rows)
    limits = Limits(DEFAULT.retention, DEFAULT.partition, max_partitions_per_insert=3)
    parts = split_by_partitions(limits, "step", table)
    days = [set(pc.cast(p.column("ts"), "date32").to_pylist()) for p in parts]
    assert all(len(d) <= 3 for d in days) and sum(p.num_rows for p in parts) == 70
    assert all(a.isdisjoint(b) for i, a in enumerate(days) for b in days[i + 1:])  # a day in one part only
    assert [p.equals(q) for p, q in zip(parts, split_by_partitions(limits, "step", table), strict=True)] == [True] * len(parts)
    assert split_by_partitions(Limits(DEFAULT.retention, DEFAULT.partition, 100), "step", table) == [table]
    months = split_by_partitions(limits, "session", table)  # monthly partitions: 8 days span <= 2 months
    assert months == [table]
