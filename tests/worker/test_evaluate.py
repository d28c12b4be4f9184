"""``livestep evaluate`` on the tiny model: the real numeric switches pass, with the same verdict over 5
weight seeds; deliberately broken ones fail (a static scale off by 2x, a rotation applied twice --
test-only tampering, never a shipped switch); the judges give known answers on literal series (one test
per failure mode of issue 31); the records count what the series hold."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from worker import evaluation_judges as J
from worker.evaluate import CONFIGURATIONS, EvaluateError, configurations, evaluate, judge, records
from worker.fp8 import quantize_act_static
from worker.rope import apply_rope_tables


def scale_off_by_2x(model, cache) -> None:
    """Every static activation scale handed to the GEMM twice what the activation was quantized with."""
    for lin in model._linears():
        lin.site.quant = lambda x, s: (quantize_act_static(x, s)[0], s * 2)


def delta_rotation_twice(model, cache) -> None:
    """Each position reset rotates the cached keys by the delta twice."""
    once = cache.ops.delta_rotate

    def twice(buf, scale, delta):
        once(buf, scale, delta)
        once(buf, scale, delta)

    cache.ops.delta_rotate = twice


def rope_twice_at_write(model, cache) -> None:
    """The new keys rotated at write, then rotated once more by the cache's write."""
    write = cache.ops.write_kv

    def write_twice(k, v, positions, cos, sin, slots, ks, vs, kc, vc, rope_k):
        write(apply_rope_tables(k, cos, sin) if rope_k else k, v, positions, cos, sin, slots, ks, vs, kc, vc, rope_k)

    cache.ops.write_kv = write_twice


def cache_scale_rots(model, cache) -> None:
    """The per-head FP8 key scales shrink by 15 % at every position reset: a calibration that goes stale
    with session age (keys saturate more and more), the drift judge's subject."""
    begin = cache.begin_step

    def rotting(tokens, reset=False):
        if reset:
            cache.k_scale.mul_(0.85)
        return begin(tokens, reset)

    cache.begin_step = rotting


pytestmark = pytest.mark.usefixtures("torch_chains_only")  # tests/conftest.py


SEEDS = 5  # the stability goal (issue 31): every real switch's verdict the same over 5 weight seeds


@pytest.fixture(scope="module")
def real():
    """Every numeric switch and the production set, tiny, CPU, 5 weight seeds, 22 steps each (3 position
    resets), no frames (their view: its own test; world size 1: fused_allreduce skipped)."""
    return evaluate("tiny", "cpu", None, steps=22, seeds=SEEDS, frames=False, release="t1")


def _seeds(result, idx):
    """The result judged on the seeds at positions ``idx`` of its series alone."""
    import copy

    r = copy.deepcopy({k: v for k, v in result.items() if k not in ("verdicts", "overall", "band", "measured")})
    for k in ("teacher_forced", "free_running"):
        r["series"][k]["runs"] = [r["series"][k]["runs"][i] for i in idx]
        r["series"][k]["seeds"] = [r["series"][k]["seeds"][i] for i in idx]
    return judge(r)


def test_the_real_switches_pass_on_tiny(real):
    assert real["skipped"]["fused_allreduce"] == "needs a tensor-parallel group (world size 1 here)"
    assert "compile" in real["skipped"]  # inductor runs on CUDA only here
    assert "attention_fp8_dots" in real["skipped"]  # the worker's FP8 attention kernel: CUDA only
    assert real["overall"] == {n: "pass" for n in real["overall"]}, {
        n: [(v["metric"], v["verdict"], v["detail"].get("why")) for v in vs] for n, vs in real["verdicts"].items()}
    assert {"fp8_cache", "static_scales", "delta_rotation", "production"} <= set(real["overall"])
    assert {"sdpa_math", "gemm_ksplit", "gemm_bf16_accumulate", "fp8_tensorwise", "fp8_reads"} <= set(
        real["band"]["members"])
    for verdicts in real["verdicts"].values():
        tf = next(v for v in verdicts if v["metric"] == "teacher_forced_ratio")
        assert 0.5 < tf["value"] < 2 and tf["detail"]["mean_plain_error"] > 0 and tf["detail"]["resets"] == 3 * SEEDS


def test_each_real_switchs_verdict_is_the_same_over_five_seeds(real):
    """Judged at the gate's minimum of 2 seeds, on each of the 5 windows of consecutive seeds (0-1, 1-2, ...,
    4-0), every real switch passes every time. The production set (every switch at once) is borderline
    on tiny: it passes on all 5 seeds together, not on every 2-seed window (docs/PERFORMANCE.md "Issue 31")."""
    switches = [n for n in real["overall"] if n != "production"]
    got = [_seeds(real, [i, (i + 1) % SEEDS])["overall"] for i in range(SEEDS)]
    assert [{n: o[n] for n in switches} for o in got] == [dict.fromkeys(switches, "pass")] * SEEDS, got


