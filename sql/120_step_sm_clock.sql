-- The step's SM clock (StepRecord.sm_clock_mhz): the mean SM clock of the session's GPUs over the step,
-- from the worker's NVML sampler (host-side; null without NVML, and in every row stored before this
-- migration). session_stats keeps its mean per session:
--   sm_clock_avg   mean over the session's steps that carry one (NULL: none)
-- so a power-capped or thermally throttled session shows in its per-session figures (collector/catalog.py's
-- SESSION_COLUMNS read it as sm_clock_mhz), the view is altered in place (MODIFY QUERY) as in 021 and 022.
-- A cluster applies its generated cluster form (collector/cluster_ddl.py).

ALTER TABLE steps ADD COLUMN IF NOT EXISTS sm_clock_mhz Nullable(Float32) CODEC(ZSTD(1));

ALTER TABLE session_stats ADD COLUMN IF NOT EXISTS sm_clock_avg AggregateFunction(avg, Nullable(Float32));

ALTER TABLE session_stats_mv MODIFY QUERY
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
    max((ts, toString(steps.switches)))                      AS switch_last,
    max(fp8_saturated)                                       AS fp8_sat_max,
    avgState(fp8_saturated)                                  AS fp8_sat_avg,
    countIfState(toUInt8(fp8_saturated IS NOT NULL))         AS fp8_sampled,
    countIfState(toUInt8(ifNull(fp8_saturated > 0, 0)))      AS fp8_sat_steps,
    countIfState(toUInt8(fp8_saturated IS NOT NULL
        AND has(splitByChar(',', toString(steps.switches)), 'static_scales')))  AS fp8_static_steps,
    avgState(sm_clock_mhz)                                   AS sm_clock_avg
FROM steps
GROUP BY release, gpu_kind, worker_id, session_id;
