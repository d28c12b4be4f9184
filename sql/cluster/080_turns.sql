-- Cluster variant of sql/080_turns.sql: turns sharded by session_id (ReplicatedMergeTree `turns_local`
-- + a Distributed `turns`), and turn_stats kept per shard by a materialized view on turns_local (a
-- session's turns and its states live on one shard), read through a Distributed `turn_stats`.
-- Apply after 001: clickhouse-client --multiquery < sql/cluster/080_turns.sql

CREATE TABLE IF NOT EXISTS turns_local ON CLUSTER '{cluster}'
(
    worker_id       LowCardinality(String),
    session_id      String,
    release         LowCardinality(String),
    gpu_kind        LowCardinality(String),
    ts              DateTime64(3, 'UTC') CODEC(DoubleDelta, ZSTD(1)),
    simulated       Bool,
    turn            UInt32,
    step            UInt32,
    speaking        Bool,
    cond_tokens     UInt32,
    policy          LowCardinality(String),
    queue_depth     UInt16,
    dropped_chunks  UInt32,
    superseded      UInt32,
    wait_ms         Float32 CODEC(Gorilla, ZSTD(1)),
    recompute_ms    Float32 CODEC(Gorilla, ZSTD(1)),
    generation_ms   Float32 CODEC(Gorilla, ZSTD(1)),
    queue_ms        Float32 CODEC(Gorilla, ZSTD(1)),
    latency_ms      Float32 CODEC(Gorilla, ZSTD(1)),
    stall_ms        Float32 CODEC(Gorilla, ZSTD(1)),
    generated_at    DateTime64(3, 'UTC') CODEC(DoubleDelta, ZSTD(1)),
    played_at       DateTime64(3, 'UTC') CODEC(DoubleDelta, ZSTD(1))
)
ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
PARTITION BY toDate(ts)
ORDER BY (release, gpu_kind, session_id, ts)
TTL toDateTime(ts) + INTERVAL 180 DAY
SETTINGS replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS turns ON CLUSTER '{cluster}' AS turns_local
ENGINE = Distributed('{cluster}', currentDatabase(), turns_local, cityHash64(session_id));

CREATE TABLE IF NOT EXISTS turn_stats_local ON CLUSTER '{cluster}'
(
    release         LowCardinality(String),
    gpu_kind        LowCardinality(String),
    worker_id       LowCardinality(String),
    session_id      String,
    simulated       SimpleAggregateFunction(max, Bool),
    first_ts        SimpleAggregateFunction(min, DateTime64(3, 'UTC')),
    policy          SimpleAggregateFunction(anyLast, String),
    turns           AggregateFunction(count),
    stalled_turns   AggregateFunction(countIf, UInt8),
    dropped_chunks  AggregateFunction(sum, UInt64),
    latency_q       AggregateFunction(quantilesTDigest(0.5, 0.95, 0.99), Float32),
    wait_q          AggregateFunction(quantilesTDigest(0.5, 0.95, 0.99), Float32),
    recompute_q     AggregateFunction(quantilesTDigest(0.5, 0.95, 0.99), Float32),
    generation_q    AggregateFunction(quantilesTDigest(0.5, 0.95, 0.99), Float32),
    queue_q         AggregateFunction(quantilesTDigest(0.5, 0.95, 0.99), Float32)
)
ENGINE = ReplicatedAggregatingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
PARTITION BY toYYYYMM(first_ts)
ORDER BY (release, gpu_kind, worker_id, session_id)
SETTINGS replicated_deduplication_window = 10000;

CREATE MATERIALIZED VIEW IF NOT EXISTS turn_stats_mv ON CLUSTER '{cluster}' TO turn_stats_local AS
SELECT
    release,
    gpu_kind,
    worker_id,
    session_id,
    max(simulated)                                          AS simulated,
    min(ts)                                                 AS first_ts,
    anyLast(toString(policy))                               AS policy,
    countState()                                            AS turns,
    countIfState(toUInt8(stall_ms > 0))                     AS stalled_turns,
    sumState(toUInt64(dropped_chunks))                      AS dropped_chunks,
    quantilesTDigestState(0.5, 0.95, 0.99)(latency_ms)      AS latency_q,
    quantilesTDigestState(0.5, 0.95, 0.99)(wait_ms)         AS wait_q,
    quantilesTDigestState(0.5, 0.95, 0.99)(recompute_ms)    AS recompute_q,
    quantilesTDigestState(0.5, 0.95, 0.99)(generation_ms)   AS generation_q,
    quantilesTDigestState(0.5, 0.95, 0.99)(queue_ms)        AS queue_q
FROM turns_local
GROUP BY release, gpu_kind, worker_id, session_id;

CREATE TABLE IF NOT EXISTS turn_stats ON CLUSTER '{cluster}' AS turn_stats_local
ENGINE = Distributed('{cluster}', currentDatabase(), turn_stats_local, cityHash64(session_id));
