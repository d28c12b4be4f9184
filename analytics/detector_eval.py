"""``livestep evaluate-detectors``: the detectors' recall, scope and false alarms on a catalog of incidents
with known answers (a benchmark, not a test: it prints figures, it asserts nothing).

    livestep evaluate-detectors --seeds 20                  # the whole catalog, 20 seeds each
    livestep evaluate-detectors --seeds 3 --only leak_resolution,benign
    livestep evaluate-detectors --only leak_prompt_tight --reserved-jitter 64   # a noisier fleet (MiB, sd)

Each (incident class, seed) simulates a fleet (``analytics.simulate``, the CI-sized fleet of the
analytics tests) with the incident's release rolling out on ``ONSET_DAY``, then runs the detectors as
the scheduler would (each over its own trailing window, ``analytics.jobs.window``) at a ladder of times
after the onset (``LADDER_H``). Per class it knows the answer:

- which detector must find it, with which scope (release; the GPU kinds; for a leak the shape key
  that explains it, for the August leak the switch to blame) and, for some, the severity;
- benign classes (a release with no change, no release at all, twice the step-time variance with the
  same median) must raise nothing that acts (a warning or critical finding of memory, regressions,
  change points or drift) — their false alarms; the variance detector's info note is expected only
  where the class says so.

Printed per detector and per class: recall (found at some rung), scope right (of the found: the
release, no GPU kind outside the incident's, the leak's key), attribution right (where the class has one:
every finding of it names the switch, e.g. one per GPU kind),
median hours from onset to the first finding, and false alarms. Scope is judged at the first rung
that finds it, except a memory finding whose key is ambiguous (``key_confident`` false: the store does
not yet hold the sessions that tell its explanations apart): it counts for recall, time, attribution
and severity, and its key is judged at the first later rung whose finding commits to one ("h to scope";
"ambiguous 1st": the share found ambiguous at first). Attribution likewise: at the first rung whose
findings all commit (``attribution_state`` 'blamed' or 'none explains'; a 'tie' or 'waiting' for
sessions to contrast does not), else at the last rung as it stands ("h to attrib"). An ambiguous key is never scored right, however
its candidates are listed; a key named confidently and wrong is wrong, whatever later rungs say; a
finding that stays ambiguous, or is gone at a later rung, is not right. The catalog's answers are what the simulator injects; every detector judges only
what the store holds.
"""

from __future__ import annotations

import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from analytics.detector_table import summarize

ONSET_DAY = 6.0
WEEKS = 2.5
LADDER_H = (24, 72, 240)  # hours after the onset at which the detectors run
FLEET = {"workers": 9, "sessions_per_day": 48, "session_median_s": 10.0, "progress": False}
ACTING = ("memory", "regressions", "changepoints", "drift")


def sim_end(seed: int, now: datetime | None = None) -> datetime:
    """The seed's fleet ends at its own hour of the day (7 x seed mod 24: every phase of the day
    boundaries, by seed) on a fixed weekday (``analytics.simulate.pinned_end``), whenever it runs."""
    from analytics.simulate import pinned_end

    return pinned_end((7 * seed) % 24, now)


@dataclass(frozen=True)
class Case:
    """One incident class and its known answer."""

    name: str
    incident: str | None  # the simulator's incident (None: no release at all)
    detector: str | None  # the detector that must find it (None: benign)
    metric: str = ""  # the finding's metric (prefix) that counts
    kinds: str = "all"  # GPU kinds in scope: 'all' or one kind
    key: str = ""  # memory: the shape key (or 'per session') that explains it
    attribution: str = ""  # the switch to blame, where the class has one
    severity: str = ""  # the severity it must reach ('' : any)
    note: str = ""  # a detector whose info note is expected (variance)
    generator: str = "simulate"  # or "holdout": analytics.holdout's fleet (analytics/holdout_eval.py)
    condition: str = ""  # text the finding must name (its evidence's condition, attribution or sentence)
    onset_day: float = 0.0  # holdout: the scenario's onset (0: holdout_eval.ONSET_DAY)
    ladder_h: tuple[int, ...] = ()  # holdout: hours after the onset to run at (empty: holdout_eval.LADDER_H)


