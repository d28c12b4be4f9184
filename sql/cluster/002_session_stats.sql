-- Cluster variant of sql/002_session_stats.sql: per-session aggregate states kept by a materialized
-- view on each shard's steps_local (sharded by session_id, so a session's states stay on one shard),
-- and a Distributed session_stats over them; read it with the same -Merge queries as the embedded store.
-- Apply after 001: clickhouse-client --multiquery < sql/cluster/002_session_stats.sql

CREATE TABLE IF NOT EXISTS session_stats_local ON CLUSTER '{cluster}'
(
    release            LowCardinality(String),
    gpu_kind           LowCardinality(String),
    worker_id          LowCardinality(String),
    session_id         String,
    simulated          SimpleAggregateFunction(max, Bool),
    first_ts           SimpleAggregateFunction(min, DateTime64(3, 'UTC')),
    last_ts            SimpleAggregateFunction(max, DateTime64(3, 'UTC')),
    steps              AggregateFunction(count),
    late_chunks        AggregateFunction(countIf, UInt8),
    reset_steps        AggregateFunction(countIf, UInt8),
    period_ms_sum      AggregateFunction(sum, Float64),
    diffusion_ms_q     AggregateFunction(quantilesTDigest(0.5, 0.95, 0.99), Float32),
    period_ms_q        AggregateFunction(quantilesTDigest(0.5, 0.95, 0.99), Float32),
    diffusion_ms_avg   AggregateFunction(avg, Float32),
    upkeep_ms_avg      AggregateFunction(avg, Nullable(Float32)),
    attention_ms_avg   AggregateFunction(avg, Nullable(Float32)),
    energy_mj_sum      AggregateFunction(sum, Nullable(Float64)),
    mem_reserved_max   SimpleAggregateFunction(max, UInt64),
    buffers_max        SimpleAggregateFunction(max, UInt32),
    switches           SimpleAggregateFunction(anyLast, String)
)
ENGINE = ReplicatedAggregatingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
PARTITION BY toYYYYMM(first_ts)
ORDER BY (release, gpu_kind, worker_id, session_id)
SETTINGS replicated_deduplication_window = 10000;

CREATE MATERIALIZED VIEW IF NOT EXISTS session_stats_mv ON CLUSTER '{cluster}' TO session_stats_local AS
SELECT
    release,
    gpu_kind,
    worker_id,
    session_id,
    max(simulated)                                           AS simulated,
    min(ts)                                                  AS first_ts,
    max(ts)                                                  AS last_ts,
    countState()                                             AS steps,
    countIfState(toUInt8(late))                              AS late_chunks,
    countIfState(toUInt8(reset_step))                        AS reset_steps,
    sumState(toFloat64(step_period_ms))                      AS period_ms_sum,
    quantilesTDigestState(0.5, 0.95, 0.99)(diffusion_ms)     AS diffusion_ms_q,
    quantilesTDigestState(0.5, 0.95, 0.99)(step_period_ms)   AS period_ms_q,
    avgState(diffusion_ms)                                   AS diffusion_ms_avg,
    avgState(cache_upkeep_ms)                                AS upkeep_ms_avg,
    avgState(attention_ms)                                   AS attention_ms_avg,
    sumState(energy_mj)                                      AS energy_mj_sum,
    max(mem_reserved_bytes)                                  AS mem_reserved_max,
    max(buffers_registered)                                  AS buffers_max,
    anyLast(toString(switches))                              AS switches
FROM steps_local
GROUP BY release, gpu_kind, worker_id, session_id;

CREATE TABLE IF NOT EXISTS session_stats ON CLUSTER '{cluster}' AS session_stats_local
ENGINE = Distributed('{cluster}', currentDatabase(), session_stats_local, cityHash64(session_id));
