-- session_stats.switches is anyLast per merge: a block replayed late (or merged out of time order)
-- can leave an older switch state in the merged row. switch_last keeps (ts of the session's latest
-- step, its switch state) as a SimpleAggregateFunction(max, Tuple(ts, switches)), i.e. argMax(switches, ts)
-- that merges correctly in any order (ties broken by the state string, so deterministically).
-- Read it as tupleElement(max(switch_last), 2) grouped by session (analytics.queries).
-- Rows stored before this migration keep their data: the column's DEFAULT (last_ts, switches) is
-- what readers used for them before (argMax(switches, last_ts) over partial rows), computed on read
-- and written by the next merge. The view is altered in place (MODIFY QUERY: no window where steps
-- inserts miss it); both statements are idempotent. switches stays as it was (the DEFAULT of old rows).
-- Cluster counterpart: sql/cluster/021_session_switch_state.sql.

ALTER TABLE session_stats
    ADD COLUMN IF NOT EXISTS switch_last SimpleAggregateFunction(max, Tuple(DateTime64(3, 'UTC'), String))
    DEFAULT (last_ts, switches);

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
    max((ts, toString(steps.switches)))                      AS switch_last
FROM steps
GROUP BY release, gpu_kind, worker_id, session_id;
