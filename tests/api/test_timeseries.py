"""Time series of the fleet and what to read them against: the default baseline by rollout time, the
annotations (rollouts, switch changes, incidents opened and closed), series values against the fleet
query they share their rows with, session switch changes, throttle reasons and the one number formatter."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import polars as pl
import pytest

from analytics.findings import finding, write_findings
from api import timeseries as ts
from api.dashboard import human, unit_of
from api.switchboard import get_switchboard
from collector import records


def _sessions(store, release: str, at: datetime, n: int = 1) -> None:
    rows = [{"worker_id": "w1", "session_id": f"{release}-{i}", "release": release, "gpu_kind": "cpu",
             "ts": at + timedelta(minutes=i), "phase": "start", "first_forward_tokens": 8, "streamed_s": 0.0,
             "frames": 0, "avg_fps": None, "late_chunks": 0, "stall_ms": 0.0, "tp_size": 1, "shape": "tiny",
             "switches": ""} for i in range(n)]
    store.insert_arrow("sessions", records.to_arrow("session", rows))
    steps = [{"worker_id": "w1", "session_id": f"{release}-{i}", "release": release, "gpu_kind": "cpu",
              "ts": at + timedelta(minutes=i, seconds=k), "step": k, "diffusion_ms": 100.0, "step_period_ms": 160.0,
              "decode_ms": None, "cache_upkeep_ms": None, "attention_ms": None, "allreduce_ms": None, "late": k == 0,
              "playout_depth": 2, "reset_step": False, "energy_mj": None, "mem_allocated_bytes": 1,
              "mem_reserved_bytes": 1, "buffers_registered": 0, "switches": ""} for i in range(n) for k in range(10)]
    store.insert_arrow("steps", records.to_arrow("step", steps))


def test_default_pair_is_by_rollout_not_by_name(store):
    now = datetime.now(UTC)
    _sessions(store, "v9", now - timedelta(days=3))
    _sessions(store, "v10", now - timedelta(days=2))
    _sessions(store, "v1-hotfix", now - timedelta(days=1))
    assert [r for r, _ in ts.releases_by_rollout(store, now)] == ["v9", "v10", "v1-hotfix"]
    assert ts.default_pair(store, now, ["v9", "v10", "v1-hotfix"]) == ("v10", "v1-hotfix")
    assert ts.default_pair(store, now, ["v9", "v10"]) == ("v9", "v10")
    assert ts.default_pair(store, now, ["v9"]) == (None, "v9")
    assert ts.default_pair(store, now, []) == (None, None)


def test_annotations_rollouts_switch_changes_incidents(store):
    now = datetime.now(UTC).replace(microsecond=0)  # the store keeps milliseconds: window bounds compare exactly
    start = now - timedelta(days=7)
    _sessions(store, "v1", now - timedelta(days=30))  # before the range: no mark
    _sessions(store, "v2", now - timedelta(days=2))
    board = get_switchboard(store, 0)
    board.set("fused_allreduce", False, "release=v2", actor="alert:alertmanager", reason="late chunks")
    board.set("fused_allreduce", False, "release=v2", actor="op", reason="again")  # a no-op: not a change
    from api.incidents import sync

    week = now - timedelta(days=1)
    f = finding("memory_growth", {"release": "v2"}, "bytes_per_shape", week - timedelta(days=1), week, value=1e9,
                severity="critical", attribution="fused_allreduce")
    write_findings(store, "memory", week - timedelta(days=1), week, [f])
    sync(store)  # the finding opens an incident
    write_findings(store, "memory", week - timedelta(days=1), week, [])  # the next run no longer finds it
    sync(store, resolve_after=timedelta(0))  # no evidence left: resolved (without the hold a daily detector needs)
    marks = ts.annotations(store, start, now + timedelta(minutes=5))
    kinds = [m.kind for m in marks]
    assert kinds.count("rollout") == 1 and marks[kinds.index("rollout")].text == "rollout v2"
    switch = [m for m in marks if m.kind == "switch"]
    assert switch[0].text == "fused_allreduce off (release=v2) by alert:alertmanager"  # (the incident may act too)
    assert kinds.count("incident_open") == 1 and kinds.count("incident_close") == 1
    assert marks[kinds.index("incident_open")].text == "incident opened: memory_growth release=v2 (fused_allreduce)"
    assert marks[kinds.index("incident_close")].text == "incident closed: memory_growth release=v2 (fused_allreduce)"
    assert marks == sorted(marks, key=lambda m: m.ts)
    assert [m.kind for m in ts.annotations(store, start, now, releases=["v9"])].count("rollout") == 0


def test_series_values(store):
    now = datetime.now(UTC).replace(hour=12)
    _sessions(store, "v2", now - timedelta(days=1), n=3)  # 3 sessions x 10 steps of 160 ms, 1 late each
    end = now + timedelta(hours=1)
    late = ts.series_frame(store, ts.SERIES_BY_NAME["late_chunks"], now - timedelta(days=3), end)
    assert late["late"].to_list() == [3] and late["late_share"].to_list() == pytest.approx([0.1])
    fps = ts.series_frame(store, ts.SERIES_BY_NAME["fps_fractions"], now - timedelta(days=3), end)
    assert fps["session_count"].to_list() == [3]
    assert fps["le_24fps"].to_list() == [0.0]  # 4 frames / 160 ms = 25 fps
    period = ts.series_frame(store, ts.SERIES_BY_NAME["step_period"], now - timedelta(days=3), end)
    assert period["p50"].to_list() == pytest.approx([160.0])
    assert ts.series_frame(store, ts.SERIES_BY_NAME["late_chunks"], now - timedelta(days=3), end,
                           releases=["other"]).height == 0


def test_session_switch_changes_and_throttle_names():
    steps = pl.DataFrame({"step": [0, 1, 2, 3], "switches": ["a,b", "a,b", "a", "a,c"]})
    assert ts.session_switch_changes(steps) == [(2, "-b"), (3, "+c")]
    assert ts.throttle_names(0) == "" and ts.throttle_names(None) == ""
    assert ts.throttle_names(0x4 | 0x40) == "sw_power_cap,hw_thermal"
    assert ts.throttle_names(0x1000) == "0x1000"


@pytest.mark.parametrize("v,unit,text", [
    (166.6667, "ms", "166.7 ms"), (12_500.0, "ms", "12.5 s"), (0.25, "s", "250 ms"), (90.0, "s", "90 s"),
    (1536, "bytes", "1.5 KiB"), (3 * 2**30, "bytes", "3 GiB"), (512, "bytes", "512 B"), (1980, "MHz", "1.98 GHz"),
    (0.0231, "ratio", "2.31 %"), (23.94, "fps", "23.94 fps"), (350.2, "W", "350 W"), (None, "ms", ""),
    (float("nan"), "ms", "n/a"), (0.5, "", "0.5"), (7, "", "7"),
])
def test_human(v, unit, text):
    assert human(v, unit) == text


def test_unit_of_column_names():
    assert [unit_of(c) for c in ("step_period_ms", "mem_reserved_max_bytes", "mean_fps", "frac_le_24fps", "late_rate",
                                 "power_w", "sm_clock_mhz", "sessions")] == \
        ["ms", "bytes", "fps", "ratio", "ratio", "W", "MHz", ""]
