-- When an incident last had evidence (api/incidents.py): it resolves only once its evidence has stayed away
-- RESOLVE_AFTER, so a cause a daily detector finds one day and not the next is one incident, not a flapping
-- series of them. Nullable: incidents stored before read NULL (their updated_at stands in).
-- Cluster counterpart: sql/cluster/111_incident_evidence_at.sql.

ALTER TABLE incidents ADD COLUMN IF NOT EXISTS evidence_at Nullable(DateTime64(3, 'UTC'));
