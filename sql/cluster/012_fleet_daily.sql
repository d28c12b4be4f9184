-- Cluster variant of sql/012_fleet_daily.sql: the fleet roll-up (a few hundred rows a day) and its
-- marks, replicated to every node (no {shard} in the keeper path, no Distributed table): readers
-- take each day's rows by its latest mark with FINAL, which is only right when every key of a table
-- lives in one replica set. analytics.queries.rollup() fills fleet_daily with INSERT ... SELECT from
-- the Distributed session_fleet (sql/cluster/013) and then writes the day's mark; to read both
-- consistently on another node, insert with insert_quorum = 'auto' and read with
-- select_sequential_consistency = 1. '{replica}' must be unique across the cluster.
-- Apply after 011: clickhouse-client --multiquery < sql/cluster/012_fleet_daily.sql

CREATE TABLE IF NOT EXISTS fleet_daily ON CLUSTER '{cluster}'
(
    day          Date,
    release      LowCardinality(String),
    gpu_kind     LowCardinality(String),
    sessions     UInt64,                 -- sessions that streamed >= 1 s
    n_le_24      UInt64,
    n_le_23_5    UInt64,
    fps_sum      Float64,
    late_chunks  UInt64,
    chunks       UInt64,
    energy_sum   Float64,
    fps_q        AggregateFunction(quantilesTDigest(0.05, 0.5, 0.95), Float64),
    period_q     AggregateFunction(quantilesTDigest(0.5, 0.95, 0.99), Float64),
    rolled_at    DateTime64(3, 'UTC')
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/all/{database}/{table}', '{replica}', rolled_at)
ORDER BY (day, release, gpu_kind);

CREATE TABLE IF NOT EXISTS fleet_daily_marks ON CLUSTER '{cluster}'
(
    day          Date,
    steps_total  UInt64,
    rolled_at    DateTime64(3, 'UTC')
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/all/{database}/{table}', '{replica}', rolled_at)
ORDER BY day;
