-- Analytics job runs: one row per attempt (scheduled, retried or on demand), so a failing job is
-- visible (status, error) without reading logs; the scheduler retries a failed run a few times.

CREATE TABLE IF NOT EXISTS job_runs
(
    job           LowCardinality(String),
    started_at    DateTime64(3, 'UTC'),
    finished_at   DateTime64(3, 'UTC'),
    status        LowCardinality(String),   -- ok | failed
    attempt       UInt8,
    trigger       LowCardinality(String),   -- schedule | retry | demand | release
    window_start  Nullable(DateTime64(3, 'UTC')),
    window_end    Nullable(DateTime64(3, 'UTC')),
    findings      UInt32,
    error         String CODEC(ZSTD(3))
)
ENGINE = MergeTree
ORDER BY (job, started_at)
TTL toDateTime(started_at) + INTERVAL 180 DAY;