CATALOG: tuple[Case, ...] = (
    Case("leak_prompt", "leak_prompt", "memory", key="first_forward_tokens"),
    Case("leak_prompt_tight", "leak_prompt_tight", "memory", key="first_forward_tokens", severity="critical"),
    Case("leak_resolution", "leak_resolution", "memory", key="decoder_resolution"),
    Case("leak_session", "leak_session", "memory", key="per session"),
    Case("august", "august", "memory", key="first_forward_tokens", attribution="fused_allreduce",
         severity="critical"),
    Case("sync", "sync", "regressions", metric="step_period_ms"),
    Case("sync_h100", "sync:h100", "regressions", metric="step_period_ms", kinds="h100"),
    Case("sync_compile_cohort", "sync:compile", "regressions", metric="step_period_ms", attribution="compile"),
    Case("step_change_b200", "sync:b200", "changepoints", metric="step_period_ms_p50", kinds="b200"),
    Case("drift", "drift", "drift", metric="cache_upkeep_ms_p50"),
    Case("benign_release", "benign", None),
    Case("benign_no_release", None, None),
    Case("benign_variance", "variance", None, note="variance"),
    # hold-out classes (analytics/holdout.py: not the simulator's fleet; real device names through ingest)
    Case("hold_power_capped", "power_capped", "power", metric="sm_clock_mhz", kinds="h100", generator="holdout",
         condition="SW_POWER_CAP"),
    Case("hold_session_age", "session_age", "session_age", metric="diffusion_ms_per_step", generator="holdout",
         condition="ms a step within sessions"),
    Case("hold_long_prompts", "long_prompts", "regressions", metric="diffusion_ms", generator="holdout",
         condition="first_forward_tokens > 1"),
    Case("hold_switch_cause", "switch_cause", "regressions", generator="holdout",
         attribution="cuda_graphs"),
    Case("hold_drift", "drift", "drift", metric="diffusion_ms_p50", generator="holdout", onset_day=1.0,
         ladder_h=(168, 216)),
    Case("hold_real_leak", "real_leak", "memory", key="per session", severity="critical", generator="holdout"),
    Case("hold_trap_longer_sessions", "longer_sessions", None, generator="holdout"),
    # the trap's longer sessions with a real +4% on every step: the change points (within strata) still see it
    Case("hold_longer_sessions_slower", "longer_sessions_slower", "changepoints", metric="diffusion_ms_p50",
         generator="holdout"),
    Case("hold_healthy", "healthy", None, generator="holdout"),
)


@dataclass
class Outcome:
    case: str
    seed: int
    found: bool = False
    scope_right: bool = False
    attribution_right: bool | None = None
    severity_right: bool | None = None
    hours_to_first: float | None = None
    false_alarms: list[str] = field(default_factory=list)
    note_found: bool | None = None
    seconds: float = 0.0
    ambiguous_first: bool | None = None  # memory: the first finding named its key ambiguous
    hours_to_scope: float | None = None  # the rung whose finding was judged for scope
    hours_to_attribution: float | None = None  # the rung whose findings were judged for attribution
    key_evidence: dict | None = None  # memory, never committed: the key's tests against its rivals
    condition_right: bool | None = None  # holdout: the finding names the class's condition
    incidents: dict | None = None  # holdout, the incident logic registered: holdout_eval.incident_pass's counts


def _detectors():
    from analytics import changepoints, drift, memory, regressions, variance

    return {
        "memory": lambda s, a, b: memory.analyze(s, a, b)[1],
        "regressions": regressions.run,
        "changepoints": changepoints.run,
        "drift": drift.run,
        "variance": variance.run,
    }


def _scope(row: dict) -> dict[str, str]:
    return dict(p.split("=", 1) for p in row["scope"].split(",") if "=" in p)


def _correct(case: Case, rel: str, rows: list[dict], all_kinds: set[str]) -> tuple[bool, bool, dict | None]:
    """(found, scope right, the finding that decided) for the case's detector's rows."""
    found, right, hits = _judge_rows(case, rel, rows, all_kinds)
    return found, right, hits[0] if hits else None


def _judge_rows(case: Case, rel: str, rows: list[dict], all_kinds: set[str]) -> tuple[bool, bool, list[dict]]:
    """(found, scope right, the findings that count: the release's for memory, else every acting one of
    the metric, e.g. one per GPU kind)."""
    import json

    want_kinds = all_kinds if case.kinds == "all" else {case.kinds}
    if case.detector == "memory":
        summary = [r for r in rows if _scope(r) == {"release": rel}]
        if not summary:
            return False, False, []
        ev = json.loads(summary[0]["evidence"])
        named = {ev.get("key", ev.get("explained_by")), *ev.get("aliases", [])}
        return True, case.key in named and bool(ev.get("key_confident", True)), summary[:1]
    hits = [r for r in rows if r["metric"].startswith(case.metric) and r["severity"] != "info"
            and _scope(r).get("release", rel) == rel]
    if not hits:
        return False, False, []
    # a finding without a GPU kind is the release's, on every kind (one decision at the release's scope)
    kinds = set().union(*({k} if (k := _scope(r).get("gpu_kind")) else all_kinds for r in hits))
    right = kinds <= want_kinds  # no GPU kind outside the incident's (a cohort need not be on every kind)
    if case.detector == "changepoints":  # no release in a change point's scope: the gaining release names it
        right = right and all(json.loads(r["evidence"]).get("release_gaining") == rel for r in hits)
    return True, right, hits


