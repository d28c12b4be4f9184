-- Cluster variant of sql/020_switches.sql: the switch control plane (rules, audit trail, alert
-- deliveries, canaries). Small tables that must be read-after-write consistent -- a rule written by
-- the webhook is what the next worker poll must see, a delivery recorded is what the next replay check
-- must find -- so each is replicated to every node (no {shard} in the keeper path: every server is a
-- replica of the one table; no Distributed table, no shard key), and FINAL sees every version of a key.
-- Writers insert with insert_quorum = 'auto' (a majority of the replicas acknowledge before the insert
-- returns) and readers set select_sequential_consistency = 1 (they see every quorum insert).
-- '{replica}' must be unique across the cluster.
-- Apply after 013: clickhouse-client --multiquery < sql/cluster/020_switches.sql

-- switch_rules: one row per (name, scope, cohort) key, newest version wins (ReplacingMergeTree on
-- version); a rule withdrawn is a newer version with active = 0. scope is canonical 'key=value,...'
-- sorted by key ('' = the whole fleet); cohort '' = every worker of the scope, 'canary=<id>' = the
-- workers whose stable bucket (hash of worker_id mod 100) lies in [bucket_lo, bucket_hi).

CREATE TABLE IF NOT EXISTS switch_rules ON CLUSTER '{cluster}'
(
    name       LowCardinality(String),
    scope      String,
    cohort     String,
    value      Bool,
    active     Bool,
    bucket_lo  UInt8,
    bucket_hi  UInt8,
    version    UInt64,
    actor      String,
    reason     String,
    updated_at DateTime64(3, 'UTC')
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/all/{database}/{table}', '{replica}', version)
ORDER BY (name, scope, cohort);

-- Every decision about a switch, applied or not: who, why, when, what changed (changed = 0 is a
-- recorded no-op: the switch was already in that state, a resolved alert, a duplicate delivery).
CREATE TABLE IF NOT EXISTS switch_audit ON CLUSTER '{cluster}'
(
    ts         DateTime64(3, 'UTC'),
    source     LowCardinality(String),   -- api | alert | canary
    action     LowCardinality(String),   -- set | clear | canary_start | canary_promote | canary_rollback | alert_noop ...
    name       LowCardinality(String),   -- switch name ('' when an alert named none)
    scope      String,
    cohort     String,
    old_value  Nullable(Bool),
    new_value  Nullable(Bool),
    changed    Bool,
    version    UInt64,
    actor      String,
    reason     String,
    ref        String,                   -- alert dedup key or canary id
    evidence   String CODEC(ZSTD(3))     -- JSON
)
ENGINE = ReplicatedMergeTree('/clickhouse/tables/all/{database}/{table}', '{replica}')
PARTITION BY toYYYYMM(ts)
ORDER BY ts;

-- Alert webhook deliveries: the dedup key of each alert (fingerprint + startsAt, or a finding's key)
-- and the signatures already accepted (replay protection). ReplacingMergeTree: one row per key.
CREATE TABLE IF NOT EXISTS alert_deliveries ON CLUSTER '{cluster}'
(
    dedup_key   String,
    fmt         LowCardinality(String),  -- livestep | alertmanager | grafana | signature
    first_seen  DateTime64(3, 'UTC'),
    decision    String,
    deliveries  UInt32
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/all/{database}/{table}', '{replica}', first_seen)
ORDER BY dedup_key
TTL toDateTime(first_seen) + INTERVAL 30 DAY;

-- Canaries: a switch re-enabled for a fraction of a scope's workers, then promoted or rolled back.
CREATE TABLE IF NOT EXISTS canaries ON CLUSTER '{cluster}'
(
    id           String,
    name         LowCardinality(String),
    scope        String,
    fraction     Float64,
    bucket_lo    UInt8,
    bucket_hi    UInt8,
    min_sessions UInt32,
    status       LowCardinality(String),  -- running | promoted | rolled_back | cancelled
    started_at   DateTime64(3, 'UTC'),
    decided_at   Nullable(DateTime64(3, 'UTC')),
    actor        String,
    reason       String,
    evidence     String CODEC(ZSTD(3)),
    updated_at   DateTime64(3, 'UTC')
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/all/{database}/{table}', '{replica}', updated_at)
ORDER BY id;
