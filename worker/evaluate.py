"""``livestep evaluate``: every numeric switch, and the production set, against the truth and the band.

    livestep evaluate --preset tiny --device cpu                    # each numeric switch + production
    livestep evaluate --preset small --switch fp8_cache --steps 200 --seeds 3 --out eval.json
    livestep evaluate --preset tiny --only drift --drift-steps 14400          # a 10-minute session
    livestep evaluate --from eval.json --collector http://127.0.0.1:8000 --token EVALUATOR_TOKEN  # post it

Per configuration (a switch with the switches it needs, ``CONFIGURATIONS``; ``production`` = every
optimization on), over ``--seeds`` weight seeds (each with its own prompt and noise), the judges of
worker/evaluation_judges.py on the measurements of worker/evaluation_runs.py: the teacher-forced error
and the free-running distance, each *against the truth* (fp64, or bf16 without FP8 on prod) and over the
plain path's, judged against the band the correct implementations of the plain path span
(worker/evaluation_implementations.py); the decoded frames' PSNR, SSIM and flicker beside them (a view,
not a verdict); and -- ``--drift-steps`` -- a long free-running session of the production set, resumable
across calls (``--drift-piece``, ``--drift-state``, ``--resume``; worker/evaluation_session.py). A
configuration passes when the teacher-forced and the free-running judge ran and passed; a switch whose
latents equal the plain path's on this device is ``no_effect``, never a pass. The result states the
plain arm's numerics (``numerics``) and what its series hold (``measured``: the records' steps, seeds and
band runs, never the header's). Skipped: ``fused_allreduce`` at world size 1 (it needs a TP group), and
on the CPU ``compile`` (inductor runs on CUDA only here), ``attention_fp8_dots`` (the worker's FP8
attention kernel: CUDA only) and ``triton_kernels`` unless ``TRITON_INTERPRET=1``.

Results print as a table; ``--out`` writes them as JSON, after every finished judge of every seed too
(a run cut short by a timeout keeps what it finished: judge it with ``--from``). The GPU machine has no
pydantic: measure there, post from here with ``--from FILE --collector URL --token T``, where ``T`` is an
*evaluator* token (LIVESTEP_EVALUATOR_TOKENS; the ingest token is refused): POST /v1/evaluations judges
the series itself and stores the records, the evidence the control plane's gate reads
(api/evaluation_gate.py).

One module over 450 lines: the result's JSON is one format, measured, judged, tabled and turned into
records here (``judge`` and ``records`` also run on the server), so its field names live in one file.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from collector.switch_names import FRAME_METRICS, NUMERIC_SWITCHES

PRODUCTION = "production"
# The smallest valid configuration that turns each numeric switch on (worker/config.py's combinations).
CONFIGURATIONS: dict[str, dict[str, bool]] = {
    "rope_at_write": {"rope_at_write": True},
    "ring_cache": {"ring_cache": True, "rope_at_write": True},
    "fp8_cache": {"fp8_cache": True, "rope_at_write": True},
    "delta_rotation": {"delta_rotation": True, "ring_cache": True, "rope_at_write": True},
    "static_scales": {"static_scales": True},
    "triton_kernels": {"triton_kernels": True, "static_scales": True, "ring_cache": True, "rope_at_write": True,
                       "fp8_cache": True},
    "attention_fp8_dots": {"attention_fp8_dots": True, "triton_kernels": True, "static_scales": True,
                           "ring_cache": True, "rope_at_write": True, "fp8_cache": True},
    "compile": {"compile": True},
    "fused_allreduce": {"fused_allreduce": True},
}
assert set(CONFIGURATIONS) == set(NUMERIC_SWITCHES)
TP_ONLY = {"fused_allreduce": "needs a tensor-parallel group (world size 1 here)"}
JUDGES = ("teacher_forced", "free_running", "drift")
DRIFT_PROBES = 2  # teacher-forced probes per position-reset interval of a long session (at the reset, mid-way)


class EvaluateError(ValueError):
    """A bad switch name, judge or file; the message lists what is valid."""


def configurations(names: list[str] | None) -> dict[str, Any]:
    """name -> Switches for the named switches (default: every numeric one) and the production set."""
    from worker.config import Switches

    names = list(names or [*NUMERIC_SWITCHES, PRODUCTION])
    bad = [n for n in names if n not in CONFIGURATIONS and n != PRODUCTION]
    if bad:
        raise EvaluateError(f"not a numeric switch: {bad}; valid: {', '.join([*NUMERIC_SWITCHES, PRODUCTION])}")
    return {n: Switches.all_on() if n == PRODUCTION else Switches.from_mapping(CONFIGURATIONS[n]) for n in names}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              check=False, cwd=Path(__file__).resolve().parents[1]).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_kind(dev) -> tuple[str, str]:
    """(device type, canonical GPU kind) read from the device itself -- never a flag: an evaluation is
    evidence only for the GPU kind it ran on (api/evaluation_gate.py). A CPU is kind ``cpu``."""
    import torch

    from collector.gpu_kinds import canonical_gpu_kind

    dev = torch.device(dev)
    if dev.type == "cuda":
        return "cuda", canonical_gpu_kind(torch.cuda.get_device_name(dev))
    return dev.type, dev.type


def evaluate(preset: str = "tiny", device: str = "cpu", switches: list[str] | None = None, *, steps: int = 100,
             seeds: int = 3, drift_steps: int = 0, drift_piece: int | None = None, drift_state: str | None = None,
             resume: bool = False, judges: tuple[str, ...] = ("teacher_forced", "free_running"),
             metric: str = "rel_l2", truth: str | None = None, seed: int = 0, tp: int = 1,
             implementations: list[str] | None = None, frames: bool = True, probe_stride: int | None = None,
             free_running_of: list[str] | None = None, release: str = "dev",
             tamper: dict[str, Callable] | None = None, save: Callable[[dict], None] | None = None,
             log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure (over ``seeds`` weight seeds, each with its own prompt and noise) and judge; the result is
    plain JSON data (``records`` turns it into evaluation records). ``free_running_of``: the configurations
    the free-running judge runs (default: all; the others' overall is then ``incomplete``). ``save``: called
    with the (unjudged) result after every finished judge of every seed, so a run cut short keeps what it
    finished. ``tamper`` (tests only): configuration name -> ``fn(model, cache)`` that breaks that candidate."""
    from dataclasses import replace

    import torch

    from worker.config import ModelShape, tp_rank_of
    from worker.evaluation_implementations import available
    from worker.evaluation_judges import RESET_TAIL
    from worker.evaluation_runs import Models, free_running, load_metric, probe_steps, teacher_forced

    bad = [j for j in judges if j not in JUDGES]
    if bad:
        raise EvaluateError(f"unknown judge(s) {bad}; valid: {', '.join(JUDGES)}")
    if seeds < 1:
        raise EvaluateError(f"seeds {seeds}: at least 1")
    full = ModelShape.from_name(preset)
    dev = torch.device(device)
    if dev.type == "cpu" and full.d_model <= 256:
        torch.set_num_threads(1)  # as the worker does: a tiny model is 10x slower when two threads contend
    truth = truth or ("bf16" if full.n_blocks * full.d_model // max(tp, 1) > 100_000 else "fp64")
    truth_dtype = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}.get(truth)
    if truth_dtype is None:
        raise EvaluateError(f"truth {truth!r}; valid: fp64, fp32, bf16")
    try:
        impls = available(dev, names=implementations, fp8_attention=full.fp8_attention)
    except ValueError as e:
        raise EvaluateError(str(e)) from e
    metric_name, metric_fn = load_metric(metric)
    cands = configurations(switches)
    skipped = {n: why for n, why in TP_ONLY.items() if n in cands}  # one process: world size 1
    if dev.type == "cpu":  # what does nothing here would measure its configuration's other switches
        import os

        off_cpu = {"compile": "inductor compiles the model only on CUDA",
                   "attention_fp8_dots": "the worker runs the FP8 attention kernel on CUDA only"}
        if os.environ.get("TRITON_INTERPRET") != "1":
            off_cpu["triton_kernels"] = "Triton runs on CUDA, or on the CPU under TRITON_INTERPRET=1"
        skipped.update({n: why for n, why in off_cpu.items() if n in cands})
    cands = {n: sw for n, sw in cands.items() if n not in skipped}
    bad = sorted(set(free_running_of or ()) - set(cands))
    if bad:
        raise EvaluateError(f"free-running of {bad}: not among the configurations evaluated ({', '.join(cands)})")
    fr_cands = {n: sw for n, sw in cands.items() if free_running_of is None or n in free_running_of}
    if "drift" in judges or drift_steps:
        judges = tuple(dict.fromkeys([*judges, "drift"]))
        drift_steps = drift_steps or 14_400
    device_type, gpu_kind = device_kind(dev)
    shape0 = tp_rank_of(full, tp) if tp > 1 else full
    stride = probe_stride or max(1, steps // 64)  # a long teacher-forced run: resets + their tails + a stride
    probes = None if stride == 1 else probe_steps(steps, shape0.reset_every, RESET_TAIL, stride)
    out: dict[str, Any] = {
        "preset": preset, "tp": tp, "device": str(dev), "device_type": device_type, "gpu_kind": gpu_kind,
        "release": release, "commit": _commit(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "truth": truth, "metric": metric_name, "steps": steps, "seeds": seeds, "seed": seed,
        "implementations": [i.name for i in impls], "reruns": len(impls), "drift_steps": drift_steps,
        "evaluation_id": uuid.uuid4().hex[:16], "skipped": skipped, "timings_s": {},
        "configurations": {n: sw.encode() for n, sw in cands.items()},
    }
    series: dict[str, Any] = {}
    out["series"] = series
    dropped: dict[str, str] = {}  # band members that could not run on this device, with why
    out["dropped_implementations"] = dropped
    def record(judge: str, s: int, run, t0: float) -> None:  # one seed's run of a judge, in the result and saved
        series.setdefault(judge, {"seeds": [], "runs": []})
        series[judge]["seeds"].append(s)
        series[judge]["runs"].append(run.as_dict())
        out["timings_s"][judge] = out["timings_s"].get(judge, 0) + round(time.perf_counter() - t0, 2)
        if save is not None:
            save(out)

    for s in range(seed, seed + seeds if {"teacher_forced", "free_running"} & set(judges) else seed):
        shape = tp_rank_of(replace(full, seed=s), tp) if tp > 1 else replace(full, seed=s)
        t0 = time.perf_counter()
        models = Models(shape, dev, dtype=torch.bfloat16, fp8=True, truth_dtype=truth_dtype)
        out["numerics"] = models.numerics()
        log(f"seed {s}: models built ({preset}, truth {truth}) in {time.perf_counter() - t0:.1f} s; "
            f"configurations: {', '.join(cands)}; implementations: {', '.join(out['implementations'])}")
        if "teacher_forced" in judges:
            t0 = time.perf_counter()
            record("teacher_forced", s, teacher_forced(
                models, cands, steps, metric=metric_fn, seed=s, tamper=tamper, implementations=impls, probes=probes,
                log=log, dropped=dropped), t0)
        if "free_running" in judges:
            t0 = time.perf_counter()
            record("free_running", s, free_running(
                models, fr_cands, steps, metric=metric_fn, seed=s, implementations=impls, frames=frames,
                tamper=tamper, log=log, dropped=dropped), t0)
        del models
        out["implementations"] = [i.name for i in impls if i.name not in dropped]
        out["reruns"] = len(out["implementations"])
    if "drift" in judges:
        from worker.evaluation_session import long_session

        name = PRODUCTION if PRODUCTION in cands else next(iter(cands))
        shape = tp_rank_of(replace(full, seed=seed), tp) if tp > 1 else replace(full, seed=seed)
        models = Models(shape, dev, dtype=torch.bfloat16, fp8=True, truth_dtype=truth_dtype)
        out["numerics"] = models.numerics()
        t0 = time.perf_counter()
        try:
            ls = long_session(models, name, cands[name], drift_steps, piece=drift_piece, state=drift_state,
                              resume=resume, metric=metric_fn, seed=seed, tamper=(tamper or {}).get(name), log=log)
        except (FileNotFoundError, ValueError) as e:
            raise EvaluateError(str(e)) from e
        out["timings_s"]["drift"] = round(time.perf_counter() - t0, 2)
        series["drift"] = {"configuration": name, "segment": shape.reset_every, "session": ls.as_dict()}
        log(f"drift: {ls.step} of {drift_steps} steps ({ls.pieces} pieces), {out['timings_s']['drift']} s")
        if save is not None:
            save(out)
    try:
        return judge(out)
    except ImportError as e:  # no scipy on this machine: the series are kept, judge them where it is
        out["judge_error"] = f"{e}: judge elsewhere with `livestep evaluate --from FILE`"
        log(out["judge_error"])
        return out


VIEW = {"frame_ssim": lambda f: [1 - x for x in f["ssim"]],  # the frames' distances to the truth's: bigger = worse
        "frame_psnr": lambda f: [10 ** (-x / 10) for x in f["psnr"]],  # PSNR as the MSE it stands for
        "flicker": lambda f: f["flicker"]}
assert set(VIEW) == set(FRAME_METRICS)


def judge(out: dict[str, Any]) -> dict[str, Any]:
    """The verdicts of a result's measured ``series`` (worker/evaluation_judges.py; needs scipy), in place.
    A series measured before issue 31 (no implementations, one seed) has no band: ``incomplete``."""
    from worker import evaluation_judges as J  # numpy + scipy: imported only to judge

    series = out["series"]
    verdicts: dict[str, list] = {n: [] for n in out["configurations"]}
    legacy = any("runs" not in series[k] for k in ("teacher_forced", "free_running") if k in series)
    if legacy:
        for n, got in verdicts.items():
            got.append(J.Verdict("teacher_forced_ratio", 0.0, "incomplete", 0, detail={
                "why": "measured before issue 31: no correct implementations, no band"}).as_dict())
    if "teacher_forced" in series and not legacy:
        runs = series["teacher_forced"]["runs"]
        impl_names = [i for i in runs[0]["implementations"] if all(i in r["implementations"] for r in runs)]
        b = J.band({i: [r["implementations"][i] for r in runs] for i in impl_names}, [r["plain"] for r in runs])
        out["band"] = b.as_dict()
        for n, got in verdicts.items():
            v = J.teacher_forced_verdict([r["candidates"][n] for r in runs], [r["plain"] for r in runs], b,
                                         [r["reset"] for r in runs], steps=[r["step"] for r in runs],
                                         identical=all(r["identical"][n] for r in runs))
            if not impl_names and v.verdict == "pass":
                v.verdict, v.detail["why"] = "incomplete", "no correct implementation ran: no band"
            got.append(v.as_dict())
    if "free_running" in series and not legacy:
        runs = series["free_running"]["runs"]
        impl_names = [i for i in runs[0]["implementations"] if all(i in r["implementations"] for r in runs)]
        impl = {i: [r["implementations"][i] for r in runs] for i in impl_names}
        for n, got in verdicts.items():
            if n not in runs[0]["candidates"]:  # not run free (--free-running-of): its overall stays incomplete
                continue
            v = J.trajectory_verdict([r["candidates"][n] for r in runs], [r["plain"] for r in runs], impl)
            if not impl_names and v.verdict == "pass":
                v.verdict, v.detail["why"] = "incomplete", "no correct implementation ran: no band"
            got.append(v.as_dict())
            if runs[0].get("frames"):
                for view, of in VIEW.items():
                    fv = J.trajectory_verdict([of(r["frames"][n]) for r in runs], [of(r["frames"]["plain"]) for r in runs],
                                              {i: [of(r["frames"][i]) for r in runs] for i in impl_names}, metric=view)
                    fv.detail["view"] = True  # the task-shaped view: shown, not part of the overall verdict
                    got.append(fv.as_dict())
    if "drift" in series:
        dr = series["drift"]
        name, seg, ses = dr["configuration"], dr["segment"], dr["session"]
        if ses["step"] < ses["steps"] or ses["step"] < 4 * seg:
            v = J.Verdict("drift_tau", 0.0, "incomplete", ses["step"] // seg, detail={
                "why": f"{ses['step']} of {ses['steps']} steps run: continue with --resume"})
            verdicts[name] += [v.as_dict()]
        else:
            ratio = [c / max(p, 1e-30) if not (math.isnan(p) or math.isnan(c)) else float("nan")
                     for c, p in zip(ses["candidate"], ses["plain"], strict=True)]
            verdicts[name].append(J.drift_verdict(ratio, segment=seg, metric="drift_tau").as_dict())
            verdicts[name].append(J.drift_verdict(ses["candidate"], segment=seg, metric="drift_error_tau").as_dict())
        out["drift"] = {"configuration": name, "steps": ses["steps"], "done": ses["step"], "pieces": ses["pieces"]}
    out["verdicts"] = verdicts
    out["overall"] = {n: _overall(v) for n, v in verdicts.items()}
    out["measured"] = measured(series)
    out.pop("judge_error", None)
    return out


SAME = ("preset", "tp", "device_type", "gpu_kind", "release", "truth", "metric", "steps", "configurations")


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from runs of the same evaluation on other seeds (``--seed N --seeds 1`` per device call):
    their teacher-forced and free-running series side by side. Refused unless they agree on what was
    measured (``SAME``, the band's members) and their seeds are distinct; drift series are not merged."""
    first = parts[0]
    for p in parts[1:]:
        diff = [k for k in (*SAME, "implementations") if p.get(k) != first.get(k)]
        if diff:
            raise EvaluateError(f"cannot merge evaluation {p.get('evaluation_id')} into {first.get('evaluation_id')}: "
                                f"they differ in {diff}; merge only runs of one evaluation on other seeds")
    out = {k: v for k, v in first.items() if k not in ("verdicts", "overall", "band", "measured", "drift")}
    out["series"] = {}
    for k in ("teacher_forced", "free_running"):
        got = [p["series"][k] for p in parts if k in p.get("series", {})]
        if got:
            out["series"][k] = {"seeds": [s for g in got for s in g["seeds"]], "runs": [r for g in got for r in g["runs"]]}
            if len(set(out["series"][k]["seeds"])) != len(out["series"][k]["seeds"]):
                raise EvaluateError(f"cannot merge: seed(s) measured twice in {k} ({out['series'][k]['seeds']})")
    out["seeds"] = max((len(v["seeds"]) for v in out["series"].values()), default=0)
    out["merged_from"] = [p.get("evaluation_id") for p in parts]
    return out


def measured(series: dict[str, Any]) -> dict[str, int]:
    """What the series hold -- the fewest steps, seeds and band members of the teacher-forced and
    free-running judges that ran -- never what the result's header claims: the records' ``steps``,
    ``seeds`` and ``reruns`` (what the gate checks) come from here, so a run cut short by a timeout, or
    a header edited by hand, counts for what was measured."""
    runs = [r for k in ("teacher_forced", "free_running") if "runs" in series.get(k, {}) for r in series[k]["runs"]]
    kinds = [series[k] for k in ("teacher_forced", "free_running") if "runs" in series.get(k, {})]
    if not runs:
        return {"steps": 0, "seeds": 0, "reruns": 0}
    return {"steps": min(r["steps"] for r in runs), "seeds": min(len(k["runs"]) for k in kinds),
            "reruns": len(set.intersection(*(set(r["implementations"]) for r in runs)))}


def _overall(verdicts: list[dict]) -> str:
    """pass only with both the teacher-forced and the free-running judge run and passed (the frame view
    is shown beside them, never part of it); any judge failing fails it."""
    got = {v["metric"]: v["verdict"] for v in verdicts if not v["detail"].get("view")}
    if any(v == "no_effect" for v in got.values()):
        return "no_effect"
    if any(v == "fail" for v in got.values()):
        return "fail"
    if any(v == "incomplete" for v in got.values()):
        return "incomplete"
    return "pass" if {"teacher_forced_ratio", "divergence_ratio"} <= got.keys() else "incomplete"


FLOAT_MAX = 1.7976931348623157e308  # a non-finite statistic is stored as this (with ``nonfinite``), never 0.0


def _finite(x: float) -> float:
    return x if math.isfinite(x) else FLOAT_MAX


def records(result: dict[str, Any], worker_id: str = "evaluate", evaluator: str | None = None) -> list[dict[str, Any]]:
    """The result as ``evaluation`` records: per configuration one row per judge (summary), one per point of
    its curve (``divergence`` per bin, ``drift_ratio`` per reset interval), and ``overall``; a millisecond
    apart, so each row has its own (worker, run, ts) key in the store. Every row carries what the gate
    checks: the device type and GPU kind it ran on, the preset, TP, the steps, seeds and band runs
    (``reruns``) its series hold (``measured``), and ``evaluator``: the name of the evaluator token that posted it (set by the server)."""
    ts = datetime.fromisoformat(result["date"])
    base = {"worker_id": worker_id, "session_id": result["evaluation_id"], "release": result["release"],
            "gpu_kind": result["gpu_kind"], "ts": ts, "simulated": False, "preset": result["preset"],
            "evaluator": evaluator, "device_type": result.get("device_type"), "tp": result.get("tp"),
            **measured(result["series"])}
    rows = []
    for name, verdicts in result["verdicts"].items():
        conf = {**base, "configuration": result["configurations"][name], "switch": name}
        for v in verdicts:
            nonfinite = int(v["detail"].get("nonfinite", 0)) or (0 if _finite(v["value"]) == v["value"] else 1)
            rows.append({**conf, "metric": v["metric"], "value": _finite(v["value"]), "band_lo": v["band_lo"],
                         "band_hi": v["band_hi"], "verdict": v["verdict"], "n": v["n"], "step": None,
                         "nonfinite": nonfinite})
            point = {"divergence_ratio": "divergence", "drift_tau": "drift_ratio"}.get(v["metric"])
            for p in v["curve"] if point else ():
                rows.append({**conf, "metric": point, "value": _finite(p["value"]), "band_lo": p["band_lo"],
                             "band_hi": p["band_hi"], "verdict": p["verdict"], "n": v["n"], "step": p["step"],
                             "nonfinite": 0})
        rows.append({**conf, "metric": "overall", "value": float(sum(v["verdict"] == "fail" for v in verdicts)),
                     "band_lo": None, "band_hi": None, "verdict": result["overall"][name], "n": len(verdicts),
                     "step": None, "nonfinite": sum(r["nonfinite"] for r in rows if r["switch"] == name)})
    for i, r in enumerate(rows):
        r["ts"] = ts + timedelta(milliseconds=i)
    return rows


def table(result: dict[str, Any]) -> str:
    series = result.get("series", {})
    runs = (f"{result['steps']} steps x {result.get('seeds', 1)} seeds" if {"teacher_forced", "free_running"} & series.keys() else "")
    if result.get("implementations"):
        runs += f", band: {', '.join(result['implementations'])}"
    if "drift" in series:
        runs += f"{', ' if runs else ''}a {result['drift_steps']}-step session"
    lines = [(f"evaluate {result['preset']} (tp {result['tp']}) on {result['device']} [{result['gpu_kind']}], "
              f"truth {result['truth']}, metric {result['metric']}, {runs}, commit {result['commit']}"),
             f"{'configuration':<16}{'judge':<24}{'value':>10}{'band/k':>18}{'n':>6}  verdict"]
    for name, verdicts in result["verdicts"].items():
        for v in verdicts:
            band = (f"{v['band_hi']:.4g}" if v["band_lo"] is None else f"[{v['band_lo']:.3g}, {v['band_hi']:.3g}]"
                    ) if v["band_hi"] is not None else "-"
            lines.append(f"{name:<16}{v['metric']:<24}{v['value']:>10.4g}{band:>18}{v['n']:>6}  {v['verdict']}")
        lines.append(f"{name:<16}{'overall':<24}{'':>10}{'':>18}{'':>6}  {result['overall'][name]}")
        for v in verdicts:
            if v["verdict"] in ("fail", "incomplete") and v["detail"].get("why"):
                lines.append(f"{'':<16}  {v['metric']}: {v['detail']['why']}")
    for name, why in result["skipped"].items():
        lines.append(f"{name:<16}skipped: {why}")
    for name, why in result.get("dropped_implementations", {}).items():
        lines.append(f"{name:<16}dropped from the band (could not run here): {why[:160]}")
    if "drift" in result:
        d = result["drift"]
        lines.append(f"drift ({d['configuration']}): {d['done']} of {d['steps']} steps in {d['pieces']} piece(s)")
    # last, the figure against the same run's baseline: each configuration's error / the plain path's
    for name, verdicts in result["verdicts"].items():
        tf = [v for v in verdicts if v["metric"] == "teacher_forced_ratio"]
        if tf:
            lines.append(f"ratio {name} / plain (teacher-forced error) = {tf[0]['value']:.3f}")
    return "\n".join(lines)


def ship(result: dict[str, Any], url: str, token: str | None) -> dict[str, Any]:
    """POST the result (its measured series) to the control plane's ``/v1/evaluations`` with an evaluator
    token; the server judges the series itself and stores the records. Returns its answer."""
    import httpx

    body = {k: v for k, v in result.items() if k not in ("verdicts", "overall", "drift", "band")}
    r = httpx.post(f"{url.rstrip('/')}/v1/evaluations", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {token}"} if token else {})
    if r.status_code != 201:
        raise EvaluateError(f"{url} refused the evaluation ({r.status_code}): {r.text[:500]}")
    return r.json()


def register(subparsers) -> None:
    p = subparsers.add_parser("evaluate", help="numeric switches against the plain path and the rerun band")
    p.add_argument("--preset", default="tiny", help="model shape to evaluate (default tiny)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--tp", type=int, default=1, help="evaluate one rank's shard of a TP=N split (its shape)")
    p.add_argument("--switch", action="append", default=None, metavar="NAME",
                   help=f"configurations (default: all): {', '.join([*NUMERIC_SWITCHES, PRODUCTION])}")
    p.add_argument("--only", action="append", default=None, choices=JUDGES, help="judges to run")
    p.add_argument("--steps", type=int, default=100, help="steps of the teacher-forced and free-running runs")
    p.add_argument("--seeds", type=int, default=3, help="weight seeds (each with its own prompt and noise; default 3)")
    p.add_argument("--implementations", default=None, help="the band's members, comma-separated (default: every "
                   "one that runs here: sdpa_math,sdpa_efficient,sdpa_flash,gemm_ksplit,gemm_bf16_accumulate,fp8_tensorwise)")
    p.add_argument("--free-running-of", action="append", default=None, metavar="NAME",
                   help="run the free-running judge of these configurations only (default: all; the others are "
                        "judged teacher-forced only, so their overall verdict is incomplete: no evidence)")
    p.add_argument("--no-frames", action="store_true", help="skip the decoded frames' view (PSNR, SSIM, flicker)")
    p.add_argument("--probe-stride", type=int, default=None, help="teacher-forced: probe every Nth step besides "
                   "each reset and the steps after it (default: steps // 64; 1 = every step)")
    p.add_argument("--drift-steps", type=int, default=0, help="long free-running session of the production set "
                   "(14400 = 10 minutes at 24 fps); 0: none unless --only drift")
    p.add_argument("--drift-piece", type=int, default=None, help="run at most this many of its steps in this call")
    p.add_argument("--drift-state", default=None, help="where the session's state is saved after the piece")
    p.add_argument("--resume", action="store_true", help="continue the session saved at --drift-state")
    p.add_argument("--metric", default="rel_l2", help="rel_l2, max_abs, cosine, or package.module:function")
    p.add_argument("--truth", default=None, help="fp64 | fp32 | bf16 (default: fp64, bf16 for prod57b)")
    p.add_argument("--seed", type=int, default=0, help="random seed of weights and inputs (default 0)")
    p.add_argument("--release", default="dev", help="release label of the evaluation records (default dev)")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    p.add_argument("--from", dest="from_", action="append", default=None,
                   help="a saved result (JSON) instead of measuring; repeated: the seeds of several runs of the same "
                        "evaluation (e.g. one seed per device call) merged into one result")
    p.add_argument("--collector", default=None, help="POST the result to this control plane (/v1/evaluations)")
    p.add_argument("--token", default=None, help="an evaluator token (LIVESTEP_EVALUATOR_TOKENS; not the ingest token)")
    p.set_defaults(func=cmd)


def main(argv: list[str] | None = None) -> int:
    """``python -m worker.evaluate ...`` (the GPU machine: no ``livestep`` entry point installed)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m worker.evaluate")
    register(parser.add_subparsers())
    args = parser.parse_args(["evaluate", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)



def _write(path: str, result: dict[str, Any]) -> None:
    """The result as JSON at ``path``, replaced whole (a kill mid-write leaves the previous one)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def cmd(args) -> int:
    if args.from_:
        parts = []
        for f in args.from_:
            try:
                parts.append(json.loads(Path(f).read_text()))
            except (OSError, ValueError) as e:
                raise EvaluateError(f"cannot read {f}: {e}") from e
        result = merge(parts) if len(parts) > 1 else parts[0]
        if "verdicts" not in result or len(parts) > 1:  # measured where scipy is missing, or merged: judge here
            result = judge(result)
    else:
        from worker.device import check_device

        check_device(args.device)  # one line, not a traceback, for cuda on a machine without it
        judges = tuple(args.only) if args.only else ("teacher_forced", "free_running")
        result = evaluate(args.preset, args.device, args.switch, steps=args.steps, seeds=args.seeds,
                          drift_steps=args.drift_steps, drift_piece=args.drift_piece, drift_state=args.drift_state,
                          resume=args.resume, judges=judges, metric=args.metric, truth=args.truth, seed=args.seed,
                          tp=args.tp, release=args.release, frames=not args.no_frames, probe_stride=args.probe_stride,
                          implementations=args.implementations.split(",") if args.implementations else None,
                          free_running_of=args.free_running_of, save=(lambda o: _write(args.out, o)) if args.out else None,
                          log=lambda s: print(s, file=sys.stderr, flush=True))
    if args.out:
        _write(args.out, result)
    if "verdicts" not in result:
        print(f"measured ({result['timings_s']}), not judged: {result['judge_error']}")
        return 0
    print(table(result))
    if args.collector:
        got = ship(result, args.collector, args.token)
        print(f"posted evaluation {got['evaluation_id']} to {args.collector}: {got['rows']} records, {got['overall']}")
    failed = [n for n, v in result["overall"].items() if v == "fail"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
