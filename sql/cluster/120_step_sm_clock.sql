-- Cluster variant of sql/120_step_sm_clock.sql: steps gets the nullable sm_clock_mhz column and
-- session_stats its per-session mean sm_clock_avg, each on every shard's <name>_local and on the
-- Distributed <name> over them; each shard's view is altered in place (MODIFY QUERY). Rows stored before
-- read NULL. The Distributed steps stores nothing: its column has no CODEC (the shards' steps_local's has).
-- Apply after 110: clickhouse-client --multiquery < sql/cluster/120_step_sm_clock.sql

ALTER TABLE steps_local ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS sm_clock_mhz Nullable(Float32) CODEC(ZSTD(1));

ALTER TABLE steps ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS sm_clock_mhz Nullable(Float32);

ALTER TABLE session_stats_local ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS sm_clock_avg AggregateFunction(avg, Nullable(Float32));

ALTER TABLE session_stats ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS sm_clock_avg AggregateFunction(avg, Nullable(Float32));

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
    max((ts, toString(steps_local.switches)))                AS switch_last,
    max(fp8_saturated)                                       AS fp8_sat_max,
    avgState(fp8_saturated)                                  AS fp8_sat_avg,
    countIfState(toUInt8(fp8_saturated IS NOT NULL))         AS fp8_sampled,
    countIfState(toUInt8(ifNull(fp8_saturated > 0, 0)))      AS fp8_sat_steps,
    countIfState(toUInt8(fp8_saturated IS NOT NULL
        AND has(splitByChar(',', toString(steps_local.switches)), 'static_scales')))  AS fp8_static_steps,
    avgState(sm_clock_mhz)                                   AS sm_clock_avg
FROM steps_local
GROUP BY release, gpu_kind, worker_id, session_id;
