-- Issue 31: what an evaluation's evidence rests on, per evaluations row (collector/records.py kind
-- "evaluation"): the evaluator token's name that posted it (POST /v1/evaluations, set by the server: the
-- ingest route refuses evaluation records), the device type it ran on, its TP, steps, weight seeds and band
-- runs, and how many non-finite values its judge saw. The gate (api/evaluation_gate.py) counts a row only
-- with an evaluator. Nullable: rows stored before read NULL (never evidence). The cluster form is generated (collector/migrations.py).

ALTER TABLE evaluations ADD COLUMN IF NOT EXISTS evaluator Nullable(String);

ALTER TABLE evaluations ADD COLUMN IF NOT EXISTS device_type Nullable(String);

ALTER TABLE evaluations ADD COLUMN IF NOT EXISTS tp Nullable(UInt16);

ALTER TABLE evaluations ADD COLUMN IF NOT EXISTS steps Nullable(UInt32);

ALTER TABLE evaluations ADD COLUMN IF NOT EXISTS seeds Nullable(UInt32);

ALTER TABLE evaluations ADD COLUMN IF NOT EXISTS reruns Nullable(UInt32);

ALTER TABLE evaluations ADD COLUMN IF NOT EXISTS nonfinite Nullable(UInt32);
