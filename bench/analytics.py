"""Analytics at fleet scale: the weekly job's wall time and the p95 of the dashboard's fleet queries.

    python bench/analytics.py                                  # 1,000,000 sessions, ~100M step rows
    python bench/analytics.py --sessions 100000 --steps-per-session 100 --dsn chdb:///tmp/bench-small
    python bench/analytics.py --reuse --dsn chdb:///tmp/livestep-bench    # measure an existing store

Fills an embedded store (chDB) through the simulator's bulk path (``simulate_fleet`` on a Store:
Arrow blocks of ``--block-steps`` rows into ``Store.insert_arrow``; the ``session_stats`` view
fills as rows land), then measures:
- the weekly job (``run_job('weekly_fps')`` for the busiest ISO week: the fps fractions over
  ``session_stats`` + Wilson intervals + findings write), and with the weekly report
  (``api.report``, registered as the analytics' report writer) of the same week; goal <= 30 s;
- the dashboard's fleet queries (``queries.fps_fractions`` over the whole window and
  ``queries.release_distribution``), ``--repeat`` runs each, p50/p95; goal p95 <= 150 ms;
- the baselines, in the same run: the same weekly fractions computed from raw step rows (GROUP BY
  session over ``steps``), which the materialized view exists to avoid; and the fleet query with every
  day grouped per session live (``live=True``), which the ``fleet_daily`` roll-up exists to avoid.
Prints a table; the last line is the ratio against the baseline.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analytics import jobs, queries
from analytics.simulate import STEP_BUDGET_MS, simulate_fleet
from collector.store import open_store

GOAL_WEEKLY_S = 30.0
GOAL_P95_MS = 150.0

RAW_WEEKLY_SQL = """
SELECT toMonday(start_ts) AS week, release, gpu_kind, count() AS sessions,
       countIf(fps <= 24) AS n_le_24, countIf(fps <= 23.5) AS n_le_23_5
