-- Fleet roll-up per day, release and GPU kind of *finalized* sessions (from the session_fleet view), so the
-- dashboard's fleet queries read a few hundred rows instead of grouping a million sessions.
-- A session's fps needs its total over all its step blocks, so this cannot be an insert-time MV:
-- analytics.queries.rollup() recomputes closed days (INSERT ... SELECT) and re-rolls a day when its
-- step count in session_fleet (steps_total) changed; days not rolled yet are computed live.
-- A roll writes every key of a day with one rolled_at and then its mark; readers take the rows whose
-- (day, rolled_at) is the day's latest mark, so keys a re-roll no longer has drop out at once.

CREATE TABLE IF NOT EXISTS fleet_daily
(
    day          Date,
    release      LowCardinality(String),
    gpu_kind     LowCardinality(String),
    sessions     UInt64,                 -- sessions that streamed >= 1 s
    n_le_24      UInt64,
    n_le_23_5    UInt64,
    fps_sum      Float64,
    late_chunks  UInt64,
    chunks       UInt64,
    energy_sum   Float64,
    fps_q        AggregateFunction(quantilesTDigest(0.05, 0.5, 0.95), Float64),
    period_q     AggregateFunction(quantilesTDigest(0.5, 0.95, 0.99), Float64),
    rolled_at    DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(rolled_at)
ORDER BY (day, release, gpu_kind);

-- Per day: the step count of session_fleet rows whose hour falls on it when the day was rolled
-- (a change means late rows arrived: the day and the one before are rolled again).
CREATE TABLE IF NOT EXISTS fleet_daily_marks
(
    day          Date,
    steps_total  UInt64,
    rolled_at    DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(rolled_at)
ORDER BY day;
