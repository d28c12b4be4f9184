"""The time-series charts in headless Chromium (real uvicorn, chDB): the fleet and release pages draw the
step period against the 166.7 ms deadline, late chunks and fps fractions per day, with the range's
release rollouts, switch changes and incidents opened and closed; the session page draws the deadline,
the session's switch changes and its GPU samples (power, SM clock, throttle reasons)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import pytest

from tests.api import browser
from tests.api.conftest import bare_app, make_settings
from tests.api.live import serve
from tests.collector.helpers import migrated_store

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not browser.available(), reason=f"no chromium at {browser.CHROMIUM} "
                       "(Debian: apt-get install chromium; ./dev test installs it)"),
]

# every chart's shapes and annotations, by div id, as plotly holds them after rendering
LAYOUT_JS = """Object.fromEntries(Array.from(document.querySelectorAll('.plotly-graph-div')).map(d => [d.id, {
  shapes: (d.layout.shapes || []).map(s => ({name: s.name, y0: s.y0, x0: s.x0})),
  texts: (d.layout.annotations || []).map(a => a.text),
  traces: d.data.length, svg_lines: d.querySelectorAll('.shapelayer path').length}]))"""


@pytest.fixture(scope="module")
def site(tmp_path_factory, chdb_dir):
    from analytics.findings import finding, write_findings
    from analytics.simulate import simulate_fleet
    from api.switchboard import get_switchboard
    from collector import records

    store = migrated_store(chdb_dir)
    sim = simulate_fleet(store, weeks=1, incidents=[("august", 3)], workers=4, sessions_per_day=8,
                         session_median_s=20, seed=5)
    leaking = sim.releases[-1].name
    get_switchboard(store, 0).set("fused_allreduce", False, f"release={leaking}", actor="alert:alertmanager",
                                  reason="late chunks")
    now = datetime.now(UTC).replace(microsecond=0)
    w0, w1 = now - timedelta(days=2), now - timedelta(days=1)
    write_findings(store, "memory", w0, w1, [finding("memory_growth", {"release": leaking}, "bytes_per_shape", w0, w1,
                                                     value=1e9, severity="critical", attribution="fused_allreduce")])
    from api.incidents import sync

    sync(store)  # the critical finding opens an incident (api/incidents.py)
    write_findings(store, "memory", w0, w1, [])  # resolved by the next run
    sync(store, resolve_after=timedelta(0))  # and so is its incident (without the hold a daily detector needs)
    # one live session: a switch turned off mid-way, GPU samples with a power-cap throttle
    sid, t0 = "ts-session", now - timedelta(hours=1)
    labels = {"worker_id": "w9", "session_id": sid, "release": leaking, "gpu_kind": "h200"}
    steps = [{**labels, "ts": t0 + timedelta(milliseconds=167 * k), "step": k, "diffusion_ms": 120.0 + k % 7,
              "step_period_ms": 150.0 + 30 * (k % 9 == 0), "decode_ms": None, "cache_upkeep_ms": 3.0,
              "attention_ms": None, "allreduce_ms": None, "late": k % 9 == 0, "playout_depth": 2, "reset_step": False,
              "energy_mj": None, "mem_allocated_bytes": 2**30, "mem_reserved_bytes": 2**31, "buffers_registered": 1,
              "switches": "fused_allreduce,ring_cache,rope_at_write" if k < 30 else "ring_cache,rope_at_write"}
             for k in range(60)]
    store.insert_arrow("steps", records.to_arrow("step", steps))
    samples = [{**labels, "ts": t0 + timedelta(milliseconds=100 * k), "gpu_index": 0, "power_w": 600.0 + k,
                "energy_mj": 1e6 + 60_000 * k, "sm_clock_mhz": 1980 - 10 * (k > 50), "mem_used_bytes": 2**34,
                "temp_c": 60.0, "throttle_reasons": 0x4 if k > 50 else 0} for k in range(100)]
    store.insert_arrow("gpu_samples", records.to_arrow("gpu_sample", samples))
    app = bare_app(store, make_settings(tmp_path_factory.mktemp("ts")))
    with serve(app) as base, browser.Chromium() as chromium:
        yield base, sid, leaking, chromium
    store.command(f"DROP DATABASE IF EXISTS {store.database}")


def _load(chromium, url):
    res = chromium.load(url, wait_for=LAYOUT_JS)
    assert res.errors == [], (url, res.errors)
    assert res.charts > 0 and res.rendered == res.charts, (url, res)
    return res.probe


def test_fleet_page_series_with_deadline_and_annotations(site):
    base, _, leaking, chromium = site
    charts = _load(chromium, f"{base}/dashboard/")
    period = charts["fleet-step_period"]
    assert {"name": "threshold", "y0": pytest.approx(166.6667, abs=1e-3), "x0": 0} in \
        [{**s, "y0": pytest.approx(s["y0"], abs=1e-3) if s["y0"] is not None else None} for s in period["shapes"]]
    assert period["traces"] >= 2 and period["svg_lines"] >= len(period["shapes"]) > 1
    texts = " | ".join(period["texts"])
    assert "deadline 166.7 ms" in texts
    assert f"rollout {leaking}" in texts
    assert f"fused_allreduce off (release={leaking}) by alert:alertmanager" in texts
    assert "incident opened: memory_growth" in texts and "incident closed: memory_growth" in texts
    kinds = {s["name"] for s in period["shapes"]}
    assert kinds >= {"threshold", "rollout", "switch", "incident_open", "incident_close"}
    for name in ("fleet-late_chunks", "fleet-fps_fractions"):
        assert charts[name]["traces"] >= 1 and "rollout" in {s["name"] for s in charts[name]["shapes"]}


def test_range_picker_narrows_the_range(site):
    base, _, _, chromium = site
    html = httpx.get(f"{base}/dashboard/").text
    assert 'type="datetime-local" name="start"' in html and ">7 d</a>" in html
    end = datetime.now(UTC) + timedelta(minutes=5)
    start = end - timedelta(hours=3)  # no rollout in the last three hours
    charts = _load(chromium, f"{base}/dashboard/?start={start:%Y-%m-%dT%H:%M}&end={end:%Y-%m-%dT%H:%M}")
    names = {s["name"] for s in charts["fleet-step_period"]["shapes"]}
    assert "rollout" not in names and "threshold" in names
    r = httpx.get(f"{base}/dashboard/", params={"start": "2026-01-02", "end": "2026-01-01"})
    assert r.status_code == 422 and "must be before" in r.json()["detail"]


def test_release_page_defaults_to_the_previous_release_by_rollout(site):
    base, _, leaking, chromium = site
    html = httpx.get(f"{base}/dashboard/releases").text
    assert f"{leaking} against " in html
    charts = _load(chromium, f"{base}/dashboard/releases")
    period = charts["release-step_period"]
    assert "threshold" in {s["name"] for s in period["shapes"]}
    assert period["traces"] == 4  # two releases x (p50, p99)


def test_session_page_deadline_switch_changes_gpu_samples(site):
    base, sid, _, chromium = site
    charts = _load(chromium, f"{base}/dashboard/sessions/{sid}")
    times = charts["session-times"]
    assert {s["name"] for s in times["shapes"]} == {"threshold", "switch"}
    assert [s["x0"] for s in times["shapes"] if s["name"] == "switch"] == [30]
    assert "switches -fused_allreduce" in " ".join(times["texts"])
    gpu = charts["session-gpu"]
    assert gpu["traces"] == 3  # power, SM clock, throttled markers
    html = httpx.get(f"{base}/dashboard/sessions/{sid}").text
    assert "throttle reasons seen: sw_power_cap" in html and "100 samples" in html
