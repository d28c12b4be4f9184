-- Each session's GPU memory, as the worker read it (collector/records.py: SessionRecord):
--   gpu_mem_total_bytes  total memory of one of the session's GPUs (NVML / torch), bytes
-- The memory detector (analytics/memory.py) takes its time to OOM from it, for any GPU, without a table of
-- kinds. Nullable: rows of older workers (and every row stored before this migration) read NULL.
-- Its cluster form is generated (collector/migrations.py).

ALTER TABLE sessions ADD COLUMN IF NOT EXISTS gpu_mem_total_bytes Nullable(UInt64);