def test_the_plain_arm_is_the_presets_switches_off_path_and_the_result_says_so(real):
    """tiny's plain path reads attention in bf16 (its preset), weights in production's FP8 regime; the FP8
    per-read attention of the production presets is a named band member, not the plain arm's."""
    assert real["numerics"]["attention_reads"] == "bf16" and real["numerics"]["weights"] == "fp8"
    from worker.evaluation_implementations import available

    assert "fp8_reads" in [i.name for i in available("cpu")]
    assert "fp8_reads" not in [i.name for i in available("cpu", fp8_attention=True)]  # prod: it *is* the plain path


def test_the_decoded_frames_are_scored_beside_the_latents():
    r = evaluate("tiny", "cpu", ["fp8_cache"], steps=4, seeds=1, judges=("free_running",), release="t1")
    views = {v["metric"]: v for v in r["verdicts"]["fp8_cache"] if v["detail"].get("view")}
    assert set(views) == {"frame_ssim", "frame_psnr", "flicker"}
    frames = r["series"]["free_running"]["runs"][0]["frames"]
    assert all(0 < x <= 99 for x in frames["fp8_cache"]["psnr"]) and all(x <= 1 for x in frames["plain"]["ssim"])
    assert {x["metric"] for x in records(r)} >= {"frame_ssim", "frame_psnr", "flicker"}  # the contract takes them


def test_a_cpu_evaluation_is_the_cpu_kind_read_from_the_device(real):
    """No flag names the GPU kind: the evaluator reads it from the device, so a CPU run is ``cpu``."""
    assert (real["device_type"], real["gpu_kind"]) == ("cpu", "cpu")
    rows = records(real, evaluator="ci")
    assert {(r["gpu_kind"], r["device_type"], r["preset"], r["seeds"], r["steps"]) for r in rows} == {
        ("cpu", "cpu", "tiny", SEEDS, 22)}
    from worker.evaluate import main
    with pytest.raises(SystemExit):
        main(["--gpu-kind", "NVIDIA H200", "--steps", "4"])


def test_a_switch_that_changes_nothing_is_no_effect_never_a_pass(real):
    r = {k: v for k, v in real.items() if k not in ("verdicts", "overall")}
    r = __import__("copy").deepcopy(r)
    r["configurations"]["same"] = ""
    for run in r["series"]["teacher_forced"]["runs"]:
        run["candidates"]["same"] = run["plain"]
        run["identical"]["same"] = True
    for run in r["series"]["free_running"]["runs"]:
        run["candidates"]["same"] = run["plain"]
    assert judge(r)["overall"]["same"] == "no_effect"


@pytest.mark.parametrize("switch,tamper", [("static_scales", scale_off_by_2x),
                                           ("delta_rotation", delta_rotation_twice),
                                           ("rope_at_write", rope_twice_at_write)])
def test_a_broken_optimization_fails(switch, tamper):
    r = evaluate("tiny", "cpu", [switch], steps=22, seeds=2, frames=False, tamper={switch: tamper})
    assert r["overall"] == {switch: "fail"}, r["verdicts"]


def test_the_records_count_what_the_series_hold_not_what_the_header_claims(real, tmp_path):
    """A run cut short (here: one seed of five kept) or a header edited by hand counts for what was measured;
    ``save`` leaves a judgeable file after every finished judge of every seed."""
    cut = _seeds(real, [0])
    cut["seeds"], cut["steps"], cut["reruns"] = 99, 9999, 99
    assert {(r["seeds"], r["steps"], r["reruns"]) for r in records(cut)} == {(1, 22, len(real["implementations"]))}
    saved = []
    evaluate("tiny", "cpu", ["fp8_cache"], steps=3, seeds=2, frames=False, implementations=["gemm_ksplit"],
             save=lambda o: saved.append(__import__("json").dumps(o)))
    assert len(saved) == 4  # 2 seeds x (teacher-forced, free-running)
    first = __import__("json").loads(saved[0])
    assert len(first["series"]["teacher_forced"]["runs"]) == 1 and "free_running" not in first["series"]


