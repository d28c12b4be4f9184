"""The gate on numeric switch defaults: a switch that changes the model's numerics
(``collector.switch_names.NUMERIC_SWITCHES``) is a production default for a GPU kind only with a passing
evaluation (``livestep evaluate``) of that GPU kind and release.

    latest(store, "fp8_cache", gpu_kind="NVIDIA H200", release="v7")   # the newest overall row, or None
    require_for_scope(store, "fp8_cache", {"release": "v7"})   # a canary or an "on" write: evaluations, else GateError
    defaults_by_kind(store, DEFAULTS)       # GET /v1/switches/rules: each default with its evidence

**Evidence counts only where it was measured** (issue 31). An evaluation row counts only when an
evaluator posted it (``evaluator`` set by POST /v1/evaluations; the ingest token cannot write one), and
for a GPU kind only when it ran on that device -- its ``gpu_kind`` read from the device by the evaluator
(``torch.cuda.get_device_name``, canonical: collector/gpu_kinds.py) and ``device_type`` ``cuda`` -- on
a shape the kind's fleet runs (the (preset, TP) pairs of its sessions, ``analytics.queries.fleet_shapes``;
with none yet, ``DEFAULT_PRESET`` at any TP), with at least ``MIN_STEPS`` steps, ``MIN_SEEDS`` weight seeds
and ``MIN_RERUNS`` band runs. So a CPU or tiny evaluation never unlocks a GPU kind. Every accepted write
cites the evaluations behind it; every refusal (PUT /v1/switches, POST /v1/canaries) is logged and written
to the switch audit (``action`` ``gate_refused``).

**Checked again at every poll.** A write is checked against the GPU kinds its scope has *now*; a kind
that joins the release later (a new pool, a release-wide rule written before any session) was never
checked. So GET /v1/switches hands a worker a numeric switch that a rule turns *on* only when
``evidenced(store, its gpu_kind, its release)`` holds it (api/switchboard.py ``resolve``); else that rule
does not reach the worker: the next most recent covering rule decides, or none and the worker keeps its
own value. Posting the kind's evidence lets the rule reach it from the next poll.

A configuration's evidence is the ``overall`` evaluation row of the newest evaluation run for that
switch, GPU kind and release: ``pass`` needs both the teacher-forced and the free-running judge passed
(worker/evaluate.py); ``fail`` and ``no_effect`` (the switch did nothing on that device) do not count.
A run that judged less (``incomplete``: e.g. drift alone) is no evidence either way and never hides the
run before it; one of its judges failing makes it a ``fail``, which does. A canary of a numeric switch, and a write that turns one
on (PUT /v1/switches/{name} with value true), must name the release in its scope and have a passing
evaluation (409 otherwise) for the scope's GPU kind, or, when it names none,
for every GPU kind the release runs on (its workers' sessions and its evaluations say which): defaults are
per GPU kind, as the paper's FP8 cache helps on H100 and costs time on B200. A canary about to be promoted
is checked again, against the GPU kinds its sessions ran on meanwhile.
"""

from __future__ import annotations

import logging
from typing import Any

from analytics import queries as aq
from collector.gpu_kinds import canonical_gpu_kind
from collector.switch_names import NUMERIC_SWITCHES

log = logging.getLogger("livestep.gate")
MIN_STEPS = 127  # >= 3 position resets on prod57b (every 42 steps): the reset class is judged
MIN_SEEDS = 2  # weight seeds, each with its own prompt and noise
MIN_RERUNS = 2  # correct implementations in the band
DEFAULT_PRESET = "prod57b"  # the shape a GPU kind with no sessions yet must have been evaluated on