COMMITTED = ("blamed", "none explains")  # attribution states that commit (blame.py); 'tie', 'waiting' do not


def _attribution_state(row: dict) -> str:
    import json

    ev = json.loads(row["evidence"])
    return ev.get("attribution_state") or ("blamed" if row["attribution"] else "none explains")


def _key_evidence(case: Case, row: dict) -> dict | None:
    """An ambiguous memory finding's test of the class's key against its rivals (the latest one kept:
    what the store held when it stopped looking)."""
    import json

    ev = json.loads(row["evidence"])
    tests = [t for t in ev.get("key_tests", []) if case.key in [*t["keys"], *map(_key_name, t["keys"])]]
    named = [ev.get("explained_by"), *ev.get("ambiguous_with", [])]
    rivals = [t for t in tests if any(k in named and _key_name(k) != case.key for k in t["keys"])]
    return {"named": named, "tests": [{"keys": t["keys"], "sessions_telling_apart": t["sessions_telling_apart"],
                                       "p_value": t["p_value"]} for t in rivals]}


def _separate_p() -> float:
    from analytics.memory import SEPARATE_P

    return SEPARATE_P


def _key_name(name: str) -> str:
    from analytics.memory import key_of

    return key_of(name)


def _confident(row: dict) -> bool:
    import json

    return bool(json.loads(row["evidence"]).get("key_confident", True))


def run_case(case: Case, seed: int, chdb_dir: str, reserved_jitter: float | None = None) -> Outcome:
    """``reserved_jitter``: the simulator's session-to-session sd of reserved memory, bytes (None: its
    measured default, ``analytics.simulate.RESERVED_JITTER_BYTES``)."""
    if case.generator == "holdout":
        from analytics import holdout_eval

        return holdout_eval.run_case(case, seed, chdb_dir)
    from analytics import jobs
    from analytics.simulate import RESERVED_JITTER_BYTES, simulate_fleet
    from collector.migrations import drop_database
    from collector.store import open_store

    t0 = time.perf_counter()
    store = open_store(f"chdb://{chdb_dir}?database=e_{uuid.uuid4().hex[:12]}")
    store.migrate()
    out = Outcome(case.name, seed)
    try:
        incidents = [(case.incident, ONSET_DAY)] if case.incident else []
        jitter = RESERVED_JITTER_BYTES if reserved_jitter is None else reserved_jitter
        sim = simulate_fleet(store, weeks=WEEKS, incidents=incidents, seed=1000 + seed, end=sim_end(seed),
                             reserved_jitter=jitter, **FLEET)
        onset = sim.start + timedelta(days=ONSET_DAY)
        rel = sim.releases[-1].name
        kinds = {w.gpu_kind for w in sim.workers}
        det = _detectors()
        ends = [min(onset + timedelta(hours=h), sim.end) for h in LADDER_H]
        if case.detector:
            scope_done = attribution_done = False
            for end in ends:
                rows = det[case.detector](store, *jobs.window(_job(case.detector), end=end))
                found, right, hits = _judge_rows(case, rel, rows, kinds)
                if not found:
                    if out.found:  # found, then gone: what was still waiting is never judged right
                        break
                    continue
                hours = (end - onset).total_seconds() / 3600
                if not out.found:  # the first rung that finds it: recall, time, severity
                    out.found, out.hours_to_first = True, hours
                    if case.severity:  # the severity it reaches by the last rung
                        last = _correct(case, rel, det[case.detector](store, *jobs.window(_job(case.detector),
                                                                                          end=ends[-1])), kinds)[2]
                        out.severity_right = any(r is not None and r["severity"] == case.severity
                                                 for r in (hits[0], last))
                if not scope_done:
                    if case.detector == "memory" and not _confident(hits[0]):  # the key waits for evidence
                        out.ambiguous_first = True if out.ambiguous_first is None else out.ambiguous_first
                        out.key_evidence = _key_evidence(case, hits[0])
                    else:
                        if case.detector == "memory" and out.ambiguous_first is None:
                            out.ambiguous_first = False
                        out.scope_right, out.hours_to_scope = right, hours  # committed: right or wrong, final
                        out.key_evidence = None
                        scope_done = True
                if case.attribution and not attribution_done:
                    committed = all(_attribution_state(r) in COMMITTED for r in hits)
                    if committed or end == ends[-1]:  # every finding of it (one per GPU kind) names the switch
                        out.attribution_right = committed and all(r["attribution"] == case.attribution for r in hits)
                        out.hours_to_attribution, attribution_done = hours, True
                if scope_done and (attribution_done or not case.attribution):
                    break
            if out.found and case.attribution and out.attribution_right is None:
                out.attribution_right = False
        else:
            for name in ACTING:
                rows = det[name](store, *jobs.window(_job(name), end=ends[-1]))
                out.false_alarms += [f"{name}:{r['scope']}:{r['metric']}" for r in rows
                                     if r["severity"] in ("warning", "critical")]
            notes = det["variance"](store, *jobs.window("variance", end=ends[-1]))
            out.note_found = bool(notes) if case.note else None
            if not case.note and notes:
                out.false_alarms += [f"variance-note:{r['scope']}" for r in notes]
    finally:
        drop_database(store, store.database)
    out.seconds = time.perf_counter() - t0
    return out


