-- Per-session counters kept in time order, for fleet queries over recent hours and days.
-- session_stats is ordered by (release, gpu_kind, worker_id, session_id): a time window there reads
-- every granule. This light view is partitioned by day and ordered by the hour of each block's first
-- step, so a query for "today" or one closed day reads only those parts. A session's rows from
-- later blocks land in later hours: readers group by session with a few hours of slack on each side
-- (analytics.queries.MAX_SESSION_HOURS). Read with sum()/min() grouped by session.

CREATE TABLE IF NOT EXISTS session_fleet
(
    hour           DateTime('UTC'),
    release        LowCardinality(String),
    gpu_kind       LowCardinality(String),
    session_id     String,
    first_ts       SimpleAggregateFunction(min, DateTime64(3, 'UTC')),
    steps          SimpleAggregateFunction(sum, UInt64),
    late_chunks    SimpleAggregateFunction(sum, UInt64),
    period_ms_sum  SimpleAggregateFunction(sum, Float64),
    energy_mj_sum  SimpleAggregateFunction(sum, Float64)
)
ENGINE = AggregatingMergeTree
PARTITION BY toDate(hour)
ORDER BY (hour, release, gpu_kind, session_id)
TTL hour + INTERVAL 400 DAY
SETTINGS non_replicated_deduplication_window = 10000;

CREATE MATERIALIZED VIEW IF NOT EXISTS session_fleet_mv TO session_fleet AS
SELECT
    toStartOfHour(min(ts))                   AS hour,
    release,
    gpu_kind,
    session_id,
    min(ts)                                  AS first_ts,
    count()                                  AS steps,
    countIf(late)                            AS late_chunks,
    sum(toFloat64(step_period_ms))           AS period_ms_sum,
    sum(ifNull(energy_mj, 0))                AS energy_mj_sum
FROM steps
GROUP BY release, gpu_kind, session_id;