class GateError(Exception):
    """A numeric switch's default or canary without the evaluation it needs; ``status`` is the HTTP answer."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


def evaluations(store, switch: str | None = None, gpu_kind: str | None = None,
                release: str | None = None) -> list[dict[str, Any]]:
    """The newest overall verdict per (switch, GPU kind, release), filtered by what is given."""
    rows = aq.latest_verdicts(store, switch, canonical_gpu_kind(gpu_kind) if gpu_kind else None, release)
    keys = ("switch", "gpu_kind", "release", "verdict", "evaluation_id", "ts", "preset", "configuration",
            "evaluator", "device_type", "tp", "steps", "seeds", "reruns")
    return [{**dict(zip(keys, r, strict=True)), "ts": r[5].isoformat()} for r in rows]


def latest(store, switch: str, gpu_kind: str, release: str) -> dict[str, Any] | None:
    got = evaluations(store, switch, gpu_kind, release)
    return got[0] if got else None


def _how(switch: str, gpu_kind: str, release: str) -> str:
    return (f"run `livestep evaluate --switch {switch} --release {release} --preset {DEFAULT_PRESET} --device cuda "
            f"--steps {MIN_STEPS} --seeds {MIN_SEEDS} --collector URL --token <evaluator token>` on a {gpu_kind} GPU")


def unmet(store, ev: dict[str, Any], gpu_kind: str, release: str,
          shapes: list[tuple[str, int]] | None = None) -> list[str]:
    """What an evaluation lacks to count for ``gpu_kind`` (empty: it counts); ``shapes``: the kind's
    fleet shapes when already read."""
    why = []
    if gpu_kind != "cpu" and ev.get("device_type") != "cuda":
        why.append(f"it ran on {ev.get('device_type') or 'an unrecorded device'}, not a {gpu_kind} GPU")
    shapes = _shapes(store, gpu_kind, release) if shapes is None else shapes
    if shapes and (ev["preset"], ev.get("tp")) not in shapes:
        why.append(f"it ran {ev['preset']} at TP {ev.get('tp')}, the fleet runs "
                   f"{', '.join(f'{p} at TP {t}' for p, t in shapes)}")
    if not shapes and ev["preset"] != DEFAULT_PRESET:
        why.append(f"it ran {ev['preset']}; with no {gpu_kind} sessions yet the evidence must be {DEFAULT_PRESET}")
    for field_, least in (("steps", MIN_STEPS), ("seeds", MIN_SEEDS), ("reruns", MIN_RERUNS)):
        if (ev.get(field_) or 0) < least:
            why.append(f"{ev.get(field_) or 0} {field_} (the gate needs >= {least})")
    return why


def _shapes(store, gpu_kind: str, release: str) -> list[tuple[str, int]]:
    return aq.fleet_shapes(store, gpu_kind, release) or aq.fleet_shapes(store, gpu_kind)


def require(store, switch: str, gpu_kind: str, release: str) -> dict[str, Any] | None:
    """The passing evaluation behind ``switch`` for this GPU kind and release (None: not a numeric switch),
    else GateError (409) naming what is missing and how to get it."""
    if switch not in NUMERIC_SWITCHES:
        return None
    gpu_kind = canonical_gpu_kind(gpu_kind)
    ev = latest(store, switch, gpu_kind, release)
    if ev is None:
        raise GateError(f"{switch} changes the model's numerics and has no evaluation for gpu_kind={gpu_kind}, "
                        f"release={release}: {_how(switch, gpu_kind, release)}")
    if ev["verdict"] != "pass":
        raise GateError(f"{switch}'s latest evaluation for gpu_kind={gpu_kind}, release={release} (run "
                        f"{ev['evaluation_id']}, {ev['ts']}) is {ev['verdict']!r}, not 'pass': see "
                        f"GET /v1/evaluations?switch={switch}; {_how(switch, gpu_kind, release)}")
    why = unmet(store, ev, gpu_kind, release)
    if why:
        raise GateError(f"{switch}'s passing evaluation {ev['evaluation_id']} is no evidence for gpu_kind={gpu_kind}: "
                        f"{'; '.join(why)}; {_how(switch, gpu_kind, release)}")
    return ev


def evidenced(store, gpu_kind: str, release: str) -> dict[str, dict[str, Any]]:
    """The numeric switches ``require`` would let on for this GPU kind and release -- the newest evaluation
    passes and counts there -- each with that evaluation (two queries: the evaluations, the fleet's shapes).
    What GET /v1/switches hands a worker is checked against this (api/switchboard.py ``resolve``)."""
    kind = canonical_gpu_kind(gpu_kind)
    evs = [e for e in evaluations(store, gpu_kind=kind, release=release)
           if e["switch"] in NUMERIC_SWITCHES and e["verdict"] == "pass"]
    shapes = _shapes(store, kind, release) if evs else []
    return {e["switch"]: e for e in evs if not unmet(store, e, kind, release, shapes)}


def kinds_in(store, release: str, days: int = 30) -> list[str]:
    """The GPU kinds a release runs on, as far as the store knows: those its workers reported sessions
    from over the last ``days``, and those it has evaluations for."""
    return aq.release_gpu_kinds(store, release, days)


def require_for_scope(store, switch: str, scope: dict[str, str]) -> list[dict[str, Any]]:
    """POST /v1/canaries, and PUT /v1/switches turning a switch on: a numeric switch's scope names its
    release (422 otherwise) and has a passing
    evaluation for the scope's GPU kind -- or, with none named, for every GPU kind the release runs on
    (``kinds_in``; at least one) -- else 409. The evaluations behind it ([] for a switch that moves no
    number)."""
    if switch not in NUMERIC_SWITCHES:
        return []
    release = scope.get("release")
    if not release:
        raise GateError(f"a canary of {switch}, or a write turning it on (it changes the model's numerics), must name a release "
                        "in its scope: "
                        "a numeric switch is a default per GPU kind and release, each with its own evaluation; "
                        "e.g. scope 'release=v7' or 'gpu_kind=NVIDIA H200,release=v7'", 422)
    kinds = [canonical_gpu_kind(scope["gpu_kind"])] if scope.get("gpu_kind") else kinds_in(store, release)
    if not kinds:
        raise GateError(f"{switch} changes the model's numerics and release {release} has no evaluation on any GPU "
                        f"kind (and no sessions to say which it runs on): {_how(switch, 'KIND', release)}")
    return [require(store, switch, k, release) for k in kinds]


def blocking(store, switch: str, scope: dict[str, str]) -> dict[str, Any] | None:
    """A canary about to be promoted: None when the gate lets it (or the switch is not numeric), else
    {"gate": the reason} for its evidence."""
    try:
        require_for_scope(store, switch, scope)
    except GateError as e:
        return {"gate": str(e)}
    return None


def defaults_by_kind(store, defaults: dict[str, bool]) -> dict[str, Any]:
    """Per GPU kind and release that has evaluations: each switch's production default, a numeric one on
    only with a passing evaluation there, with the evaluation behind it (None: none recorded)."""
    evs = evaluations(store)
    by: dict[tuple[str, str], dict[str, dict]] = {}
    for e in evs:
        by.setdefault((e["gpu_kind"], e["release"]), {})[e["switch"]] = e
    out = []
    for (kind, release), got in sorted(by.items()):
        switches = {}
        for name, on in defaults.items():
            ev = got.get(name)
            numeric = name in NUMERIC_SWITCHES
            switches[name] = {"default": on and (not numeric or (ev is not None and ev["verdict"] == "pass")),
                              "numeric": numeric, "evaluation": ev}
        out.append({"gpu_kind": kind, "release": release, "switches": switches,
                    "production": got.get("production")})
    return {"numeric": list(NUMERIC_SWITCHES), "by_gpu_kind": out}


def refused(board, name: str, scope: str, value: bool, actor: str, reason: str, why: str, source: str = "api") -> None:
    """A write the gate refused: a log line and a switch-audit row (``action`` ``gate_refused``, unchanged)."""
    from api.switchboard import Decision

    log.warning("gate refused %s=%s in scope %r by %s: %s", name, value, scope, actor, why)
    _, version = board.snapshot()
    board.record(Decision(name, scope, "", None, value, False, version, "gate_refused", source, actor, reason,
                          evidence={"gate": why}))
