-- Cluster variant of sql/021_session_switch_state.sql: session_stats keeps its switch state as
-- argMax(switches, ts) (switch_last, a SimpleAggregateFunction(max, Tuple(ts, switches))); old rows
-- read their DEFAULT (last_ts, switches). The column goes on every shard's session_stats_local and on
-- the Distributed session_stats over them; each shard's view is altered in place (MODIFY QUERY).
-- Apply after 002: clickhouse-client --multiquery < sql/cluster/021_session_switch_state.sql

ALTER TABLE session_stats_local ON CLUSTER '{cluster}'
    ADD COLUMN IF NOT EXISTS switch_last SimpleAggregateFunction(max, Tuple(DateTime64(3, 'UTC'), String))
    DEFAULT (last_ts, switches);

ALTER TABLE session_stats ON CLUSTER '{cluster}'
    ADD COLUMN IF NOT EXISTS switch_last SimpleAggregateFunction(max, Tuple(DateTime64(3, 'UTC'), String))
    DEFAULT (last_ts, switches);

ALTER TABLE session_stats_mv ON CLUSTER '{cluster}' MODIFY QUERY
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
    anyLast(toString(switches))                              AS switches,
    max((ts, toString(steps_local.switches)))                AS switch_last
FROM steps_local
GROUP BY release, gpu_kind, worker_id, session_id;
