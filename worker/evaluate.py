"""``livestep evaluate``: every numeric switch, and the production set, against the plain path.

    livestep evaluate --preset tiny --device cpu                    # each numeric switch + production
    livestep evaluate --preset small --switch fp8_cache --steps 200 --reruns 6 --out eval.json
    livestep evaluate --preset tiny --only drift --drift-steps 14400          # a 10-minute session
    livestep evaluate --from eval.json --collector http://127.0.0.1:8000 --token T   # ship a saved run

Per configuration (a switch with the switches it needs, ``CONFIGURATIONS``; ``production`` = every
optimization on) three judges (worker/evaluation_judges.py) on the measurements of
worker/evaluation_runs.py: the teacher-forced error against the plain path's own, the free-running
divergence against the rerun band, and -- for the production set, ``--drift-steps`` -- the
teacher-forced error over session age (its trend). A configuration passes when every judge it ran
passes; a switch whose latents equal the plain path's on this device is ``no_effect``, never a pass.
Skipped: ``fused_allreduce`` at world size 1 (it needs a TP group), and on the CPU ``compile`` (inductor
runs on CUDA only here), ``attention_fp8_dots`` (the worker's FP8 attention kernel: CUDA only) and
``triton_kernels`` unless ``TRITON_INTERPRET=1``.

Results print as a table; ``--out`` writes them as JSON (the H200 machine has no pydantic: measure
there, ship here with ``--from``); ``--collector`` ships them as ``evaluation`` records, the evidence
the control plane's gate on numeric switch defaults reads (api/evaluation_gate.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from collector.switch_names import NUMERIC_SWITCHES

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


def evaluate(preset: str = "tiny", device: str = "cpu", switches: list[str] | None = None, *, steps: int = 100,
             reruns: int = 4, drift_steps: int = 0, judges: tuple[str, ...] = ("teacher_forced", "free_running"),
             metric: str = "rel_l2", truth: str | None = None, perturbation: str = "auto", seed: int = 0,
             tp: int = 1, k: float | None = None, atol: float | None = None, release: str = "dev",
             gpu_kind: str | None = None, tamper: dict[str, Callable] | None = None,
             log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure and judge; the result is plain JSON data (``records`` turns it into evaluation records).
    ``tamper`` (tests only): configuration name -> ``fn(model, cache)`` that breaks that candidate."""
    import torch

    from worker.config import ModelShape, tp_rank_of
    from worker.evaluation_runs import Models, drift_session, free_running, load_metric, teacher_forced

    bad = [j for j in judges if j not in JUDGES]
    if bad:
        raise EvaluateError(f"unknown judge(s) {bad}; valid: {', '.join(JUDGES)}")
    shape = ModelShape.from_name(preset)
    shape = tp_rank_of(shape, tp) if tp > 1 else shape
    dev = torch.device(device)
    if dev.type == "cpu" and shape.d_model <= 256:
        torch.set_num_threads(1)  # as the worker does: a tiny model is 10x slower when two threads contend
    truth = truth or ("bf16" if shape.n_blocks * shape.d_model > 100_000 else "fp64")
    truth_dtype = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}.get(truth)
    if truth_dtype is None:
        raise EvaluateError(f"truth {truth!r}; valid: fp64, fp32, bf16")
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
    if "drift" in judges or drift_steps:
        judges = tuple(dict.fromkeys([*judges, "drift"]))
        drift_steps = drift_steps or 14_400
    t0 = time.perf_counter()
    models = Models(shape, dev, dtype=torch.bfloat16, fp8=True, truth_dtype=truth_dtype)
    log(f"models built ({preset}, truth {truth}) in {time.perf_counter() - t0:.1f} s; configurations: "
        f"{', '.join(cands)}")
    out: dict[str, Any] = {
        "preset": preset, "tp": tp, "device": str(dev), "release": release,
        "gpu_kind": gpu_kind or (torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"),
        "commit": _commit(), "date": datetime.now(UTC).isoformat(timespec="seconds"), "truth": truth,
        "metric": metric_name, "steps": steps, "reruns": reruns, "drift_steps": drift_steps, "seed": seed,
        "evaluation_id": uuid.uuid4().hex[:16], "skipped": skipped, "timings_s": {},
        "configurations": {n: sw.encode() for n, sw in cands.items()},
    }
    series: dict[str, Any] = {}
    out["series"] = series
    if "teacher_forced" in judges:
        t0 = time.perf_counter()
        tf = teacher_forced(models, cands, steps, metric=metric_fn, seed=seed, tamper=tamper, log=log)
        out["timings_s"]["teacher_forced"] = round(time.perf_counter() - t0, 2)
        series["teacher_forced"] = {"plain": tf.plain, "candidates": tf.candidates, "identical": tf.identical}
        log(f"teacher-forced: {steps} steps, {len(cands)} configurations, {out['timings_s']['teacher_forced']} s")
    if "free_running" in judges:
        t0 = time.perf_counter()
        fr = free_running(models, cands, steps, reruns, metric=metric_fn, seed=seed, perturbation=perturbation,
                          tamper=tamper, log=log)
        out["timings_s"]["free_running"] = round(time.perf_counter() - t0, 2)
        out["perturbation"] = fr.perturbation
        series["free_running"] = {"reruns": fr.reruns, "candidates": fr.candidates}
        log(f"free-running: {steps} steps x {reruns} reruns, {out['timings_s']['free_running']} s")
    if "drift" in judges:
        name = PRODUCTION if PRODUCTION in cands else next(iter(cands))
        t0 = time.perf_counter()
        dr = drift_session(models, name, cands[name], drift_steps, metric=metric_fn, seed=seed,
                           per_interval=DRIFT_PROBES, tamper=(tamper or {}).get(name), log=log)
        out["timings_s"]["drift"] = round(time.perf_counter() - t0, 2)
        series["drift"] = {"configuration": name, "segment": DRIFT_PROBES, "stride": shape.reset_every // DRIFT_PROBES,
                           "steps": drift_steps, "plain": dr.plain, "candidate": dr.candidates[name],
                           "reset": dr.reset, "saturated": dr.saturated[name]}
        log(f"drift: {drift_steps} steps, {out['timings_s']['drift']} s")
    out["judge"] = {"k": k, "atol": atol, "k_divergence": None}  # None: the judges' defaults
    try:
        return judge(out)
    except ImportError as e:  # no scipy on this machine: the series are kept, judge them where it is
        out["judge_error"] = f"{e}: judge elsewhere with `livestep evaluate --from FILE`"
        log(out["judge_error"])
        return out


def judge(out: dict[str, Any]) -> dict[str, Any]:
    """The verdicts of a result's measured ``series`` (worker/evaluation_judges.py; needs scipy), in place."""
    from worker import evaluation_judges as J  # numpy + scipy: imported only to judge

    given = out["judge"]
    out["judge"] = {"k": J.K if given.get("k") is None else given["k"],
                    "atol": J.ATOL if given.get("atol") is None else given["atol"],
                    "k_divergence": J.K_DIVERGENCE if given.get("k_divergence") is None else given["k_divergence"]}
    series, kd = out["series"], {"k": out["judge"]["k"], "atol": out["judge"]["atol"]}
    verdicts: dict[str, list] = {n: [] for n in out["configurations"]}
    if "teacher_forced" in series:
        tf = series["teacher_forced"]
        for n, got in verdicts.items():
            got.append(J.teacher_forced_verdict(tf["candidates"][n], tf["plain"], identical=tf["identical"][n],
                                                **kd).as_dict())
    if "free_running" in series:
        fr = series["free_running"]
        for n, got in verdicts.items():
            got.append(J.divergence_verdict(fr["candidates"][n], fr["reruns"], k=out["judge"]["k_divergence"]).as_dict())
    if "drift" in series:
        dr = series["drift"]
        name, seg, stride = dr["configuration"], dr["segment"], dr.get("stride", 1)
        ratio = [c / max(p, 1e-30) for c, p in zip(dr["candidate"], dr["plain"], strict=True)]
        verdicts[name].append(J.drift_verdict(ratio, segment=seg, stride=stride, metric="drift_tau").as_dict())
        verdicts[name].append(J.drift_verdict(dr["candidate"], segment=seg, stride=stride,
                                              metric="drift_error_tau").as_dict())
        resets = [c for c, r in zip(ratio, dr["reset"], strict=True) if r]
        steady = [c for c, r in zip(ratio, dr["reset"], strict=True) if not r]
        out["drift"] = {"configuration": name, "steps": dr.get("steps", len(ratio)), "probes": len(ratio),
                        "resets": len(resets),
                        "mean_ratio_reset_steps": sum(resets) / len(resets) if resets else None,
                        "mean_ratio_other_steps": sum(steady) / len(steady) if steady else None,
                        "saturated": dr["saturated"]}
    out["verdicts"] = verdicts
    out["overall"] = {n: _overall(v) for n, v in verdicts.items()}
    out.pop("judge_error", None)
    return out


def _overall(verdicts: list[dict]) -> str:
    """pass only with both the teacher-forced and the free-running judge run and passed."""
    got = {v["metric"]: v["verdict"] for v in verdicts}
    if any(v == "no_effect" for v in got.values()):
        return "no_effect"
    if any(v == "fail" for v in got.values()):
        return "fail"
    return "pass" if {"teacher_forced_ratio", "divergence_ratio"} <= got.keys() else "incomplete"


def records(result: dict[str, Any], worker_id: str = "evaluate") -> list[dict[str, Any]]:
    """The result as ``evaluation`` records: per configuration one row per judge (summary), one per point of
    its curve (``divergence`` against the band, ``drift_ratio`` per reset interval), and ``overall``; a
    millisecond apart, so each row has its own (worker, run, ts) key in the store."""
    ts = datetime.fromisoformat(result["date"])
    base = {"worker_id": worker_id, "session_id": result["evaluation_id"], "release": result["release"],
            "gpu_kind": result["gpu_kind"], "ts": ts, "simulated": False, "preset": result["preset"]}
    rows = []
    for name, verdicts in result["verdicts"].items():
        conf = {**base, "configuration": result["configurations"][name], "switch": name}
        for v in verdicts:
            rows.append({**conf, "metric": v["metric"], "value": v["value"], "band_lo": v["band_lo"],
                         "band_hi": v["band_hi"], "verdict": v["verdict"], "n": v["n"], "step": None})
            point = {"divergence_ratio": "divergence", "drift_tau": "drift_ratio"}.get(v["metric"])
            for p in v["curve"] if point else ():
                rows.append({**conf, "metric": point, "value": p["value"], "band_lo": p["band_lo"],
                             "band_hi": p["band_hi"], "verdict": p["verdict"], "n": v["n"], "step": p["step"]})
        rows.append({**conf, "metric": "overall", "value": float(sum(v["verdict"] == "fail" for v in verdicts)),
                     "band_lo": None, "band_hi": None, "verdict": result["overall"][name], "n": len(verdicts),
                     "step": None})
    for i, r in enumerate(rows):
        r["ts"] = ts + timedelta(milliseconds=i)
    return rows


def table(result: dict[str, Any]) -> str:
    series = result.get("series", {})
    runs = (f"{result['steps']} steps" if {"teacher_forced", "free_running"} & series.keys() else "")
    if "free_running" in series:
        runs += f", {result['reruns']} reruns ({result.get('perturbation', '-')})"
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
    for name, why in result["skipped"].items():
        lines.append(f"{name:<16}skipped: {why}")
    if "drift" in result:
        d = result["drift"]
        lines.append(f"drift ({d['configuration']}, {d['steps']} steps, {d.get('probes', d['steps'])} probes, "
                     f"{d['resets']} of them at resets): ratio to the plain "
                     f"path's error {d['mean_ratio_reset_steps'] or 0:.3f} at reset steps, "
                     f"{d['mean_ratio_other_steps'] or 0:.3f} elsewhere")
    # last, the figure against the same run's baseline: each configuration's error / the plain path's
    for name, verdicts in result["verdicts"].items():
        tf = [v for v in verdicts if v["metric"] == "teacher_forced_ratio"]
        if tf:
            lines.append(f"ratio {name} / plain (teacher-forced error) = {tf[0]['value']:.3f}")
    return "\n".join(lines)


def ship(result: dict[str, Any], url: str, token: str | None, worker_id: str = "evaluate") -> int:
    """Send the result's evaluation records through the collector (the shipping client); rows sent."""
    from collector.client import TelemetryClient

    client = TelemetryClient(url, token=token)
    rows = records(result, worker_id)
    for r in rows:
        client.put("evaluation", r)
    client.close(timeout_s=10.0)
    if client.dropped:
        raise EvaluateError(f"{client.dropped} of {len(rows)} evaluation records were not accepted by {url}")
    return len(rows)


def register(subparsers) -> None:
    p = subparsers.add_parser("evaluate", help="numeric switches against the plain path and the rerun band")
    p.add_argument("--preset", default="tiny", help="model shape to evaluate (default tiny)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--tp", type=int, default=1, help="evaluate one rank's shard of a TP=N split (its shape)")
    p.add_argument("--switch", action="append", default=None, metavar="NAME",
                   help=f"configurations (default: all): {', '.join([*NUMERIC_SWITCHES, PRODUCTION])}")
    p.add_argument("--only", action="append", default=None, choices=JUDGES, help="judges to run")
    p.add_argument("--steps", type=int, default=100, help="steps of the teacher-forced and free-running runs")
    p.add_argument("--reruns", type=int, default=4, help="perturbed runs of the plain path and of each candidate")
    p.add_argument("--drift-steps", type=int, default=0, help="long-session drift of the production set "
                   "(14400 = 10 minutes at 24 fps); 0: none unless --only drift")
    p.add_argument("--metric", default="rel_l2", help="rel_l2, max_abs, cosine, or package.module:function")
    p.add_argument("--truth", default=None, help="fp64 | fp32 | bf16 (default: fp64, bf16 for prod57b)")
    p.add_argument("--perturbation", default="auto", choices=("auto", "input", "nondeterminism"),
                   help="what varies between reruns: input noise, or the device's own nondeterminism (auto: the device's on CUDA unless bitwise repeatable, else input)")
    p.add_argument("--k", type=float, default=None, help="teacher-forced: err <= k * err_plain + atol")
    p.add_argument("--atol", type=float, default=None, help="teacher-forced: the absolute slack in that bound")
    p.add_argument("--seed", type=int, default=0, help="random seed of weights and inputs (default 0)")
    p.add_argument("--release", default="dev", help="release label of the evaluation records (default dev)")
    p.add_argument("--gpu-kind", default=None, help="label (default: the device's name, as workers report it)")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    p.add_argument("--from", dest="from_", default=None, help="a saved result (JSON) instead of measuring")
    p.add_argument("--collector", default=None, help="ship the result as evaluation records to this collector")
    p.add_argument("--token", default=None, help="ingest bearer token")
    p.set_defaults(func=cmd)


def main(argv: list[str] | None = None) -> int:
    """``python -m worker.evaluate ...`` (the GPU machine: no ``livestep`` entry point installed)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m worker.evaluate")
    register(parser.add_subparsers())
    args = parser.parse_args(["evaluate", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)



def cmd(args) -> int:
    if args.from_:
        try:
            result = json.loads(Path(args.from_).read_text())
        except (OSError, ValueError) as e:
            raise EvaluateError(f"cannot read {args.from_}: {e}") from e
        if "verdicts" not in result:  # measured where scipy is missing: judge here
            result = judge(result)
    else:
        from worker.device import check_device

        check_device(args.device)  # one line, not a traceback, for cuda on a machine without it
        judges = tuple(args.only) if args.only else ("teacher_forced", "free_running")
        result = evaluate(args.preset, args.device, args.switch, steps=args.steps, reruns=args.reruns,
                          drift_steps=args.drift_steps, judges=judges, metric=args.metric, truth=args.truth,
                          perturbation=args.perturbation, seed=args.seed, tp=args.tp, k=args.k, atol=args.atol,
                          release=args.release, gpu_kind=args.gpu_kind,
                          log=lambda s: print(s, file=sys.stderr, flush=True))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if "verdicts" not in result:
        print(f"measured ({result['timings_s']}), not judged: {result['judge_error']}")
        return 0
    print(table(result))
    if args.collector:
        print(f"shipped {ship(result, args.collector, args.token)} evaluation records to {args.collector}")
    failed = [n for n, v in result["overall"].items() if v == "fail"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