def test_a_band_member_that_cannot_run_here_is_dropped_with_its_reason_and_the_run_goes_on(monkeypatch):
    """A one-shot device call must not end on a member an op refuses: it leaves the band, said why, and the
    records count the members that ran."""
    from worker import evaluation_implementations as I

    def refuse(self, x):
        raise RuntimeError("scaled_mm: not on this device")

    monkeypatch.setattr(I.SplitKLinear, "__call__", refuse)
    r = evaluate("tiny", "cpu", ["fp8_cache"], steps=3, seeds=2, frames=False,
                 implementations=["sdpa_math", "gemm_ksplit"])
    assert set(r["dropped_implementations"]) == {"gemm_ksplit"} and "not on this device" in r[
        "dropped_implementations"]["gemm_ksplit"]
    assert r["implementations"] == ["sdpa_math"] and set(r["band"]["members"]) == {"sdpa_math"}
    assert {x["reruns"] for x in records(r)} == {1}


def test_seeds_run_in_separate_calls_merge_into_one_evaluation(real, tmp_path, capsys):
    """One seed per device call: ``--from a --from b`` judges them as one evaluation of both seeds (the
    gate's minimum); runs of another evaluation, or the same seed twice, are refused."""
    import json

    from worker.evaluate import main

    for i in (0, 1):
        (tmp_path / f"s{i}.json").write_text(json.dumps(_seeds(real, [i])))
    assert main(["--from", str(tmp_path / "s0.json"), "--from", str(tmp_path / "s1.json"),
                 "--out", str(tmp_path / "both.json")]) == 0
    both = json.loads((tmp_path / "both.json").read_text())
    assert both["measured"]["seeds"] == 2 and both["overall"] == _seeds(real, [0, 1])["overall"]
    with pytest.raises(EvaluateError, match="measured twice"):
        main(["--from", str(tmp_path / "s0.json"), "--from", str(tmp_path / "s0.json")])
    other = {**json.loads((tmp_path / "s1.json").read_text()), "preset": "small"}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(EvaluateError, match="differ in \\['preset'\\]"):
        main(["--from", str(tmp_path / "s0.json"), "--from", str(tmp_path / "other.json")])
    capsys.readouterr()


def test_free_running_of_a_subset_leaves_the_others_without_that_judge():
    r = evaluate("tiny", "cpu", ["fp8_cache", "static_scales"], steps=3, seeds=1, frames=False,
                 implementations=["gemm_ksplit"], free_running_of=["fp8_cache"])
    judged = {n: {v["metric"] for v in vs} for n, vs in r["verdicts"].items()}
    assert "divergence_ratio" in judged["fp8_cache"] and "divergence_ratio" not in judged["static_scales"]
    assert r["overall"]["static_scales"] != "pass"
    from worker.evaluate import _overall  # a teacher-forced pass alone is no evidence
    assert _overall([{"metric": "teacher_forced_ratio", "verdict": "pass", "detail": {}}]) == "incomplete"
    with pytest.raises(EvaluateError, match="not among the configurations"):
        evaluate("tiny", "cpu", ["fp8_cache"], steps=3, seeds=1, free_running_of=["production"])


def test_records_carry_the_contract_fields(real):
    rows = records(real)
    kinds = {(r["switch"], r["metric"]) for r in rows}
    assert ("production", "overall") in kinds and ("fp8_cache", "divergence") in kinds
    curve = [r for r in rows if r["switch"] == "fp8_cache" and r["metric"] == "divergence"]
    assert [r["step"] for r in curve] == sorted(r["step"] for r in curve) and curve[-1]["step"] == 22
    assert {r["release"] for r in rows} == {"t1"} and all(r["configuration"] for r in rows)


def test_a_non_finite_statistic_is_stored_as_such_never_as_zero(real):
    import copy

    r = copy.deepcopy({k: v for k, v in real.items() if k not in ("verdicts", "overall")})
    for run in r["series"]["free_running"]["runs"]:
        run["candidates"]["fp8_cache"][5] = float("nan")
    got = judge(r)
    fr = next(v for v in got["verdicts"]["fp8_cache"] if v["metric"] == "divergence_ratio")
    assert fr["verdict"] == "fail" and fr["detail"]["nonfinite"] == SEEDS and got["overall"]["fp8_cache"] == "fail"
    row = next(x for x in records(got) if x["switch"] == "fp8_cache" and x["metric"] == "divergence_ratio")
    assert row["value"] > 1e300 and row["nonfinite"] == SEEDS


