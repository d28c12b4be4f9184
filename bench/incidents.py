"""Incidents on the demo's history: notifications and flips per incident, audit rows a day, re-enable reach.

    python bench/incidents.py                 # the demo's history (2 weeks, 8 workers, sync bug + August leak)
    python bench/incidents.py --weeks 1 --workers 6

Builds the history ``./dev demo`` ships through the collector (``simulate_fleet`` with the sync-bug
release on day 2, the August leak 4 days before the end, FP8 drift on its b200 workers) straight into
a fresh embedded store, runs every analytics job once with the incident hand-off (what the scheduler
does), then measures:
- notifications per incident and flips per incident (goal 1 each for the August leak);
- audit rows a day for the August incident left open: 24 hourly re-runs of the memory job and their
  hand-offs, counting its ``incident_log`` rows and the ``switch_audit`` rows they add
  (goal <= 24 / repeat interval in hours, + the opening's rows);
- the share of the leaking release's workers a release-wide re-enable reaches (goal 100 %).
The baselines, in the same run, are the paths this replaced, computed from the same findings: one
webhook post per open critical attributed finding (the old notifier), one flip per distinct
(switch, scope) among them (the old webhook's per-process rules), the ``alert_duplicate`` audit row
per such finding per hourly re-run, and the re-enable's reach under the old "most specific rule wins"
precedence on the rules that path wrote. Prints a table; the last line is the ratio against the
baseline.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analytics import jobs
from analytics.simulate import simulate_fleet
from api import incidents
from api.switchboard import get_switchboard, parse_scope
from collector.store import open_store


def old_reach(rules: list[tuple[str, bool, int]], workers: list[str], release: str) -> float:
    """Share of workers the newest rule gives True under the old precedence (more scope keys first,
    then the newer): rules are (scope, value, version)."""
    on = 0
    for w in workers:
        labels = {"release": release, "worker_id": w}
        match = [(len(parse_scope(s)), v, val) for s, val, v in rules
                 if all(labels.get(k) == x for k, x in parse_scope(s).items())]
        if match and max(match)[2]:
            on += 1
    return on / len(workers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weeks", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeat-hours", type=float, default=4.0, help="the incident repeat interval")
    a = ap.parse_args(argv)

    t0 = time.monotonic()
    store = open_store(f"chdb://{tempfile.mkdtemp(prefix='livestep-bench-incidents-')}?database=bench")
    store.migrate()
    sim = simulate_fleet(store, weeks=a.weeks, incidents=[("sync", 2), ("august", a.weeks * 7 - 4)], seed=a.seed,
                         workers=a.workers, progress=False, fp8_drift=("august", "b200"))
    leaking = sim.release("august").name
    repeat_s = a.repeat_hours * 3600
    handoff = incidents.Handoff(store, None, repeat_s)
    jobs.add_findings_listener(handoff)
    try:
        findings = jobs.run_all(store, now=sim.end)
        posted = [f for f in findings if f["severity"] == "critical" and f["attribution"]]
        aug_posted = [f for f in posted if f["kind"] == "memory_growth" and f["scope"].startswith(f"release={leaking}")]
        old_rules = sorted({(f["attribution"], f["scope"]) for f in aug_posted})
        aug = next(i for i in incidents.list_incidents(store) if i["key"] == f"memory_growth|release={leaking}|fused_allreduce")
        opened = incidents.incident_log(store, aug["id"])
        audit0 = store.query_rows("SELECT count() FROM switch_audit WHERE ref = {r:String}", {"r": aug["id"]})[0][0]
        # a day left open: the memory job every hour and its hand-off
        for h in range(1, 25):
            jobs.run_job("memory", store, now=sim.end)
            incidents.sync(store, now=sim.end + timedelta(hours=h), repeat_s=repeat_s)
        day_log = [e for e in incidents.incident_log(store, aug["id"]) if e not in opened]
        audit1 = store.query_rows("SELECT count() FROM switch_audit WHERE ref = {r:String}", {"r": aug["id"]})[0][0]
        aug = next(i for i in incidents.list_incidents(store) if i["id"] == aug["id"])
        # the fix: a release-wide re-enable, polled by every worker of the release
        board = get_switchboard(store, 0)
        board.set("fused_allreduce", True, f"release={leaking}", actor="bench", reason="fixed")
        workers = sorted({w.worker_id for w in sim.workers})
        reached = sum(board.resolve(w, leaking)[0].get("fused_allreduce") is True for w in workers) / len(workers)
        old = old_rules and old_reach([(s, False, i) for i, (_, s) in enumerate(old_rules)]
                                      + [(f"release={leaking}", True, len(old_rules))], workers, leaking)
    finally:
        jobs.remove_findings_listener(handoff)

    rows = [
        ("notifications per incident (August leak)", aug["notifications"] - sum(e["event"] == "repeat" for e in day_log),
         len(aug_posted), "1"),
        ("flips per incident (August leak)", aug["flips"], len(old_rules), "1"),
        ("audit rows in a day, incident left open", len(day_log) + audit1 - audit0, 24 * len(aug_posted),
         f"<= {24 / a.repeat_hours:g}"),
        ("share of the release's workers a re-enable reaches", f"{100 * reached:.0f}%", f"{100 * old:.0f}%", "100%"),
    ]
    print(f"history: {a.weeks:g} weeks, {len(workers)} workers, {len(findings)} findings, "
          f"{len(incidents.list_incidents(store, limit=1000))} incidents; {time.monotonic() - t0:.0f} s")
    w = max(len(r[0]) for r in rows)
    print(f"{'figure':<{w}}  {'incidents':>10}  {'old path':>9}  goal")
    for name, new, base, goal in rows:
        print(f"{name:<{w}}  {new!s:>10}  {base!s:>9}  {goal}")
    ratio = (len(day_log) + audit1 - audit0) / max(24 * len(aug_posted), 1)
    print(f"ratio: audit rows a day {ratio:.3f}x the old path's; flips per incident {aug['flips']}/{len(old_rules)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
