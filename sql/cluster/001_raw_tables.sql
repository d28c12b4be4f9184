-- Cluster variant of sql/001_raw_tables.sql: the same columns, codecs, partitions and TTLs, as
-- ReplicatedMergeTree tables `<name>_local` on every shard plus a Distributed table `<name>` over them,
-- so every query written for the embedded store runs unchanged against the cluster.
-- Apply once per cluster: clickhouse-client --multiquery < sql/cluster/001_raw_tables.sql
-- (macros {cluster}, {shard}, {replica} come from each server's config). Rows are sharded by
-- session_id, so one session's steps and its session_stats states live on one shard. Replicated
-- tables deduplicate retried blocks by insert_deduplication_token (replicated_deduplication_window);
-- the collector inserts with insert_distributed_sync = 1 so an insert returns once it is stored.

CREATE TABLE IF NOT EXISTS steps_local ON CLUSTER '{cluster}'
(
    worker_id           LowCardinality(String),
    session_id          String,
    release             LowCardinality(String),
    gpu_kind            LowCardinality(String),
    ts                  DateTime64(3, 'UTC') CODEC(DoubleDelta, ZSTD(1)),
    simulated           Bool,
    step                UInt32 CODEC(Delta, ZSTD(1)),
    diffusion_ms        Float32 CODEC(Gorilla, ZSTD(1)),
    step_period_ms      Float32 CODEC(Gorilla, ZSTD(1)),
    decode_ms           Nullable(Float32) CODEC(ZSTD(1)),
    cache_upkeep_ms     Nullable(Float32) CODEC(ZSTD(1)),
    attention_ms        Nullable(Float32) CODEC(ZSTD(1)),
    allreduce_ms        Nullable(Float32) CODEC(ZSTD(1)),
    late                Bool,
    playout_depth       UInt16,
    reset_step          Bool,
    energy_mj           Nullable(Float64) CODEC(ZSTD(1)),
    mem_allocated_bytes UInt64 CODEC(Delta, ZSTD(1)),
    mem_reserved_bytes  UInt64 CODEC(Delta, ZSTD(1)),
    buffers_registered  UInt32 CODEC(Delta, ZSTD(1)),
    switches            LowCardinality(String)
)
ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
PARTITION BY toDate(ts)
ORDER BY (release, worker_id, session_id, ts)
TTL toDateTime(ts) + INTERVAL 180 DAY
SETTINGS replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS steps ON CLUSTER '{cluster}' AS steps_local
ENGINE = Distributed('{cluster}', currentDatabase(), steps_local, cityHash64(session_id));

CREATE TABLE IF NOT EXISTS gpu_samples_local ON CLUSTER '{cluster}'
(
    worker_id        LowCardinality(String),
    session_id       String,
    release          LowCardinality(String),
    gpu_kind         LowCardinality(String),
    ts               DateTime64(3, 'UTC') CODEC(DoubleDelta, ZSTD(1)),
    simulated        Bool,
    gpu_index        UInt16,
    power_w          Nullable(Float32) CODEC(ZSTD(1)),
    energy_mj        Nullable(Float64) CODEC(ZSTD(1)),
    sm_clock_mhz     Nullable(UInt32) CODEC(ZSTD(1)),
    mem_used_bytes   Nullable(UInt64) CODEC(ZSTD(1)),
    temp_c           Nullable(Float32) CODEC(ZSTD(1)),
    throttle_reasons Nullable(UInt64) CODEC(ZSTD(1))
)
ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
PARTITION BY toDate(ts)
ORDER BY (worker_id, gpu_index, ts)
TTL toDateTime(ts) + INTERVAL 30 DAY
SETTINGS replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS gpu_samples ON CLUSTER '{cluster}' AS gpu_samples_local
ENGINE = Distributed('{cluster}', currentDatabase(), gpu_samples_local, cityHash64(session_id));

CREATE TABLE IF NOT EXISTS sessions_local ON CLUSTER '{cluster}'
(
    worker_id            LowCardinality(String),
    session_id           String,
    release              LowCardinality(String),
    gpu_kind             LowCardinality(String),
    ts                   DateTime64(3, 'UTC') CODEC(DoubleDelta, ZSTD(1)),
    simulated            Bool,
    phase                LowCardinality(String),
    first_forward_tokens UInt32,
    streamed_s           Float64,
    frames               UInt64,
    avg_fps              Nullable(Float64),
    late_chunks          UInt64,
    stall_ms             Float64,
    tp_size              UInt16,
    shape                LowCardinality(String),
    switches             LowCardinality(String)
)
ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
PARTITION BY toYYYYMM(ts)
ORDER BY (release, worker_id, session_id, phase)
TTL toDateTime(ts) + INTERVAL 400 DAY
SETTINGS replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS sessions ON CLUSTER '{cluster}' AS sessions_local
ENGINE = Distributed('{cluster}', currentDatabase(), sessions_local, cityHash64(session_id));

CREATE TABLE IF NOT EXISTS events_local ON CLUSTER '{cluster}'
(
    worker_id  LowCardinality(String),
    session_id String,
    release    LowCardinality(String),
    gpu_kind   LowCardinality(String),
    ts         DateTime64(3, 'UTC') CODEC(DoubleDelta, ZSTD(1)),
    simulated  Bool,
    kind       LowCardinality(String),
    detail     String CODEC(ZSTD(3))
)
ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
PARTITION BY toYYYYMM(ts)
ORDER BY (kind, ts, worker_id)
TTL toDateTime(ts) + INTERVAL 400 DAY
SETTINGS replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS events ON CLUSTER '{cluster}' AS events_local
ENGINE = Distributed('{cluster}', currentDatabase(), events_local, cityHash64(session_id));
