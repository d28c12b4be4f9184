-- FP8 saturation telemetry (StepRecord.fp8_saturated): the fraction of a sampled step's FP8 activation
-- elements at the FP8 maximum (+-448: clipped, or rounded up from |x/scale| >= 432) when linears
-- quantize with static scales; null on steps not sampled, with static_scales off, and in every row
-- stored before this migration (older workers).
-- session_stats keeps per session, so fleet-wide figures never scan raw steps (analytics/saturation.py):
--   fp8_sat_max      max fraction over the session's sampled steps (NULL: none sampled)
--   fp8_sat_avg      mean fraction over them (NULL: none sampled)
--   fp8_sampled      sampled steps (fp8_saturated IS NOT NULL)
--   fp8_sat_steps    sampled steps with any element saturated (fp8_saturated > 0)
--   fp8_static_steps sampled steps whose switch state had static_scales on
--                    (our worker probes only with static scales, so for its rows this equals
--                    fp8_sampled; it guards against other senders and future probes: a dynamic-scale
--                    probe reads ~1/K of a K-wide input at +-448 on every row, which must not be
--                    blamed on static_scales; analytics/saturation.py attribution)
-- Rows stored before this migration read the columns' defaults (NULL, empty states: 0 sampled).
-- The view is altered in place (MODIFY QUERY), as in 021; every statement is idempotent.
-- Its cluster form is generated (collector/migrations.py).

ALTER TABLE steps ADD COLUMN IF NOT EXISTS fp8_saturated Nullable(Float32) CODEC(ZSTD(1));

ALTER TABLE session_stats ADD COLUMN IF NOT EXISTS fp8_sat_max SimpleAggregateFunction(max, Nullable(Float32));

ALTER TABLE session_stats ADD COLUMN IF NOT EXISTS fp8_sat_avg AggregateFunction(avg, Nullable(Float32));

ALTER TABLE session_stats ADD COLUMN IF NOT EXISTS fp8_sampled AggregateFunction(countIf, UInt8);

ALTER TABLE session_stats ADD COLUMN IF NOT EXISTS fp8_sat_steps AggregateFunction(countIf, UInt8);

ALTER TABLE session_stats ADD COLUMN IF NOT EXISTS fp8_static_steps AggregateFunction(countIf, UInt8);

ALTER TABLE session_stats_mv MODIFY QUERY
{{session_stats_view}};
