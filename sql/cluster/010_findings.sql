-- Cluster variant of sql/010_findings.sql: replicated findings on each shard, sharded by their key so
-- a re-run's newer version of a finding replaces the older one on the same shard (ReplacingMergeTree),
-- and a Distributed findings table over them. Read with FINAL (or argMax by updated_at) as on chDB.
-- Apply after 002: clickhouse-client --multiquery < sql/cluster/010_findings.sql

CREATE TABLE IF NOT EXISTS findings_local ON CLUSTER '{cluster}'
(
    kind          LowCardinality(String),   -- fps_fraction | memory_growth | regression | changepoint | canary
    scope         String,                   -- canonical 'key=value,...' sorted by key, e.g. 'gpu_kind=h200,release=v7'
    metric        LowCardinality(String),   -- e.g. frac_le_24fps, step_period_ms_p50, bytes_per_shape
    window_start  DateTime64(3, 'UTC'),
    window_end    DateTime64(3, 'UTC'),
    baseline      Nullable(Float64),        -- the baseline value (baseline release, week before, ...)
    value         Float64,                  -- the value found
    effect        Nullable(Float64),        -- relative effect (value/baseline - 1) or slope
    confidence    Nullable(Float64),        -- 1 - p-value (or the test's confidence), 0..1
    severity      LowCardinality(String),   -- info | warning | critical
    status        LowCardinality(String),   -- open | resolved | acknowledged
    attribution   String,                   -- the switch blamed ('' if none), e.g. 'fused_allreduce'
    evidence      String CODEC(ZSTD(3)),    -- JSON: counts, intervals, test statistics, series
    job           LowCardinality(String),   -- the job that wrote it
    first_seen    DateTime64(3, 'UTC'),
    updated_at    DateTime64(3, 'UTC')
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', updated_at)
ORDER BY (kind, scope, metric, window_start);

CREATE TABLE IF NOT EXISTS findings ON CLUSTER '{cluster}' AS findings_local
ENGINE = Distributed('{cluster}', currentDatabase(), findings_local, cityHash64(kind, scope, metric));
