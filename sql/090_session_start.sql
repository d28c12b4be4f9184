-- How a session started, as its player saw it (collector/records.py: SessionRecord):
--   ttff_ms   session start -> the first frame played, ms (the end record; null: playback never began)
--   preroll   chunks buffered before playback began (worker/session.py PREROLL, --preroll)
-- Nullable: rows of older workers (and every row stored before this migration) read NULL.
-- Its cluster form is generated (collector/migrations.py).

ALTER TABLE sessions ADD COLUMN IF NOT EXISTS ttff_ms Nullable(Float64);

ALTER TABLE sessions ADD COLUMN IF NOT EXISTS preroll Nullable(UInt8);
