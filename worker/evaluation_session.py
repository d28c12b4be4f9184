"""A long free-running session for ``livestep evaluate``'s drift judge, run in pieces across calls.

    s = long_session(models, "production", sw, steps=14_400, piece=2_000, state="drift.pt")  # first piece
    s = long_session(models, "production", sw, steps=14_400, piece=2_000, state="drift.pt", resume=True)
    s.done, s.step, s.plain, s.candidate, s.reset        # per step: each arm's distance to the truth's

The truth, the plain path and the candidate each run their own trajectory, every step, from one
conditioning and one noise sequence, as a session does: nothing is reloaded from the truth, so an error
that accumulates in the candidate's cache or calibration (a scale that goes stale, a rotation that
compounds at each position reset) shows as its distance growing against the plain path's with session
age. A teacher-forced probe cannot see that: it reloads the window each time.

A 10-minute session is 14,400 steps, more than one device call can run (docs/PERFORMANCE.md, issue 22):
after ``piece`` steps the whole state -- every arm's cache (K/V windows, scales, the book), conditioning
K/V and static-scale calibration, the noise generator, the series so far -- is saved to ``state`` with
``torch.save`` and the next call continues it with ``resume=True`` (``--resume``), bit for bit as one run
would (tests/worker/test_evaluate.py checks two pieces against one run). The state file stays on the
machine that runs it (a prod57b rank's caches are gigabytes): keep the machine, or its disk, between
the calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from worker.config import Switches
from worker.evaluation_runs import Metric, Models, Run, _noise, _Progress, rel_l2, resets_at, session_inputs


@dataclass
class LongSession:
    name: str
    steps: int  # the session's length
    step: int = 0  # steps done so far
    plain: list[float] = field(default_factory=list)
    candidate: list[float] = field(default_factory=list)
    reset: list[bool] = field(default_factory=list)
    pieces: int = 0  # calls that ran a piece of it

    @property
    def done(self) -> bool:
        return self.step >= self.steps

    def as_dict(self) -> dict:
        return asdict(self)


def _arm_state(r: Run) -> dict:
    sites = r.model._sites(False)
    return {"cache": {k: v for k, v in r.cache.__dict__.items() if k != "ops"}, "cond_kv": r.cond_kv,
            "scales": [(s.scale, s.left) for s in sites]}


def _load_arm(r: Run, st: dict) -> None:
    r.cache.__dict__.update(st["cache"])
    r.cond_kv = st["cond_kv"]
    for site, (scale, left) in zip(r.model._sites(False), st["scales"], strict=True):
        site.scale.copy_(scale)
        site.left = left


def long_session(models: Models, name: str, sw: Switches, steps: int, *, piece: int | None = None,
                 state: str | Path | None = None, resume: bool = False, metric: Metric = rel_l2, seed: int = 0,
                 tamper: Callable | None = None, log: Callable[[str], None] | None = None) -> LongSession:
    """Run (or continue, ``resume``) the session up to ``piece`` more steps (all: None); with ``state``,
    save where it stands after the piece. Returns the series so far."""
    shape, dev = models.shape, models.device
    cond, g = session_inputs(shape, dev, seed)
    plain_sw = Switches()
    arms = {"truth": models.run("truth", plain_sw), "plain": models.run("plain", plain_sw), name: models.run(name, sw)}
    for r in arms.values():
        r.start(cond, tamper if r.name == name else None)
    out = LongSession(name, steps)
    if resume:
        if state is None or not Path(state).exists():
            raise FileNotFoundError(f"no saved session at {state}: run the first piece without --resume")
        saved = torch.load(state, map_location=dev, weights_only=False)
        if saved["session"]["name"] != name or saved["session"]["steps"] != steps or saved["seed"] != seed:
            raise ValueError(f"{state} holds {saved['session']['name']} ({saved['session']['steps']} steps, seed "
                             f"{saved['seed']}), not {name} ({steps} steps, seed {seed})")
        out = LongSession(**saved["session"])
        for n, r in arms.items():
            _load_arm(r, saved["arms"][n])
        g.set_state(saved["noise"].to(g.get_state().device) if hasattr(saved["noise"], "to") else saved["noise"])
    end = steps if piece is None else min(steps, out.step + piece)
    clock = _Progress("drift", end - out.step, log)
    resets = resets_at(steps, shape.reset_every)
    for k, i in enumerate(range(out.step, end)):
        noise = _noise(shape, g, dev)
        ref = arms["truth"].step(noise, resets[i]).float()
        out.plain.append(metric(arms["plain"].step(noise, resets[i]).float(), ref))
        out.candidate.append(metric(arms[name].step(noise, resets[i]).float(), ref))
        out.reset.append(resets[i])
        clock.step(k)
    out.step, out.pieces = end, out.pieces + 1
    if state is not None:
        torch.save({"session": out.as_dict(), "seed": seed, "noise": g.get_state(),
                    "arms": {n: _arm_state(r) for n, r in arms.items()}}, state)
    return out
