-- Raw telemetry, one table per record kind (collector/records.py is the column contract).
-- Daily partitions, rows ordered for per-release / per-session reads, LowCardinality labels,
-- time and value codecs, TTL. The dedup window makes a retried batch (same insert token) land once.
-- {{record_columns}}: the columns every record carries (worker_id, session_id, release, gpu_kind, ts,
-- simulated), written out by collector/migrations.py (`livestep migrate --dry-run` prints them).

CREATE TABLE IF NOT EXISTS steps
(
    {{record_columns}},
    step                UInt32 CODEC(Delta, ZSTD(1)),
    diffusion_ms        Float32 CODEC(Gorilla, ZSTD(1)),
    step_period_ms      Float32 CODEC(Gorilla, ZSTD(1)),
    decode_ms           Nullable(Float32) CODEC(ZSTD(1)),
    cache_upkeep_ms     Nullable(Float32) CODEC(ZSTD(1)),
    attention_ms        Nullable(Float32) CODEC(ZSTD(1)),
    allreduce_ms        Nullable(Float32) CODEC(ZSTD(1)),
    late                Bool,
    playout_depth       UInt16,
    reset_step          Bool,
    energy_mj           Nullable(Float64) CODEC(ZSTD(1)),
    mem_allocated_bytes UInt64 CODEC(Delta, ZSTD(1)),
    mem_reserved_bytes  UInt64 CODEC(Delta, ZSTD(1)),
    buffers_registered  UInt32 CODEC(Delta, ZSTD(1)),
    switches            LowCardinality(String)
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (release, worker_id, session_id, ts)
TTL toDateTime(ts) + INTERVAL 180 DAY
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS gpu_samples
(
    {{record_columns}},
    gpu_index        UInt16,
    power_w          Nullable(Float32) CODEC(ZSTD(1)),
    energy_mj        Nullable(Float64) CODEC(ZSTD(1)),
    sm_clock_mhz     Nullable(UInt32) CODEC(ZSTD(1)),
    mem_used_bytes   Nullable(UInt64) CODEC(ZSTD(1)),
    temp_c           Nullable(Float32) CODEC(ZSTD(1)),
    throttle_reasons Nullable(UInt64) CODEC(ZSTD(1))
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (worker_id, gpu_index, ts)
TTL toDateTime(ts) + INTERVAL 30 DAY
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS sessions
(
    {{record_columns}},
    phase                LowCardinality(String),
    first_forward_tokens UInt32,
    streamed_s           Float64,
    frames               UInt64,
    avg_fps              Nullable(Float64),
    late_chunks          UInt64,
    stall_ms             Float64,
    tp_size              UInt16,
    shape                LowCardinality(String),
    switches             LowCardinality(String)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (release, worker_id, session_id, phase)
TTL toDateTime(ts) + INTERVAL 400 DAY
SETTINGS non_replicated_deduplication_window = 10000;

CREATE TABLE IF NOT EXISTS events
(
    {{record_columns}},
    kind       LowCardinality(String),
    detail     String CODEC(ZSTD(3))
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (kind, ts, worker_id)
TTL toDateTime(ts) + INTERVAL 400 DAY
SETTINGS non_replicated_deduplication_window = 10000;
