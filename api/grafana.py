"""A Grafana dashboard over the ClickHouse datasource plugin, generated from api/timeseries.py's query
definitions (the same SQL the dashboard pages run): ``deploy/grafana/livestep.json``.

    python -m api.grafana > deploy/grafana/livestep.json     # regenerate (tests/api/test_grafana.py checks it)

Import it in Grafana (Dashboards > Import) and pick a ClickHouse data source (grafana-clickhouse-datasource)
on livestep's database. Variables: ``release`` and ``gpu_kind`` (multi-value, all by default) filter
every time series. Panels: one per ``SERIES`` (per release, from the live session_fleet view, bucketed by
Grafana's interval ``$__timeInterval``: an hour or less on a day's range, not a day), with the deadline
as a threshold; sessions per interval; turn latency p50/p95; the open findings and the active switch
rules (tables; analytics/queries.py declares their SQL). Annotations: release rollouts, switch changes,
incidents opened and closed. The query parameters become the plugin's macros: ``{start}``
``$__fromTime``, ``{end}`` ``$__toTime``.
"""

from __future__ import annotations

import json
import re
import sys

from analytics import queries as aq
from api import timeseries as ts
from collector import catalog

DATASOURCE = {"type": "grafana-clickhouse-datasource", "uid": "${datasource}"}
_MACROS = ((r"\{(start|s|lo):DateTime64\(3, 'UTC'\)\}", "$__fromTime"),
           (r"\{(end|e|hi):DateTime64\(3, 'UTC'\)\}", "$__toTime"))
_UNITS = {"ms": "ms", "ratio": "percentunit", "fps": "none", "count": "short"}
_MARK_COLORS = {"rollout": "blue", "switch": "orange", "incident_open": "red", "incident_close": "green"}


def grafana_sql(sql: str) -> str:
    """Our parameterized SQL with the plugin's time macros (and the fixed parameters as literals)."""
    for pattern, macro in _MACROS:
        sql = re.sub(pattern, macro, sql)
    sql = sql.replace("{min_s:Float64}", repr(catalog.MIN_STREAMED_S))
    left = [p for p in re.findall(r"\{\w+:[^}]+\}", sql) if not p.endswith(":singlequote}")]
    if left:
        raise ValueError(f"parameters without a Grafana macro: {left}")
    return " ".join(sql.split())


DAY_BUCKET = "toDate(start_ts) AS day"  # the pages' granularity in the live source; Grafana's interval instead
VARIABLE_FILTER = "release IN (${release:singlequote}) AND gpu_kind IN (${gpu_kind:singlequote})"


def series_query(s: ts.Series, columns: tuple[str, ...] | None = None) -> str:
    source = aq.live_source()
    if DAY_BUCKET not in source:
        raise ValueError(f"the live source no longer buckets by {DAY_BUCKET!r}: update api/grafana.py")
    source = source.replace(DAY_BUCKET, "$__timeInterval(start_ts) AS day")
    return grafana_sql(aq.series_time_sql(s, source, VARIABLE_FILTER, columns))


def _variable(label: str) -> dict:
    return {"name": label, "label": label, "type": "query", "datasource": DATASOURCE, "query": aq.label_values_sql(label),
            "definition": aq.label_values_sql(label), "multi": True, "includeAll": True, "refresh": 2,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}}


def _table(i: int, title: str, sql: str) -> dict:
    return {"id": i + 1, "type": "table", "title": title, "datasource": DATASOURCE,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 9 * (i // 2)},
            "targets": [{"refId": "A", "datasource": DATASOURCE, "editorType": "sql", "queryType": "table",
                         "format": 1, "rawSql": sql}]}


def _panel(i: int, s: ts.Series, title: str | None = None, sql: str | None = None, unit: str | None = None) -> dict:
    steps = [{"color": "green", "value": None}]
    if s.threshold is not None:
        steps.append({"color": "red", "value": s.threshold})
    return {
        "id": i + 1, "type": "timeseries", "title": (title or s.title).replace("per day", "per interval"), "datasource": DATASOURCE,
        "gridPos": {"h": 9, "w": 24 if i == 0 else 12, "x": 0 if i == 0 else 12 * ((i - 1) % 2),
                    "y": 0 if i == 0 else 9 * ((i + 1) // 2)},
        "fieldConfig": {"defaults": {"unit": _UNITS.get(unit or s.unit, "short"), "min": 0,
                                     "thresholds": {"mode": "absolute", "steps": steps},
                                     "custom": {"thresholdsStyle": {"mode": "dashed" if s.threshold else "off"},
                                                "drawStyle": "line", "showPoints": "always"}},
                        "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"refId": "A", "datasource": DATASOURCE, "editorType": "sql", "queryType": "timeSeries",
                     "format": 0, "rawSql": sql or series_query(s)}],
    }


def panels() -> list[dict]:
    out = [_panel(i, s) for i, s in enumerate(ts.SERIES)]
    fps = ts.SERIES_BY_NAME["fps_fractions"]
    out.append(_panel(len(out), fps, "sessions that streamed >= 1 s, per interval", series_query(fps, ("session_count",)),
                      "count"))
    turns = ts.Series("turn_latency", "turn latency, p50 and p95 of turns", "ms", "", ("p50", "p95"))
    out.append(_panel(len(out), turns, sql=grafana_sql(aq.TURN_LATENCY_SQL)))
    for title, sql in aq.GRAFANA_TABLES.items():
        out.append(_table(len(out), title, sql))
    return out


def dashboard() -> dict:
    annotations = [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
                    "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
                    "type": "dashboard"}]
    for kind, sql in ts.ANNOTATION_SQL.items():
        annotations.append({"name": kind.replace("_", " "), "datasource": DATASOURCE, "enable": True,
                            "iconColor": _MARK_COLORS[kind],
                            "target": {"refId": kind, "editorType": "sql", "queryType": "table", "format": 1,
                                       "rawSql": grafana_sql(sql)}})
    return {
        "title": "livestep fleet", "uid": "livestep-fleet", "schemaVersion": 39, "version": 1, "editable": True,
        "tags": ["livestep"], "timezone": "utc", "time": {"from": "now-56d", "to": "now"},
        "description": "Generated by python -m api.grafana from api/timeseries.py (the dashboard pages' queries).",
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "grafana-clickhouse-datasource",
                                 "label": "ClickHouse (livestep database)", "current": {}},
                                _variable("release"), _variable("gpu_kind")]},
        "annotations": {"list": annotations},
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