def test_unknown_names_are_refused_with_the_valid_ones():
    with pytest.raises(EvaluateError, match="valid: ring_cache"):
        configurations(["cuda_graphs"])
    with pytest.raises(EvaluateError, match="valid: teacher_forced"):
        evaluate("tiny", "cpu", ["fp8_cache"], judges=("vibes",))
    with pytest.raises(EvaluateError, match="valid: sdpa_math"):
        evaluate("tiny", "cpu", ["fp8_cache"], implementations=["cublas_magic"])
    assert set(CONFIGURATIONS) >= {"fp8_cache", "static_scales", "triton_kernels"}


def test_a_metric_is_a_callable():
    calls = []

    def mine(x: torch.Tensor, ref: torch.Tensor) -> float:
        calls.append(x.shape)
        return float((x - ref).abs().mean())

    import sys
    import types

    mod = types.ModuleType("my_metric_mod")
    mod.score = mine
    sys.modules["my_metric_mod"] = mod
    r = evaluate("tiny", "cpu", ["fp8_cache"], steps=4, seeds=1, judges=("teacher_forced",), metric="my_metric_mod:score")
    assert calls and r["metric"] == "my_metric_mod:score"


def test_the_readme_lip_sync_metric_runs_as_written(tmp_path, monkeypatch):
    """README "Your own metric": its module, with a stand-in scorer (the lower half's mean level, where a
    mouth would be), plugs in by module path and receives latents it decodes to frames."""
    import re
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    [code] = re.findall(r"```python\n(# mylab/lipsync_metric\.py.*?)```", readme, flags=re.DOTALL)
    (tmp_path / "mylab").mkdir()
    (tmp_path / "mylab" / "__init__.py").write_text("")
    (tmp_path / "mylab" / "lipsync_metric.py").write_text(
        "def my_lipsync_score(frames):\n    return float(frames[..., frames.shape[-2] // 2:, :].mean())\n\n" + code)
    monkeypatch.syspath_prepend(str(tmp_path))
    r = evaluate("tiny", "cpu", ["fp8_cache"], steps=4, seeds=1, judges=("teacher_forced",), frames=False,
                 metric="mylab.lipsync_metric:distance")
    assert r["metric"] == "mylab.lipsync_metric:distance"
    tf = r["series"]["teacher_forced"]["runs"][0]
    assert all(np.isfinite(tf["plain"])) and any(x > 0 for x in tf["plain"])
    sys.modules.pop("mylab.lipsync_metric", None)
    sys.modules.pop("mylab", None)


# -- the long free-running session: drift, in pieces --------------------------------------------

def test_a_long_session_run_in_pieces_equals_one_run_and_an_accumulating_error_fails(tmp_path):
    """Two calls (``--resume`` from the saved state) give the series one call gives; a calibration that
    rots with age fails the drift judge, the real production set on the same session does not."""
    kw = {"steps": 4, "seeds": 1, "judges": ("drift",), "drift_steps": 7 * 6, "frames": False}
    whole = evaluate("tiny", "cpu", ["production"], **kw)
    state = str(tmp_path / "drift.pt")
    first = evaluate("tiny", "cpu", ["production"], drift_piece=20, drift_state=state, **kw)
    assert first["overall"]["production"] == "incomplete" and first["drift"]["done"] == 20
    second = evaluate("tiny", "cpu", ["production"], drift_piece=100, drift_state=state, resume=True, **kw)
    a, b = whole["series"]["drift"]["session"], second["series"]["drift"]["session"]
    assert b["pieces"] == 2 and b["step"] == 42 and b["candidate"] == a["candidate"] and b["plain"] == a["plain"]
    assert {v["metric"]: v["verdict"] for v in second["verdicts"]["production"]}["drift_tau"] == "pass"
    rotten = evaluate("tiny", "cpu", ["production"], tamper={"production": cache_scale_rots},
                      **{**kw, "drift_steps": 7 * 12})
    assert {v["metric"]: v["verdict"] for v in rotten["verdicts"]["production"]}["drift_tau"] == "fail"


# -- the judges on literal series: each failure mode of issue 31 --------------------------------

def _band(hi=1.05, step_hi=1.3):
    return J.Band(0.97, hi, step_hi, {"sdpa_math": [hi]})


def _resets(n, every=42):
    return [[i > 0 and i % every == 0 for i in range(n)]]


def test_a_band_from_correct_implementations_and_a_more_accurate_switch_passes():
    plain = [[0.02] * 50, [0.03] * 50]
    b = J.band({"sdpa_math": [[0.021] * 50, [0.029] * 50], "gemm_ksplit": [[0.0195] * 50, [0.031] * 50]}, plain)
    assert b.hi == pytest.approx(1.05) and b.lo == pytest.approx(0.966, abs=1e-3) and b.step_hi == pytest.approx(1.05)
    better = J.teacher_forced_verdict([[0.01] * 50, [0.015] * 50], plain, b, _resets(50, 7) * 2)
    assert better.verdict == "pass" and better.value == pytest.approx(0.5)


