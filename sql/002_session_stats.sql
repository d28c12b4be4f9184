-- Per-session aggregates kept by a materialized view over raw steps (AggregatingMergeTree states),
-- so fleet-wide queries read one row per session and never scan raw steps.
-- A session's frames = 4 per step; streamed time = sum of step periods; fps = frames / streamed s.
-- Read with the -Merge combinators, e.g.
--   SELECT session_id, countMerge(steps) * 4 / (sumMerge(period_ms_sum) / 1000) AS fps
--   FROM session_stats GROUP BY release, gpu_kind, worker_id, session_id
-- The view's SELECT, {{session_stats_view}}, is written by collector/migrations.py from collector/catalog.py's
-- SESSION_STATES (the states up to this file: a later migration that adds one applies the view again);
-- {{session_table_columns}}: the key and the states every per-session table starts with.

CREATE TABLE IF NOT EXISTS session_stats
(
    {{session_table_columns}},
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
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(first_ts)
ORDER BY (release, gpu_kind, worker_id, session_id)
SETTINGS non_replicated_deduplication_window = 10000;

CREATE MATERIALIZED VIEW IF NOT EXISTS session_stats_mv TO session_stats AS
{{session_stats_view}};