FROM (
    SELECT release, gpu_kind, session_id, min(ts) AS start_ts, sum(toFloat64(step_period_ms)) / 1000 AS streamed_s,
           count() * 4 / greatest(streamed_s, 1e-9) AS fps
    FROM steps
    WHERE ts >= {start:DateTime64(3, 'UTC')} - INTERVAL 1 DAY AND ts < {end:DateTime64(3, 'UTC')} + INTERVAL 1 DAY
    GROUP BY release, gpu_kind, session_id
    HAVING start_ts >= {start:DateTime64(3, 'UTC')} AND start_ts < {end:DateTime64(3, 'UTC')}
)
WHERE streamed_s >= 1
GROUP BY week, release, gpu_kind
"""


def timed(fn, *a, **kw) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn(*a, **kw)
    return time.perf_counter() - t, out


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(0.95 * len(xs)) - 1)]


def fill(store, sessions: int, steps_per_session: float, weeks: float, workers: int, block_steps: int, seed: int):
    days = weeks * 7
    # mean steps per session = median duration * exp(sigma^2/2) / step period (sigma = 0.8)
    median_s = steps_per_session * STEP_BUDGET_MS / 1000 / math.exp(0.32)
    spd = sessions / workers / days
    return simulate_fleet(
        store, weeks=weeks, workers=workers, sessions_per_day=spd, session_median_s=median_s,
        incidents=[("august", days * 0.3), ("fix", days * 0.55), ("sync", days * 0.75), ("benign", days * 0.9)],
        seed=seed, block_steps=block_steps, progress=True,
        end=datetime.now(UTC).replace(minute=0, second=0, microsecond=0),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", default="chdb:///tmp/livestep-bench-analytics")
    ap.add_argument("--sessions", type=int, default=1_000_000)
    ap.add_argument("--steps-per-session", type=float, default=100.0)
    ap.add_argument("--weeks", type=float, default=4.0)
    ap.add_argument("--workers", type=int, default=600)
    ap.add_argument("--block-steps", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--reuse", action="store_true", help="measure the store as it is (no generation)")
    args = ap.parse_args(argv)

    store = open_store(args.dsn)
    store.migrate()
    gen_s = None
    if not args.reuse:
        for t in ("steps", "sessions", "events", "session_stats", "findings", "job_runs", "fleet_daily",
                  "fleet_daily_marks"):
            store.command(f"TRUNCATE TABLE IF EXISTS {t}")
        gen_s, _ = timed(fill, store, args.sessions, args.steps_per_session, args.weeks, args.workers,
                         args.block_steps, args.seed)
        store.command("OPTIMIZE TABLE session_stats FINAL")  # what background merges do over time
    now = datetime.now(UTC)
    rollup_s, _ = timed(queries.rollup, store, now, True)  # the 10-minute job, first (full) pass
    n_steps = store.query_rows("SELECT count() FROM steps")[0][0]
    n_sessions = store.query_rows("SELECT uniqExact(session_id) FROM sessions")[0][0]
    n_stats = store.query_rows("SELECT count() FROM session_stats")[0][0]
    lo, hi = store.query_rows("SELECT min(first_ts), max(first_ts) FROM session_stats")[0]
    lo, hi = lo.replace(tzinfo=UTC), hi.replace(tzinfo=UTC)
    busiest = store.query_rows("SELECT toMonday(first_ts) AS w, count() AS n FROM session_stats "
                               "GROUP BY w ORDER BY n DESC LIMIT 1")[0][0]
    week = queries.iso_week_of(datetime.combine(busiest, datetime.min.time(), UTC))
    w_start, w_end = queries.iso_week_bounds(week)

    weekly = [timed(jobs.run_job, "weekly_fps", store, week=week)[0] for _ in range(3)]
    report_s = None
    try:
        from api.report import install  # the report's HTML is the api's; register it as the job's writer

        install()
    except ImportError:
        pass
    if jobs._report_available():  # the weekly report (api/report.py) runs in the same Monday slot
        import tempfile

        with tempfile.TemporaryDirectory() as out_dir:
            report_s, _ = timed(jobs.run_job, "weekly_report", store, week=week, out_dir=out_dir)
    raw_s, raw = timed(store.query_df, RAW_WEEKLY_SQL, {"start": w_start, "end": w_end})
    mv = queries.fps_fractions(store, w_start, w_end)
    same = int(raw["sessions"].sum()) == int(mv["sessions"].sum()) and int(raw["n_le_24"].sum()) == int(
        mv["n_le_24"].sum())

    q_end = hi + timedelta(seconds=1)
    fracs = [timed(queries.fps_fractions, store, lo, q_end)[0] for _ in range(args.repeat)]
    dists = [timed(queries.release_distribution, store, lo, q_end)[0] for _ in range(args.repeat)]
    live_fracs = [timed(queries.fps_fractions, store, lo, q_end, live=True)[0] for _ in range(3)]

    print(f"\nanalytics at fleet scale  ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {args.dsn})")
    print(f"store: {n_sessions:,} sessions, {n_steps:,} step rows, session_stats {n_stats:,} rows"
          + (f", generated in {gen_s:.0f} s ({n_steps / gen_s / 1e6:.2f} M rows/s)" if gen_s else ""))
    print(f"{'measure':<52} {'p50':>10} {'p95 / max':>10} {'goal':>9} {'vs goal':>8}")
    print("-" * 93)
    wk = max(weekly)
    print(f"{'weekly job (weekly_fps, ' + week + ', ' + str(int(mv['sessions'].sum())) + ' sessions)':<52} "
          f"{statistics.median(weekly):>9.2f}s {wk:>9.2f}s {GOAL_WEEKLY_S:>8.0f}s {wk / GOAL_WEEKLY_S:>7.3f}x")
    if report_s is not None:
        total = statistics.median(weekly) + report_s
        print(f"{'weekly report (api.report, same week)':<52} {report_s:>9.2f}s {report_s:>9.2f}s")
        print(f"{'weekly job + report':<52} {total:>9.2f}s {total:>9.2f}s {GOAL_WEEKLY_S:>8.0f}s "
              f"{total / GOAL_WEEKLY_S:>7.3f}x")
    for name, xs in (("fleet query: fps fractions (whole window)", fracs),
                     ("fleet query: per-release distribution", dists)):
        print(f"{name:<52} {statistics.median(xs) * 1e3:>8.1f}ms {p95(xs) * 1e3:>8.1f}ms "
              f"{GOAL_P95_MS:>7.0f}ms {p95(xs) * 1e3 / GOAL_P95_MS:>7.3f}x")
    print(f"{'  same, every day grouped per session live':<52} {statistics.median(live_fracs) * 1e3:>8.1f}ms "
          f"{max(live_fracs) * 1e3:>8.1f}ms")
    print(f"{'roll-up of every closed day (10-minute job, full)':<52} {rollup_s:>9.2f}s")
    print(f"{'baseline: same weekly fractions from raw steps':<52} {raw_s:>9.2f}s {raw_s:>9.2f}s "
          f"{'':>9} {'':>8}   (same counts: {same})")
    print(f"ratio: weekly fractions over session_stats vs raw steps (same run): "
          f"{raw_s / statistics.median(weekly):.1f}x faster; fleet fps query rolled-up vs live: "
          f"{statistics.median(live_fracs) / statistics.median(fracs):.1f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
