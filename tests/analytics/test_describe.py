"""describe: each finding kind in one sentence built from its own value, baseline, effect and evidence."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from analytics.describe import describe
from analytics.findings import KINDS, finding

T0, T1 = datetime(2026, 11, 23, tzinfo=UTC), datetime(2026, 11, 30, tzinfo=UTC)


def test_memory_growth_per_process_reads_as_bytes_per_shape_and_time_to_oom():
    row = finding("memory_growth", {"release": "v1.2", "worker_id": "w0"}, "reserved_bytes_per_shape", T0, T1,
                  value=1.019e9, baseline=6.788e10, effect=1.0, evidence={"distinct_shapes": 14, "hours_to_oom": 31.5})
    assert describe(row) == ("1.02 GB reserved per new prompt shape (+1 fused-kernel buffer per shape) over 14 "
                             "shapes; 67.9 GB reserved at the start; out of memory in ~31.5 h at this rate")
    soon = finding("memory_growth", {"worker_id": "w1"}, "reserved_bytes_per_shape", T0, T1, value=2.5e9,
                   baseline=1e11, effect=2.0, evidence={"hours_to_oom": 0.222})
    assert describe(soon) == ("2.5 GB reserved per new prompt shape (+2 fused-kernel buffers per shape); 100 GB "
                              "reserved at the start; out of memory in ~13 min at this rate")


def test_a_memory_growth_whose_key_is_ambiguous_says_so_with_its_evidence():
    ev = {"explained_by": "first_forward_tokens", "ambiguous_with": ["per session"], "key_confident": False,
          "key_tests": [{"keys": ["first_forward_tokens", "per session"], "sessions_telling_apart": 4}]}
    row = finding("memory_growth", {"release": "v1.2"}, "processes_growing_per_shape", T0, T1,
                  value=5, baseline=5, evidence=ev)
    assert describe(row) == ("5 of 5 processes of this release reserve more memory with every new "
                             "first_forward_tokens shape, or with every session served; 4 sessions tell them "
                             "apart so far")


def test_memory_growth_per_release_counts_processes():
    row = finding("memory_growth", {"release": "v1.2"}, "processes_growing_per_shape", T0, T1,
                  value=14, baseline=19, effect=14 / 19)
    assert describe(row) == "14 of 19 processes of this release reserve more memory with every new prompt shape"


def test_regression_of_a_time_metric_and_of_a_proportion():
    row = finding("regression", {"release": "v1.1", "gpu_kind": "h100"}, "step_period_ms", T0, T1,
                  value=181.2, baseline=158.9, effect=0.1403, evidence={"baseline_release": "v1.0"})
    assert describe(row) == "step_period_ms 181.2 ms against 158.9 ms on v1.0, +14.0% worse"
    row = finding("regression", {"release": "v1.1"}, "frac_le_24fps", T0, T1, value=0.31, baseline=0.04,
                  effect=0.27, evidence={"baseline_release": "v1.0"})
    assert describe(row) == "frac_le_24fps 31% against 4% on v1.0, +27 points worse"
    from analytics.stratified import NOTE

    row = finding("regression", {"release": "v1.1", "gpu_kind": "h100"}, "step_period_ms", T0, T1,
                  value=150.0, baseline=140.0, effect=0.02, evidence={"baseline_release": "v1.0", "comparison": NOTE})
    assert describe(row) == ("step_period_ms 150 ms against 140 ms on v1.0, +2.0% worse within session-length x "
                             "prompt strata")  # the medians moved with the mix; the effect is within strata


def test_fps_fraction_changepoint_canary_and_saturation():
    fps = finding("fps_fraction", {"release": "v1.0"}, "frac_le_24fps", T0, T1, value=0.125,
                  evidence={"sessions": 400, "ci_low": 0.095, "ci_high": 0.16, "iso_week": "2026-W48"})
    assert describe(fps) == "12.5% of 400 sessions at or below 24 fps in 2026-W48 (95% CI 9.5%-16%)"
    cp = finding("changepoint", {"gpu_kind": "h100"}, "cache_upkeep_ms_p50", T0, T1, value=9.1, baseline=6.2,
                 effect=0.4677, evidence={"release_gaining": "v1.1"})
    assert describe(cp) == ("daily cache_upkeep_ms_p50 moved from 6.2 ms to 9.1 ms (+46.8%); release gaining share: "
                            "v1.1")
    rate = finding("changepoint", {"gpu_kind": "h100"}, "late_chunk_rate", T0, T1, value=0.005, baseline=0.0,
                   effect=0.5)  # the effect was judged on the series shifted by 1%: not what the sentence says
    assert describe(rate) == "daily late_chunk_rate moved from 0% to 0.5% (+0.5 points)"
    verdicts = [{"metric": "step_period_ms", "effect": 0.12, "regressed": True},
                {"metric": "late_chunk_rate", "effect": 0.2, "regressed": True},
                {"metric": "diffusion_ms", "effect": 0.5, "regressed": False}]
    canary = finding("canary", {"release": "v2"}, "canary_rolled_back", T0, T1, value=1.0, effect=0.2,
                     attribution="fused_allreduce", evidence={"verdicts": verdicts})
    assert describe(canary) == "canary of fused_allreduce rolled back (worst: late_chunk_rate +20 points worse)"
    sat = finding("fp8_saturation", {"release": "v1.2", "gpu_kind": "b200"}, "fp8_saturated", T0, T1,
                  value=0.9877, baseline=0.01, effect=0.9777, evidence={"sessions": 81, "ci95": [0.93, 0.999]})
    assert describe(sat) == "98.8% of 81 sampled sessions clip FP8 activations (95% CI 93%-99.9%; tolerated 1%)"


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_described_even_with_empty_evidence(kind):
    metric = {"memory_growth": "reserved_bytes_per_shape", "fps_fraction": "frac_le_24fps",
              "canary": "canary_promoted", "fp8_saturation": "fp8_saturated"}.get(kind, "diffusion_ms")
    row = finding(kind, {"release": "v1"}, metric, T0, T1, value=0.5, baseline=0.25, effect=1.0)
    text = describe(row)
    assert text and "None" not in text
    assert describe({**row, "evidence": "not json"}) == text  # unreadable evidence: the same sentence
    assert describe({**row, "value": "n/a", "kind": "no such kind"})  # never raises
