"""The gate on numeric switch defaults: a switch that changes the model's numerics
(``collector.switch_names.NUMERIC_SWITCHES``) is a production default for a GPU kind only with a passing
evaluation (``livestep evaluate``) of that GPU kind and release.

    latest(store, "fp8_cache", gpu_kind="NVIDIA H200", release="v7")   # the newest overall row, or None
    require_for_scope(store, "fp8_cache", {"release": "v7"})   # a canary or an "on" write: evaluations, else GateError
    defaults_by_kind(store, DEFAULTS)       # GET /v1/switches/rules: each default with its evidence

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

from typing import Any

from analytics import queries as aq
from collector.switch_names import NUMERIC_SWITCHES


class GateError(Exception):
    """A numeric switch's default or canary without the evaluation it needs; ``status`` is the HTTP answer."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


def evaluations(store, switch: str | None = None, gpu_kind: str | None = None,
                release: str | None = None) -> list[dict[str, Any]]:
    """The newest overall verdict per (switch, GPU kind, release), filtered by what is given."""
    rows = aq.latest_verdicts(store, switch, gpu_kind, release)
    keys = ("switch", "gpu_kind", "release", "verdict", "evaluation_id", "ts", "preset", "configuration")
    return [{**dict(zip(keys, r, strict=True)), "ts": r[5].isoformat()} for r in rows]


def latest(store, switch: str, gpu_kind: str, release: str) -> dict[str, Any] | None:
    got = evaluations(store, switch, gpu_kind, release)
    return got[0] if got else None


def _how(switch: str, gpu_kind: str, release: str) -> str:
    return (f"run `livestep evaluate --switch {switch} --release {release} --gpu-kind '{gpu_kind}' "
            "--collector URL` on that GPU kind")


def require(store, switch: str, gpu_kind: str, release: str) -> dict[str, Any] | None:
    """The passing evaluation behind ``switch`` for this GPU kind and release (None: not a numeric switch),
    else GateError (409) naming what is missing and how to get it."""
    if switch not in NUMERIC_SWITCHES:
        return None
    ev = latest(store, switch, gpu_kind, release)
    if ev is None:
        raise GateError(f"{switch} changes the model's numerics and has no evaluation for gpu_kind={gpu_kind}, "
                        f"release={release}: {_how(switch, gpu_kind, release)}")
    if ev["verdict"] != "pass":
        raise GateError(f"{switch}'s latest evaluation for gpu_kind={gpu_kind}, release={release} (run "
                        f"{ev['evaluation_id']}, {ev['ts']}) is {ev['verdict']!r}, not 'pass': see "
                        f"GET /v1/evaluations?switch={switch}; {_how(switch, gpu_kind, release)}")
    return ev


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
    kinds = [scope["gpu_kind"]] if scope.get("gpu_kind") else kinds_in(store, release)
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
