-- Cluster variant of sql/011_job_runs.sql: a small control-plane table (one row per job attempt),
-- replicated to every node (no {shard} in the keeper path: every server of the cluster is a replica
-- of the one table, so there is no Distributed table and no shard key). The scheduler writes it on
-- one node; the dashboards read it on any. Read-after-write on another node: insert with
-- insert_quorum = 'auto' (a majority of the replicas) and read with select_sequential_consistency = 1.
-- '{replica}' must be unique across the cluster (e.g. the host name), not only within a shard.
-- Apply after 010: clickhouse-client --multiquery < sql/cluster/011_job_runs.sql

CREATE TABLE IF NOT EXISTS job_runs ON CLUSTER '{cluster}'
(
    job           LowCardinality(String),
    started_at    DateTime64(3, 'UTC'),
    finished_at   DateTime64(3, 'UTC'),
    status        LowCardinality(String),   -- ok | failed
    attempt       UInt8,
    trigger       LowCardinality(String),   -- schedule | retry | demand | release
    window_start  Nullable(DateTime64(3, 'UTC')),
    window_end    Nullable(DateTime64(3, 'UTC')),
    findings      UInt32,
    error         String CODEC(ZSTD(3))
)
ENGINE = ReplicatedMergeTree('/clickhouse/tables/all/{database}/{table}', '{replica}')
ORDER BY (job, started_at)
TTL toDateTime(started_at) + INTERVAL 180 DAY;
