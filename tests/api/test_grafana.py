"""The Grafana dashboard file is what api/grafana.py generates from the pages' query definitions, and every
query in it runs on ClickHouse (chDB) once the plugin's macros are filled in, answering what the panel draws."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from api import grafana
from api.switchboard import get_switchboard
from tests.api.test_timeseries import _sessions

FILE = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "livestep.json"


def test_committed_file_is_generated():
    assert FILE.read_text() == grafana.render(), "regenerate: python -m api.grafana > deploy/grafana/livestep.json"


def _run(store, sql: str, start: datetime, end: datetime):
    lit = "toDateTime64('{:%Y-%m-%d %H:%M:%S}', 3, 'UTC')"
    return store.query_df(sql.replace("$__fromTime", lit.format(start)).replace("$__toTime", lit.format(end)))


def test_every_query_runs_and_answers(store):
    now = datetime.now(UTC).replace(hour=12, microsecond=0)
    _sessions(store, "v2", now - timedelta(days=1), n=3)
    get_switchboard(store, 0).set("compile", False, "release=v2", actor="op", reason="t")
    doc = json.loads(FILE.read_text())
    start, end = now - timedelta(days=3), now + timedelta(days=1)
    panels = {p["title"]: p for p in doc["panels"]}
    assert len(panels) == 3 and all(p["datasource"]["type"] == "grafana-clickhouse-datasource" for p in panels.values())
    for p in panels.values():
        sql = p["targets"][0]["rawSql"]
        assert "$__fromTime" in sql and "$__toTime" in sql and "{" not in sql
        df = _run(store, sql, start, end)
        assert df.columns[:2] == ["time", "release"] and df["release"].to_list() == ["v2"], (p["title"], df)
    late = _run(store, next(p for t, p in panels.items() if t.startswith("late"))["targets"][0]["rawSql"], start, end)
    assert late["late_share"].to_list() == [0.1]
    period = next(p for t, p in panels.items() if t.startswith("session step period"))
    assert period["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]["value"] == 1000 * 4 / 24
    marks = {a["name"]: a["target"]["rawSql"] for a in doc["annotations"]["list"] if "target" in a}
    assert set(marks) == {"rollout", "switch", "incident open", "incident close"}
    got = {name: _run(store, sql, start, end)["text"].to_list() for name, sql in marks.items()}
    assert got["rollout"] == ["rollout v2"] and got["switch"] == ["compile off (release=v2) by op"]
    assert got["incident open"] == [] and got["incident close"] == []
