-- Cluster variant of sql/040_session_shape.sql: the session record's shape columns (cond_tokens,
-- decoder_height, decoder_width, chunk_frames) on every shard's sessions_local and on the Distributed
-- sessions over them. Nullable: rows stored before read NULL.
-- Apply after 022: clickhouse-client --multiquery < sql/cluster/040_session_shape.sql

ALTER TABLE sessions_local ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS cond_tokens Nullable(UInt32);

ALTER TABLE sessions_local ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS decoder_height Nullable(UInt16);

ALTER TABLE sessions_local ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS decoder_width Nullable(UInt16);

ALTER TABLE sessions_local ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS chunk_frames Nullable(UInt16);

ALTER TABLE sessions ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS cond_tokens Nullable(UInt32);

ALTER TABLE sessions ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS decoder_height Nullable(UInt16);

ALTER TABLE sessions ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS decoder_width Nullable(UInt16);

ALTER TABLE sessions ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS chunk_frames Nullable(UInt16);
