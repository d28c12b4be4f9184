-- Cluster variant of sql/110_gpu_memory_total.sql: the session record's gpu_mem_total_bytes on every
-- shard's sessions_local and on the Distributed sessions over them. Nullable: rows stored before read NULL.
-- Apply after 090: clickhouse-client --multiquery < sql/cluster/110_gpu_memory_total.sql

ALTER TABLE sessions_local ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS gpu_mem_total_bytes Nullable(UInt64);

ALTER TABLE sessions ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS gpu_mem_total_bytes Nullable(UInt64);
