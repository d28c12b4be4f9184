-- When an incident last had evidence (api/incidents.py): it resolves only once its evidence has stayed away
-- RESOLVE_AFTER, so a cause a daily detector finds one day and not the next is one incident, not a flapping
-- series of them. Nullable: incidents stored before read NULL (their updated_at stands in).
-- Its cluster form is generated (collector/migrations.py).

ALTER TABLE incidents ADD COLUMN IF NOT EXISTS evidence_at Nullable(DateTime64(3, 'UTC'));
