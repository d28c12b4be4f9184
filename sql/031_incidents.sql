-- Incidents (api/incidents.py): findings grouped by root cause -- finding kind x scope (release, GPU
-- kind; never one worker) x attributed switch -- with one lifecycle and at most one action each.
-- incidents: one row per incident id (a hash of its key), newest version wins; state is
-- opened | escalated | mitigated | resolved | reopened. evidence_keys: the findings (kind|scope|metric|
-- window_start) that are its evidence now; evidence: a short JSON view of them for the API.
-- incident_log: every state change, flip and notification of an incident (what "audit rows a day"
-- counts for an incident, with the switch_audit rows its flips wrote).
-- Its cluster form is generated (collector/migrations.py).

CREATE TABLE IF NOT EXISTS incidents
(
    id             String,
    key            String,
    kind           LowCardinality(String),
    scope          String,
    release        String,
    gpu_kind       String,
    switch         String,
    state          LowCardinality(String),
    severity       LowCardinality(String),
    summary        String,
    opened_at      DateTime64(3, 'UTC'),
    updated_at     DateTime64(3, 'UTC'),
    mitigated_at   Nullable(DateTime64(3, 'UTC')),
    resolved_at    Nullable(DateTime64(3, 'UTC')),
    lifted_at      Nullable(DateTime64(3, 'UTC')),
    notified_at    Nullable(DateTime64(3, 'UTC')),
    notifications  UInt32,
    flips          UInt32,
    acted          Bool,
    evidence_keys  String CODEC(ZSTD(3)),
    evidence       String CODEC(ZSTD(3)),
    version        UInt64
)
ENGINE = ReplacingMergeTree(version)
ORDER BY id;

CREATE TABLE IF NOT EXISTS incident_log
(
    ts           DateTime64(3, 'UTC'),
    incident_id  String,
    event        LowCardinality(String),   -- opened | escalated | mitigated | rule_lifted | resolved | reopened | flip | notified | repeat
    state        LowCardinality(String),
    detail       String CODEC(ZSTD(3))     -- JSON
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (incident_id, ts);
