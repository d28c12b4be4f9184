-- session_stats.switches is anyLast per merge: a block replayed late (or merged out of time order)
-- can leave an older switch state in the merged row. switch_last keeps (ts of the session's latest
-- step, its switch state) as a SimpleAggregateFunction(max, Tuple(ts, switches)), i.e. argMax(switches, ts)
-- that merges correctly in any order (ties broken by the state string, so deterministically).
-- Read it as tupleElement(max(switch_last), 2) grouped by session (analytics.queries).
-- Rows stored before this migration keep their data: the column's DEFAULT (last_ts, switches) is
-- what readers used for them before (argMax(switches, last_ts) over partial rows), computed on read
-- and written by the next merge. The view is altered in place (MODIFY QUERY: no window where steps
-- inserts miss it); both statements are idempotent. switches stays as it was (the DEFAULT of old rows).
-- Its cluster form is generated (collector/migrations.py).

ALTER TABLE session_stats
    ADD COLUMN IF NOT EXISTS switch_last SimpleAggregateFunction(max, Tuple(DateTime64(3, 'UTC'), String))
    DEFAULT (last_ts, switches);

ALTER TABLE session_stats_mv MODIFY QUERY
{{session_stats_view}};
