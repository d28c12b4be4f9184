-- Cluster variant of sql/030_rule_source.sql: switch_rules (replicated on every node) gets its source
-- column; rules stored before read ''.
-- Apply after 022: clickhouse-client --multiquery < sql/cluster/030_rule_source.sql

ALTER TABLE switch_rules ON CLUSTER '{cluster}' ADD COLUMN IF NOT EXISTS source LowCardinality(String) DEFAULT '';
