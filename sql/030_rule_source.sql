-- switch_rules.source: who wrote a rule -- api (an operator), alert, incident or canary (api/switchboard.py).
-- The precedence model needs it: a broader manual decision supersedes (withdraws) the narrower
-- automatic rules it covers, never the manual ones. Rules stored before read '' (the switchboard then
-- tells automatic ones by their actor, 'alert:...' / 'canary').
-- Its cluster form is generated (collector/migrations.py).

ALTER TABLE switch_rules ADD COLUMN IF NOT EXISTS source LowCardinality(String) DEFAULT '';
