-- The step's SM clock (StepRecord.sm_clock_mhz): the mean SM clock of the session's GPUs over the step,
-- from the worker's NVML sampler (host-side; null without NVML, and in every row stored before this
-- migration). session_stats keeps its mean per session:
--   sm_clock_avg   mean over the session's steps that carry one (NULL: none)
-- so a power-capped or thermally throttled session shows in its per-session figures (collector/catalog.py's
-- SESSION_COLUMNS read it as sm_clock_mhz), the view is altered in place (MODIFY QUERY) as in 021 and 022.
-- A cluster applies its generated cluster form (collector/migrations.py).

ALTER TABLE steps ADD COLUMN IF NOT EXISTS sm_clock_mhz Nullable(Float32) CODEC(ZSTD(1));

ALTER TABLE session_stats ADD COLUMN IF NOT EXISTS sm_clock_avg AggregateFunction(avg, Nullable(Float32));

ALTER TABLE session_stats_mv MODIFY QUERY
{{session_stats_view}};
