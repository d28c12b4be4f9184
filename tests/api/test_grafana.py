"""The Grafana dashboard file is what api/grafana.py generates from the pages' query definitions, and every
query in it runs on ClickHouse (chDB) once the plugin's macros are filled in, answering what the panel draws."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

from api import grafana
from api.switchboard import get_switchboard
from tests.api.test_timeseries import _sessions

FILE = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "livestep.json"


def test_committed_file_is_generated():
    assert FILE.read_text() == grafana.render(), "regenerate: python -m api.grafana > deploy/grafana/livestep.json"


def _run(store, sql: str, start: datetime, end: datetime, release: str = "v2", gpu_kind: str = "cpu"):
    """The plugin's macros as Grafana fills them: hour buckets (a range of days), the variables' values."""
    lit = "toDateTime64('{:%Y-%m-%d %H:%M:%S}', 3, 'UTC')"
    sql = sql.replace("$__fromTime", lit.format(start)).replace("$__toTime", lit.format(end))
    sql = re.sub(r"\$__timeInterval\((\w+)\)", r"toStartOfHour(\1)", sql)
    return store.query_df(sql.replace("${release:singlequote}", f"'{release}'")
                          .replace("${gpu_kind:singlequote}", f"'{gpu_kind}'"))


def _later_session(store, release: str, at: datetime) -> None:
    """One more session of ``release`` (``_sessions`` names its sessions by release and index)."""
    from collector import records

    start = {"worker_id": "w1", "session_id": f"{release}-later", "release": release, "gpu_kind": "cpu", "ts": at,
             "phase": "start", "first_forward_tokens": 8, "streamed_s": 0.0, "frames": 0, "avg_fps": None,
             "late_chunks": 0, "stall_ms": 0.0, "tp_size": 1, "shape": "tiny", "switches": ""}
    store.insert_arrow("sessions", records.to_arrow("session", [start]))
    steps = [{"worker_id": "w1", "session_id": f"{release}-later", "release": release, "gpu_kind": "cpu",
              "ts": at + timedelta(seconds=k), "step": k, "diffusion_ms": 100.0, "step_period_ms": 160.0,
              "decode_ms": None, "cache_upkeep_ms": None, "attention_ms": None, "allreduce_ms": None, "late": k == 0,
              "playout_depth": 2, "reset_step": False, "energy_mj": None, "mem_allocated_bytes": 1,
              "mem_reserved_bytes": 1, "buffers_registered": 0, "switches": ""} for k in range(10)]
    store.insert_arrow("steps", records.to_arrow("step", steps))


def test_every_query_runs_and_answers(store):
    now = datetime.now(UTC).replace(hour=12, minute=0, second=0, microsecond=0)
    _sessions(store, "v2", now - timedelta(days=1), n=3)
    _later_session(store, "v2", now - timedelta(days=1, hours=-2))  # two hours later the same day
    _sessions(store, "v3", now - timedelta(days=1), n=2)  # not selected in the release variable
    get_switchboard(store, 0).set("compile", False, "release=v2", actor="op", reason="t")
    doc = json.loads(FILE.read_text())
    start, end = now - timedelta(days=3), now + timedelta(days=1)
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert {"release", "gpu_kind"} <= set(variables)
    assert store.query_df(variables["release"]["query"])["release"].to_list() == ["v2", "v3"]
    assert variables["gpu_kind"]["multi"] and variables["gpu_kind"]["includeAll"]
    panels = {p["title"]: p for p in doc["panels"]}
    assert all(p["datasource"]["type"] == "grafana-clickhouse-datasource" for p in panels.values())
    series = [p for p in panels.values() if p["type"] == "timeseries"]
    assert len(series) == 5 and len(panels) == 7
    for p in series:
        sql = p["targets"][0]["rawSql"]
        assert "$__fromTime" in sql and "$__toTime" in sql and "{" not in sql.replace("${", "")
        assert "${release:singlequote}" in sql and "${gpu_kind:singlequote}" in sql
        df = _run(store, sql, start, end)
        assert df.columns[:2] == ["time", "release"], (p["title"], df)
        assert set(df["release"].to_list()) <= {"v2"}, (p["title"], df)
    period = next(p for t, p in panels.items() if t.startswith("session step period"))
    hours = _run(store, period["targets"][0]["rawSql"], start, end)
    assert hours.height == 2  # finer than a day: the sessions two hours apart are two points
    assert period["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]["value"] == 1000 * 4 / 24
    late = _run(store, next(p for t, p in panels.items() if t.startswith("late"))["targets"][0]["rawSql"], start, end)
    assert late["late_share"].to_list() == [0.1, 0.1]
    count = _run(store, panels["sessions that streamed >= 1 s, per interval"]["targets"][0]["rawSql"], start, end)
    assert count["session_count"].to_list() == [3, 1]
    for title in ("open findings", "active switch rules"):
        _run(store, panels[title]["targets"][0]["rawSql"], start, end)
    rules = _run(store, panels["active switch rules"]["targets"][0]["rawSql"], start, end)
    assert rules["switch"].to_list() == ["compile"]
    marks = {a["name"]: a["target"]["rawSql"] for a in doc["annotations"]["list"] if "target" in a}
    assert set(marks) == {"rollout", "switch", "incident open", "incident close"}
    got = {name: _run(store, sql, start, end)["text"].to_list() for name, sql in marks.items()}
    assert sorted(got["rollout"]) == ["rollout v2", "rollout v3"] and got["switch"] == ["compile off (release=v2) by op"]
    assert got["incident open"] == [] and got["incident close"] == []
