-- Every shape dimension the worker varies is a typed column of the session record
-- (collector/records.py: SessionRecord, SHAPE_KEYS): the memory detector (analytics/memory.py) judges
-- growth against each. first_forward_tokens and tp_size were there from 001; this adds
--   cond_tokens     conditioning (prompt) tokens
--   decoder_height  decoded frame height, pixels   } the decoder output resolution
--   decoder_width   decoded frame width, pixels    }
--   chunk_frames    video frames per chunk (per step)
-- Nullable: rows of older workers (and every row stored before this migration) read NULL.
-- Its cluster form is generated (collector/migrations.py).

ALTER TABLE sessions ADD COLUMN IF NOT EXISTS cond_tokens Nullable(UInt32);

ALTER TABLE sessions ADD COLUMN IF NOT EXISTS decoder_height Nullable(UInt16);

ALTER TABLE sessions ADD COLUMN IF NOT EXISTS decoder_width Nullable(UInt16);

ALTER TABLE sessions ADD COLUMN IF NOT EXISTS chunk_frames Nullable(UInt16);