def _job(detector: str) -> str:
    return detector  # the jobs' names are the detectors' (analytics.jobs.JOBS)


def register(subparsers) -> None:
    p = subparsers.add_parser("evaluate-detectors", help="benchmark the detectors on a catalog of simulated "
                              "incidents with known answers (recall, scope, false alarms)")
    p.add_argument("--seeds", type=int, default=20, help="seeds per incident class (default 20)")
    p.add_argument("--only", default="", help="comma-separated class names (default: the whole catalog: "
                   + ", ".join(c.name for c in CATALOG) + ")")
    p.add_argument("--reserved-jitter", type=float, default=None, metavar="MIB",
                   help="the simulated session-to-session sd of a process's reserved memory, MiB (default: "
                   "the H200-measured analytics.simulate.RESERVED_JITTER_BYTES)")
    p.add_argument("--verbose", action="store_true", help="print every (class, seed) outcome as it finishes")
    p.add_argument("--save", default="", help="also write the outcomes to this JSON file")
    p.add_argument("--load", default="", help="print the table of saved outcomes (comma-separated JSON files, "
                   "e.g. two halves of the catalog run side by side) instead of running")
    p.set_defaults(func=_main)


def _main(args) -> int:
    import dataclasses
    import json

    if args.load:
        from pathlib import Path

        outcomes = [Outcome(**o) for path in args.load.split(",") for o in json.loads(Path(path).read_text())]
        for line in summarize(outcomes, CATALOG):
            print(line)
        return 0
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - {c.name for c in CATALOG})
    if unknown:
        print(f"unknown class(es) {unknown}; valid: {', '.join(c.name for c in CATALOG)}", file=sys.stderr)
        return 2
    if args.seeds < 1:
        print("--seeds must be >= 1", file=sys.stderr)
        return 2
    if args.reserved_jitter is not None and args.reserved_jitter < 0:
        print("--reserved-jitter must be >= 0 (MiB)", file=sys.stderr)
        return 2
    from analytics.simulate import RESERVED_JITTER_BYTES

    jitter = RESERVED_JITTER_BYTES if args.reserved_jitter is None else args.reserved_jitter * 2**20
    cases = [c for c in CATALOG if not names or c.name in names]
    chdb_dir = tempfile.mkdtemp(prefix="livestep-eval-")
    t0 = time.perf_counter()
    outcomes = []
    for c in cases:
        for seed in range(args.seeds):
            o = run_case(c, seed, chdb_dir, jitter)
            outcomes.append(o)
            if args.verbose:
                print(f"{o.case} seed={o.seed} found={o.found} scope={o.scope_right} attr={o.attribution_right} "
                      f"sev={o.severity_right} h={o.hours_to_first} false={o.false_alarms} "
                      f"note={o.note_found} ({o.seconds:.1f} s)", flush=True)
    if args.save:
        with open(args.save, "w") as f:
            json.dump([dataclasses.asdict(o) for o in outcomes], f)
    for line in summarize(outcomes, CATALOG):
        print(line)
    fleets = []
    if any(c.generator == "simulate" for c in cases):
        fleets.append(f"simulated fleet {FLEET['workers']} workers, {FLEET['sessions_per_day']:g} sessions/worker/day, "
                      f"onset day {ONSET_DAY:g} of {WEEKS * 7:g}, detectors at +{', +'.join(str(h) for h in LADDER_H)} "
                      f"h; reserved memory jitter {jitter / 2**20:g} MiB sd")
    if any(c.generator == "holdout" for c in cases):
        from analytics import holdout
        from analytics import holdout_eval as he

        fleets.append(f"hold-out fleet {len(holdout.DEVICES) * 3} workers ({', '.join(holdout.DEVICES)}), "
                      f"{he.SESSIONS_PER_DAY:g} sessions/worker/day, onset day {he.ONSET_DAY:g} of {he.DAYS:g} "
                      f"(drift: day 1), detectors at +{', +'.join(str(h) for h in he.LADDER_H)} h")
    print(f"\n{len(outcomes)} runs ({len(cases)} classes x {args.seeds} seeds) in {time.perf_counter() - t0:.0f} s; "
          + "; ".join(fleets))
    return 0