def test_twice_the_plain_error_on_every_step_fails():
    """1.95x the plain path's error passed k = 2 on every step; the band is the implementations' spread."""
    v = J.teacher_forced_verdict([[0.039] * 200], [[0.02] * 200], _band(), _resets(200))
    assert v.verdict == "fail" and "above the band" in v.detail["why"]


def test_the_allowance_is_bounded_in_size_not_only_in_count():
    plain = [[0.02] * 100]
    one = [[0.02] * 100]
    one[0][50] = 20.0  # one step at 1000x
    assert J.teacher_forced_verdict(one, plain, _band(), _resets(100, 7)).verdict == "fail"
    plain = [[0.02] * 1000]
    ten = [[0.02] * 1000]
    for i in range(5, 1000, 100):
        ten[0][i] = 2e4  # 10 steps at 1e6x per 1000
    v = J.teacher_forced_verdict(ten, plain, _band(), _resets(1000, 42))
    assert v.verdict == "fail" and v.detail["steady"]["worst"] > J.CAP


def test_nan_fails_every_judge():
    nan = [[float("nan")] * 100]
    assert J.teacher_forced_verdict(nan, [[0.02] * 100], _band(), _resets(100, 7)).verdict == "fail"
    assert J.trajectory_verdict(nan * 2, [[0.02] * 100] * 2, {}).verdict == "fail"
    assert J.drift_verdict([float("nan")] * 42 * 10).verdict == "fail"


def test_a_jump_in_the_last_segments_fails_the_drift_judge():
    rng = np.random.default_rng(3)
    series = 1 + 0.05 * rng.standard_normal(42 * 42)
    assert J.drift_verdict(series).verdict == "pass"
    series[-2 * 42:] *= 50  # the last 2 of 42 segments
    v = J.drift_verdict(series)
    assert v.verdict == "fail" and "median" in v.detail["why"]


def test_a_break_at_every_third_reset_fails_as_its_own_class():
    """On prod57b (a reset every 42 steps) a break at every third reset is 0.8 % of the steps: within a
    1 %-of-steps allowance. Judged as their own class, the reset steps fail; and a run with too few
    resets to see it is incomplete, never a pass."""
    n = 42 * 30
    plain = [[0.02] * n]
    resets = _resets(n)
    cand = [[0.021 if not (i > 0 and i % 126 == 0) else 0.2 for i in range(n)]]
    v = J.teacher_forced_verdict(cand, plain, _band(), resets)
    assert v.verdict == "fail" and v.detail["reset"]["steps_over"] == 9 and "reset steps" in v.detail["why"]
    short = J.teacher_forced_verdict([[0.021] * 100], [[0.02] * 100], _band(), _resets(100))
    assert short.verdict == "incomplete" and "needs >= 3" in short.detail["why"]


def test_one_heads_scale_off_fails_the_free_running_judge():
    """A candidate 1.9x as far from the truth's trajectory as the plain path, where the implementations
    vary by 5 %, fails; the same candidate at 1.02x passes."""
    rng = np.random.default_rng(4)
    plain = [list(0.03 + 0.001 * rng.standard_normal(100)) for _ in range(3)]
    impl = {"sdpa_math": [list(np.array(p) * 1.05) for p in plain]}
    off = [list(np.array(p) * 1.9) for p in plain]
    assert J.trajectory_verdict(off, plain, impl).verdict == "fail"
    assert J.trajectory_verdict([list(np.array(p) * 1.02) for p in plain], plain, impl).verdict == "pass"


H200 = os.path.join(os.path.dirname(__file__), "h200")


def _h200(judge_name: str) -> dict:
    """A series measured on the H200 (one TP=3 rank of prod57b, docs/PERFORMANCE.md's issue-22 runs),
    as ``--out`` wrote it, verdicts removed: what the judges here make of data they did not produce."""
    import json

    with open(os.path.join(H200, f"evaluate_prod57b_tp3_{judge_name}.json")) as f:
        return json.load(f)


def test_the_h200_series_of_issue_22_have_no_band_and_are_no_evidence():
    """Measured before issue 31 (one seed, a synthetic rerun band, no correct implementations): the
    judges call them incomplete, so the gate can never read them as a pass."""
    for name in ("teacher_forced", "free_running"):
        got = judge(_h200(name))
        assert set(got["overall"].values()) == {"incomplete"}, name
