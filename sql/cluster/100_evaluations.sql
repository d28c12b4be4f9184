-- Cluster variant of sql/100_evaluations.sql: the same columns as a ReplicatedMergeTree
-- evaluations_local on every shard plus a Distributed evaluations over them, sharded by session_id
-- (one evaluation run's rows on one shard), as the other telemetry tables (001).
-- Apply after 040: clickhouse-client --multiquery < sql/cluster/100_evaluations.sql

CREATE TABLE IF NOT EXISTS evaluations_local ON CLUSTER '{cluster}'
(
    worker_id     LowCardinality(String),
    session_id    String,
    release       LowCardinality(String),
    gpu_kind      LowCardinality(String),
    ts            DateTime64(3, 'UTC') CODEC(DoubleDelta, ZSTD(1)),
    simulated     Bool,
    configuration LowCardinality(String),
    switch        LowCardinality(String),
    preset        LowCardinality(String),
    metric        LowCardinality(String),
    value         Float64,
    band_lo       Nullable(Float64),
    band_hi       Nullable(Float64),
    verdict       LowCardinality(String),
    n             UInt32,
    step          Nullable(UInt32)
)
ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
PARTITION BY toYYYYMM(ts)
ORDER BY (switch, gpu_kind, release, metric, ts)
TTL toDateTime(ts) + INTERVAL 730 DAY
SETTINGS replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS evaluations ON CLUSTER '{cluster}' AS evaluations_local
ENGINE = Distributed('{cluster}', currentDatabase(), evaluations_local, cityHash64(session_id));
