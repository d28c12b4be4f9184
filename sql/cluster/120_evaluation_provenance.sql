-- Cluster variant of sql/120_evaluation_provenance.sql: the same columns on every shard's evaluations_local
-- and on the Distributed evaluations over them. Apply after 100.

ALTER TABLE evaluations_local ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS evaluator Nullable(String);

ALTER TABLE evaluations_local ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS device_type Nullable(String);

ALTER TABLE evaluations_local ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS tp Nullable(UInt16);

ALTER TABLE evaluations_local ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS steps Nullable(UInt32);

ALTER TABLE evaluations_local ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS seeds Nullable(UInt32);

ALTER TABLE evaluations_local ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS reruns Nullable(UInt32);

ALTER TABLE evaluations_local ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS nonfinite Nullable(UInt32);

ALTER TABLE evaluations ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS evaluator Nullable(String);

ALTER TABLE evaluations ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS device_type Nullable(String);

ALTER TABLE evaluations ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS tp Nullable(UInt16);

ALTER TABLE evaluations ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS steps Nullable(UInt32);

ALTER TABLE evaluations ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS seeds Nullable(UInt32);

ALTER TABLE evaluations ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS reruns Nullable(UInt32);

ALTER TABLE evaluations ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS nonfinite Nullable(UInt32);
