"""The pages and the weekly report as a reader sees them, in headless Chromium (real uvicorn, chDB):
annotation labels of simultaneous events do not print over each other; a day's point is drawn at the
middle of its day (a flip at 23:31 sits after it); the report shows fractions as percentages and
timestamps as dates, and breaks no word mid-word; a release has one colour in the report and on the
dashboards; the release page compares the newest judged release with the one before it, not a dev
worker's one-session release."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from analytics.queries import iso_week_of
from tests.api import browser
from tests.api.conftest import make_settings, real_app
from tests.api.live import serve
from tests.collector.helpers import migrated_store

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not browser.available(), reason=f"no chromium at {browser.CHROMIUM} "
                       "(Debian: apt-get install chromium; ./dev test installs it)"),
]

# per chart: the marks' label boxes (screen pixels), the traces' x values and colours
CHARTS_JS = """Object.fromEntries(Array.from(document.querySelectorAll('.plotly-graph-div')).map(d => [d.id, {
  boxes: Array.from(d.querySelectorAll('.annotation')).map(a => { const r = a.getBoundingClientRect();
    return {text: a.textContent, l: r.left, r: r.right, t: r.top, b: r.bottom}; }),
  xs: d.data.map(t => (t.x || []).map(String)),
  colors: Object.fromEntries(d.data.map(t => [t.name, (t.line && t.line.color) || (t.marker && t.marker.color)]))}]))"""
REPORT_JS = """({
  cells: Array.from(document.querySelectorAll('td')).map(td => td.textContent),
  wrap: Array.from(new Set(Array.from(document.querySelectorAll('td')).map(td => getComputedStyle(td).overflowWrap))),
  split: Array.from(document.querySelectorAll('td')).flatMap(td => Array.from(td.childNodes)
    .filter(n => n.nodeType === 3).flatMap(n => { const out = []; const re = /[A-Za-z_]{6,}/g; let m;
      while ((m = re.exec(n.data))) { const r = document.createRange(); r.setStart(n, m.index);
        r.setEnd(n, m.index + m[0].length); const lines = new Set(Array.from(r.getClientRects()).map(x => Math.round(x.top)));
        if (lines.size > 1) out.push(m[0]); } return out; })),
  colors: Object.fromEntries(Array.from(document.querySelectorAll('.plotly-graph-div')).flatMap(d =>
    d.data.map(t => [d.id + ':' + t.name, t.marker && t.marker.color])))})"""


@pytest.fixture(scope="module")
def site(tmp_path_factory, chdb_dir):
    from analytics.simulate import simulate_fleet
    from api.report import build_weekly_report
    from api.switchboard import get_switchboard
    from collector import records

    store = migrated_store(chdb_dir)
    sim = simulate_fleet(store, weeks=2, incidents=[("august", 3)], workers=4, sessions_per_day=10,
                         session_median_s=20, seed=7)
    board = get_switchboard(store, 0)
    for name in ("compile", "cuda_graphs"):  # two flips in the same second: simultaneous marks
        board.set(name, False, f"release={sim.releases[-1].name}", actor="op", reason="test")
    # a dev worker's release, one session, rolled out last
    now = datetime.now(UTC).replace(microsecond=0)
    labels = {"worker_id": "dev-w", "session_id": "dev-s", "release": "dev", "gpu_kind": "cpu"}
    store.insert_arrow("sessions", records.to_arrow("session", [{
        **labels, "ts": now - timedelta(minutes=30), "phase": "start", "first_forward_tokens": 8, "streamed_s": 0.0,
        "frames": 0, "avg_fps": None, "late_chunks": 0, "stall_ms": 0.0, "tp_size": 1, "shape": "tiny",
        "switches": ""}]))
    store.insert_arrow("steps", records.to_arrow("step", [{
        **labels, "ts": now - timedelta(minutes=30) + timedelta(seconds=k), "step": k, "diffusion_ms": 100.0,
        "step_period_ms": 160.0, "decode_ms": None, "cache_upkeep_ms": None, "attention_ms": None,
        "allreduce_ms": None, "late": False, "playout_depth": 2, "reset_step": False, "energy_mj": None,
        "mem_allocated_bytes": 1, "mem_reserved_bytes": 1, "buffers_registered": 0, "switches": ""}
        for k in range(12)]))
    settings = make_settings(tmp_path_factory.mktemp("pages"))
    week = iso_week_of(now - timedelta(days=7))
    build_weekly_report(store, week, settings.reports_dir)
    app = real_app(store, settings)
    with serve(app) as base, browser.Chromium() as chromium:
        yield base, week, sim, chromium
    store.command(f"DROP DATABASE IF EXISTS {store.database}")


def _overlap(a, b) -> bool:
    return a["l"] < b["r"] - 1 and b["l"] < a["r"] - 1 and a["t"] < b["b"] - 1 and b["t"] < a["b"] - 1


def test_simultaneous_marks_do_not_overprint_and_day_points_sit_mid_day(site):
    base, _, _, chromium = site
    res = chromium.load(f"{base}/dashboard/", wait_for=CHARTS_JS)
    assert res.errors == [], res.errors
    period = res.probe["fleet-step_period"]
    marks = [b for b in period["boxes"] if " off (" in b["text"]]
    assert len(marks) == 2, period["boxes"]  # compile off and cuda_graphs off, same instant
    boxes = period["boxes"]
    clashes = [(a["text"], b["text"]) for i, a in enumerate(boxes) for b in boxes[i + 1:] if _overlap(a, b)]
    assert clashes == []
    xs = [x for trace in period["xs"] for x in trace]
    assert xs and all("12:00" in x for x in xs), xs[:5]  # the middle of each day


def test_one_colour_per_release_in_the_report_and_on_the_dashboards(site):
    base, week, _, chromium = site
    fleet = chromium.load(f"{base}/dashboard/", wait_for=CHARTS_JS).probe
    report = chromium.load(f"{base}/v1/reports/{week}.html", wait_for=REPORT_JS).probe
    dash = fleet["fleet-late_chunks"]["colors"]
    rep = {k.split(":", 1)[1]: v for k, v in report["colors"].items() if k.startswith("r-fps:")}
    shared = set(dash) & set(rep)
    assert shared, (dash, rep)
    assert {r: dash[r] for r in shared} == {r: rep[r] for r in shared}
    assert len(set(rep.values())) == len(rep)  # the releases of the report differ in colour


def test_weekly_report_reads_as_text(site):
    base, week, _, chromium = site
    res = chromium.load(f"{base}/v1/reports/{week}.html", wait_for=REPORT_JS)
    assert res.errors == [], res.errors
    cells = res.probe["cells"]
    import re

    assert not [c for c in cells if re.fullmatch(r"0\.\d+ fps", c.strip())]  # a fraction is not a frame rate
    assert any(re.fullmatch(r"\d+(\.\d+)? %", c.strip()) for c in cells), cells[:20]
    assert not [c for c in cells if re.search(r"\d{2}:\d{2}:\d{2}(\.\d+)?\+00:00", c)]  # raw timestamps
    assert any(re.fullmatch(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC", c.strip()) for c in cells)
    assert "anywhere" not in res.probe["wrap"]
    assert res.probe["split"] == []  # no word of six letters or more broken over two lines


def test_release_page_compares_the_newest_judged_release_with_the_one_before(site):
    base, _, sim, _ = site
    import httpx

    html = httpx.get(f"{base}/dashboard/releases").text
    newest, before = sim.releases[-1].name, sim.releases[-2].name
    assert f"{newest} against {before}" in html
    assert "dev against" not in html
