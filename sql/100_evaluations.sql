-- Evaluation records (collector/records.py kind "evaluation", ``livestep evaluate``): per evaluation run
-- (session_id), configuration and judge, a summary row (step NULL) and the points of its curve
-- (divergence per bin of steps against the rerun band, drift per position-reset interval), and one
-- "overall" row per configuration: the verdict the control plane's gate on numeric switch defaults
-- reads (api/evaluation_gate.py: the latest overall row of a switch for a GPU kind and release).
-- Small (tens of rows per run): ordered for that lookup, kept as long as the releases they judge.
-- Its cluster form is generated (collector/migrations.py).

CREATE TABLE IF NOT EXISTS evaluations
(
    {{record_columns}},
    configuration LowCardinality(String),
    switch        LowCardinality(String),
    preset        LowCardinality(String),
    metric        LowCardinality(String),
    value         Float64,
    band_lo       Nullable(Float64),
    band_hi       Nullable(Float64),
    verdict       LowCardinality(String),
    n             UInt32,
    step          Nullable(UInt32)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (switch, gpu_kind, release, metric, ts)
TTL toDateTime(ts) + INTERVAL 730 DAY
SETTINGS non_replicated_deduplication_window = 10000;
