"""The demo's steps 2-6 (api/demo.py): simulated fleet history -> analytics -> one incident per root cause
(a signed notification, one flip at its scope) -> a live tiny worker applies the flip at its next step
boundary -> this week's report."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from api.demo_server import DemoServer, Receiver


def title(text: str) -> None:
    print(f"\n{text}")


# -- step 6: the loop closed: history, finding, webhook, switch off, a live worker picks it up ---
_LIVE_CAP_S = 600.0  # the live session never runs longer than --live-seconds + this


def _handed_source():
    from worker.switches import HttpSource

    class HandedSource(HttpSource):
        """The live worker's switch source, noting the version of the last state it handed the session."""

        handed_version = None

        def poll(self, step: int):
            got = super().poll(step)
            if got is not None:
                self.handed_version = self.version
            return got

    return HandedSource


def _HandedSource(*args, **kw):
    return _handed_source()(*args, **kw)


def rollback_story(server: DemoServer, token: str | None, weeks: float, live_seconds: float,
                   receiver: Receiver | None = None) -> dict[str, Any]:
    """Simulated history with the August incident -> analytics -> incidents (one per root cause, one
    signed notification, one flip at its scope) -> a live tiny worker applies the flip at its next step
    boundary -> the week's report shows it."""
    import httpx

    from analytics import queries as aq
    from analytics.cli import print_findings
    from analytics.jobs import run_all
    from analytics.queries import iso_week_of
    from analytics.simulate import simulate_fleet
    from api.report import build_weekly_report
    from collector.client import TelemetryClient
    from worker.config import Switches
    from worker.session import run_session

    store = server.store
    title(f"2. {weeks:g} weeks of fleet history through the collector: a sync-bug release, then the "
           "August incident (a fused kernel that keeps a buffer per prompt length; on its b200 workers the static "
           "FP8 scales drift into saturation)")
    t0 = time.monotonic()
    client = TelemetryClient(server.url, token=token, batch_rows=5000, flush_interval_s=0.2,
                             max_queue=2_000_000)
    sim = simulate_fleet(client, weeks=weeks, incidents=[("sync", 2), ("august", weeks * 7 - 4)], seed=1,
                         workers=8, progress=False, fp8_drift=("august", "b200"))
    client.close(timeout_s=120)
    wait_until(lambda: server.app.state.spool.depth == 0, 120)  # every acked batch is in ClickHouse
    n_steps = aq.step_count(store, simulated=True)
    print(f"  {n_steps:,} simulated steps from {len(sim.workers)} workers, releases "
          + ", ".join(f"{r.name} ({r.kind})" for r in sim.releases)
          + f"; shipped in {time.monotonic() - t0:.1f} s, dropped {client.dropped}")
    leaking = sim.release("august").name

    title(f"3. a live tiny worker of release {leaking}, every optimization on, polling /v1/switches")
    source = _HandedSource(server.url, "live-demo", leaking, "cpu", interval_s=0.5)
    box: dict[str, Any] = {}
    told: dict[str, Any] = {}  # the switch state's version once the story's flips are decided (step 5)
    t_live = time.monotonic()

    def enough() -> bool:
        """At least ``live_seconds``, and on until the session was handed the switches decided by the story
        (a loaded machine runs the analytics slower than the session: a fixed length raced the flip)."""
        return (time.monotonic() - t_live >= live_seconds and "version" in told
                and source.handed_version == told["version"])

    live = threading.Thread(target=lambda: box.update(summary=run_session(
        "tiny", seconds=live_seconds + _LIVE_CAP_S, collector_url=server.url, token=token,
        switches=Switches.all_on(), switch_source=source, release=leaking, worker_id="live-demo",
        stop_when=enough)), name="live-worker", daemon=True)
    live.start()
    wait_until(lambda: aq.step_count(store, worker_id="live-demo") > 3, 60)
    print(f"  streaming: session of worker live-demo, switches {Switches.all_on().encode()}")

    title("4. the analytics jobs (as the scheduler runs them): findings")
    findings = run_all(store, now=datetime.now(UTC))
    notable = sorted((f for f in findings if f["severity"] in ("warning", "critical")),
                     key=lambda f: (f["severity"] != "critical", f["kind"] not in ("memory_growth", "fp8_saturation"),
                                    f["scope"]))
    print_findings(notable[:14])
    if len(notable) > 14:
        print(f"  ... and {len(notable) - 14} more warning/critical findings ({len(findings)} in all): "
              "/dashboard/findings")
    critical = [f for f in findings if f["severity"] == "critical" and f["attribution"]]

    title("5. findings -> incidents (one per root cause) -> one notification and one flip each")
    from api.incidents import list_incidents

    for inc in sorted(list_incidents(store), key=lambda i: (i["switch"] == "", i["key"])):
        act = (f"{inc['switch']} off for {inc['scope']}" if inc["flips"] else
               "no switch explains it: alert only" if not inc["switch"] else "not critical: alert only")
        print(f"  [{inc['state']}] {inc['kind']} {inc['scope']}: {inc['evidence_count']} finding(s) as evidence, "
              f"{inc['notifications']} notification(s), {inc['flips']} flip(s) ({act})")
        print(f"      {inc['summary'][:160]}")
    if receiver is not None:
        print(f"  the receiver ({receiver.url}) got {len(receiver.got)} signed notification(s): "
              + ", ".join(f"{n['incident']['kind']} {n['incident']['scope']} {n['incident']['state']}"
                          for n in receiver.got))
    decided = aq.applied_changes(store)
    for ts, name, scope, source_, actor, why in decided:
        print(f"  {ts:%H:%M:%S} {name} off for {scope} (by {actor} via {source_}): {why[:160]}")
    told["version"] = httpx.get(source.endpoint, params=source.params, timeout=30,
                                headers={"Authorization": f"Bearer {token}"} if token else {}).json().get("version")
    live.join(live_seconds + _LIVE_CAP_S + 60)
    summary = box.get("summary")
    applied = [e for e in (summary.switch_events if summary else []) if e.get("changed")]
    for e in applied:
        print(f"  live-demo applied {e['changed']} at step {e['step']} (a step boundary; the session went on)")
    if summary is not None:
        print(f"  live-demo session: {summary.steps} steps, late chunks {summary.late_chunks}; the tiny model "
              f"generates {summary.avg_fps or 0:.0f} fps on this CPU (the player takes 24); "
              f"switches at the end: {summary.switches or '(none)'}")

    title("6. this week's regression report")
    week = iso_week_of(datetime.now(UTC))
    reports_dir = Path(server.app.state.settings.reports_dir)
    html, js = build_weekly_report(store, week, reports_dir)
    print(f"  {html}\n  {js}")
    return {"findings": findings, "critical": critical, "applied": bool(applied), "report": html}


def wait_until(fn, timeout_s: float, every_s: float = 0.1):
    end = time.monotonic() + timeout_s
    while True:
        v = fn()
        if v or time.monotonic() > end:
            return v
        time.sleep(every_s)
