-- Cluster variant of sql/031_incidents.sql: incidents and their log are control-plane tables, small and
-- read-after-write (the next job's hand-off must see the incident the last one wrote), so, like
-- 020's, each is replicated to every node (no {shard}, no Distributed table).
-- Apply after 030: clickhouse-client --multiquery < sql/cluster/031_incidents.sql

CREATE TABLE IF NOT EXISTS incidents ON CLUSTER '{cluster}'
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
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/all/{database}/{table}', '{replica}', version)
ORDER BY id;

CREATE TABLE IF NOT EXISTS incident_log ON CLUSTER '{cluster}'
(
    ts           DateTime64(3, 'UTC'),
    incident_id  String,
    event        LowCardinality(String),   -- opened | escalated | mitigated | rule_lifted | resolved | reopened | flip | notified | repeat
    state        LowCardinality(String),
    detail       String CODEC(ZSTD(3))     -- JSON
)
ENGINE = ReplicatedMergeTree('/clickhouse/tables/all/{database}/{table}', '{replica}')
PARTITION BY toYYYYMM(ts)
ORDER BY (incident_id, ts);
