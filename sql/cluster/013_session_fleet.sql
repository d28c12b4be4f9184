-- Cluster variant of sql/013_session_fleet.sql: per-session counters in time order, one row per
-- session and step block -- telemetry-sized, so sharded like the steps it is built from: a
-- materialized view on each shard's steps_local writes session_fleet_local (steps are sharded by
-- session_id, so a session's rows stay on one shard), and a Distributed session_fleet over them
-- with the same shard key; read it with the same sum()/min() queries as the embedded store.
-- Apply after 012: clickhouse-client --multiquery < sql/cluster/013_session_fleet.sql

CREATE TABLE IF NOT EXISTS session_fleet_local ON CLUSTER '{cluster}'
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
ENGINE = ReplicatedAggregatingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
PARTITION BY toDate(hour)
ORDER BY (hour, release, gpu_kind, session_id)
TTL hour + INTERVAL 400 DAY
SETTINGS replicated_deduplication_window = 10000;

CREATE MATERIALIZED VIEW IF NOT EXISTS session_fleet_mv ON CLUSTER '{cluster}' TO session_fleet_local AS
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
FROM steps_local
GROUP BY release, gpu_kind, session_id;

CREATE TABLE IF NOT EXISTS session_fleet ON CLUSTER '{cluster}' AS session_fleet_local
ENGINE = Distributed('{cluster}', currentDatabase(), session_fleet_local, cityHash64(session_id));
