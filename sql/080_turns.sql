-- Conversational turns (worker/turns.py, the `turn` record): one row per turn, stamped with its
-- arrival (ts), and per-session aggregate states kept by a materialized view, so fleet figures and
-- the turn-latency detector (analytics/turns.py) read one row per session.
-- A turn's latency (arrival -> playback of the first chunk that uses it, as the worker's player sees
-- it) is the sum of its parts: wait (for the step in progress), recompute (the cross-attention K/V),
-- generation (the first chunk's step) and queue (the rest: chunks played before it, a held producer).
-- turn_stats: read with -Merge, e.g.
--   SELECT release, gpu_kind, quantilesTDigestMerge(0.5, 0.95, 0.99)(latency_q) FROM turn_stats
--   GROUP BY release, gpu_kind
-- Its cluster form is generated (collector/migrations.py).

CREATE TABLE IF NOT EXISTS turns
(
    {{record_columns}},
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
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (release, gpu_kind, session_id, ts)
TTL toDateTime(ts) + INTERVAL 180 DAY
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS turn_stats
(
    {{session_table_columns}},
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
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(first_ts)
ORDER BY (release, gpu_kind, worker_id, session_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE MATERIALIZED VIEW IF NOT EXISTS turn_stats_mv TO turn_stats AS
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
FROM turns
GROUP BY release, gpu_kind, worker_id, session_id;
