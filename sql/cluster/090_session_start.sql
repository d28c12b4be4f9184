-- Cluster variant of sql/090_session_start.sql: the session record's ttff_ms and preroll on every
-- shard's sessions_local and on the Distributed sessions over them. Nullable: rows stored before read NULL.
-- Apply after 040: clickhouse-client --multiquery < sql/cluster/090_session_start.sql

ALTER TABLE sessions_local ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS ttff_ms Nullable(Float64);

ALTER TABLE sessions_local ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS preroll Nullable(UInt8);

ALTER TABLE sessions ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS ttff_ms Nullable(Float64);

ALTER TABLE sessions ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS preroll Nullable(UInt8);
