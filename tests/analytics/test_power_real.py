"""The real H200 (a flip session of prod57b on one H200, 2026-12-02, the worker's own telemetry file, as
``livestep replay`` ships it): replayed through the collector's ingest checks, its device name is stored as
the kind ``h200`` and the power detector says what the GPU samples show, the software power cap."""

import json
from datetime import timedelta
from pathlib import Path

from analytics import power
from collector import records
from collector.routes import ARROW_STREAM, parse_body
from collector.telemetry_file import read_file

REAL = Path(__file__).resolve().parent.parent / "data" / "h200_flip_session.arrows"


def _replay(store) -> None:
    for b in read_file(REAL).batches:
        for kind, t in parse_body(ARROW_STREAM, b.body).items():
            store.insert_arrow(records.TABLES[kind], getattr(t, "table", None) or t, dedup_token=b.batch_id)


def test_the_real_h200_file_is_stored_as_h200_and_read_as_power_capped(store):
    _replay(store)
    for table in ("steps", "gpu_samples", "sessions", "events"):
        assert store.query_rows(f"SELECT DISTINCT gpu_kind FROM {table}") == [("h200",)], table
    (end,) = store.query_rows("SELECT max(ts) FROM gpu_samples")[0]
    rows = power.run(store, end - timedelta(days=1), end + timedelta(minutes=1))
    assert [(r["scope"], r["severity"]) for r in rows] == [("gpu_kind=h200", "info")]  # throttled all along
    ev = json.loads(rows[0]["evidence"])
    assert ev["judgement"] == "level" and ev["reasons"] == ["SW_POWER_CAP"]
    assert ev["recent"]["shares"]["SW_POWER_CAP"] > 0.9 and ev["recent"]["power_max_w"] > 690
