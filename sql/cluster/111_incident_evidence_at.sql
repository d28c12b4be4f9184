-- Cluster variant of sql/111_incident_evidence_at.sql: when an incident last had evidence.
-- Apply after 110: clickhouse-client --multiquery < sql/cluster/111_incident_evidence_at.sql

ALTER TABLE incidents ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS evidence_at Nullable(DateTime64(3, 'UTC'));
