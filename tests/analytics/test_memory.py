"""Memory growth per new shape: the August incident is found within a day of its rollout and
blamed on the fused all-reduce; a healthy fleet is not flagged."""

import json
from datetime import timedelta

import pytest

from analytics import memory
from analytics.findings import read_findings
from analytics.jobs import run_job
from analytics.simulate import LEAK_BYTES_PER_TOKEN, simulate_fleet
from collector.gpu_kinds import canonical_gpu_kind


def test_august_incident_flagged_within_a_day_and_attributed(store, small):
    small["workers"] = 12
    sim = simulate_fleet(store, weeks=1, incidents=[("august", 3)], seed=11, **small)
    aug = sim.release("august")
    rows = run_job("memory", store, end=aug.start + timedelta(days=1))
    summary = [r for r in rows if r["scope"] == f"release={aug.name}"]
    assert len(summary) == 1
    assert summary[0]["attribution"] == "fused_allreduce"
    assert summary[0]["severity"] == "critical"
    per_process = [r for r in rows if "worker_id=" in r["scope"]]
    assert per_process and all(r["scope"].startswith(f"release={aug.name},") for r in per_process)
    leaking_workers = {w.worker_id for w in sim.workers if "fused_allreduce" in w.switches}
    for r in per_process:
        ev = json.loads(r["evidence"])
        assert r["scope"].split("worker_id=")[1] in leaking_workers
        # the leaked buffer is sized by the prompt (1 MiB per first-forward token): named for the tokens of
        # the new first-forward shapes, at the bytes per token the kernel keeps
        assert ev["explained_by"] == memory.SIZED and ev["key"] == "first_forward_tokens"
        assert 0.8 * LEAK_BYTES_PER_TOKEN < r["value"] < 1.25 * LEAK_BYTES_PER_TOKEN
        assert ev["buffers_per_shape"] > 0.9 and ev["p_value"] < 1e-3
        assert ev["hours_to_oom"] is not None and ev["hours_to_oom"] < 72
    assert len(read_findings(store, kind="memory_growth", status="open")) == len(rows)


def test_healthy_and_benign_fleets_are_not_flagged(store, small):
    sim = simulate_fleet(store, weeks=1, incidents=["benign"], seed=12, **small)
    procs, rows = memory.analyze(store, sim.start, sim.end)
    assert rows == []
    assert len(procs) >= len(sim.workers) and not procs["flagged"].any()


def test_processes_split_at_deploys_and_ooms(store, small):
    sim = simulate_fleet(store, weeks=1, incidents=[("august", 2)], seed=13, **small)
    s = memory.sessions_with_processes(store, sim.start, sim.end)
    assert sim.ooms > 0
    n_proc = s.select("process").n_unique()
    # one process per worker before the rollout, one after the deploy, one more after each OOM
    assert n_proc == 2 * len(sim.workers) + sim.ooms


def _frame(rng, *, workers=4, sessions=72, leak_on=None, per_value=16e6, headroom=1.5e9, noise=50e6,
           kind="h200", prompt_values=400, gap_min=None, total=None):
    """memory_sessions-shaped rows: one session every 10 minutes per worker (``gap_min``: exponential
    gaps of that mean instead), prompt lengths from ``prompt_values`` values (400: mostly new ones), 14
    decoder resolutions in rotation; reserved grows ``per_value`` per new value of ``leak_on`` (a
    SHAPE_KEYS name), per session served (``memory.PER_SESSION``), or not at all (None); ``total``: the
    GPU memory the worker reports (the session record's gpu_mem_total_bytes; None: an older worker)."""
    from datetime import UTC, datetime

    import polars as pl
    cap = total or memory.GPU_MEMORY_BYTES[canonical_gpu_kind(kind)]
    t0 = datetime(2026, 11, 2, tzinfo=UTC)
    rows = []
    for w in range(workers):
        seen = set()
        t = t0
        for i in range(sessions):
            tokens = 800 + int(rng.integers(prompt_values))
            res = [(360 + 40 * r, 640 + 64 * r) for r in range(14)][int(rng.integers(14))]
            value = {"first_forward_tokens": tokens, "decoder_resolution": res, memory.PER_SESSION: i,
                     None: None}[leak_on]
            seen.add(value)
            grown = per_value * (len(seen) if leak_on else 0)
            rows.append({"release": "v2", "gpu_kind": kind, "worker_id": f"w{w}", "session_id": f"s{w}-{i}",
                         "start_ts": t, "buffers_max": 1, "switch_state": "ring_cache",
                         "mem_reserved_max": int(cap - headroom - sessions * per_value + grown + rng.normal(0, noise)),
                         "first_forward_tokens": tokens, "cond_tokens": tokens - 757, "decoder_height": res[0],
                         "decoder_width": res[1], "tp_size": 1, "chunk_frames": 4, "gpu_mem_total_bytes": total})
            t += timedelta(minutes=10 if gap_min is None else float(rng.exponential(gap_min)))
    return pl.DataFrame(rows), pl.DataFrame()


def test_a_small_leak_with_a_day_to_oom_is_critical_and_names_its_key():
    """16 MB per new prompt length, far below any fixed per-shape floor: at ~6 new lengths an hour and
    ~1.5 GB of headroom it runs out of memory in well under a day, so it is critical."""
    import numpy as np

    s, ooms = _frame(np.random.default_rng(1), leak_on="first_forward_tokens")
    _procs, rows = memory.analyze_frame(s, ooms)
    release = [r for r in rows if r["scope"] == "release=v2"]
    assert len(release) == 1 and release[0]["severity"] == "critical"
    ev = json.loads(release[0]["evidence"])
    assert ev["explained_by"] == "first_forward_tokens" and "cond_tokens" in ev["aliases"]
    assert ev["min_hours_to_oom"] < memory.CRITICAL_HOURS_TO_OOM
    assert 8e6 < ev["release_bytes_per_unit"] < 32e6


@pytest.mark.parametrize("kind,total", [("NVIDIA H200", 150_000_000_000), ("acme-x1", 48_000_000_000),
                                        ("NVIDIA H200", None)])
def test_a_real_worker_leak_under_a_day_to_oom_is_critical_whatever_its_gpu_is_called(kind, total):
    """The real worker labels its GPU 'NVIDIA H200' (stored before ingest made it 'h200') or a GPU no table
    knows: the time to OOM comes from the GPU memory the worker reported, and a leak that fills it within a
    day is critical; a row of an older worker (no total) takes its canonical kind's memory."""
    import numpy as np

    s, ooms = _frame(np.random.default_rng(1), leak_on="first_forward_tokens", kind=kind, total=total)
    _procs, rows = memory.analyze_frame(s, ooms)
    release = [r for r in rows if r["scope"] == "release=v2"]
    assert len(release) == 1 and release[0]["severity"] == "critical"
    ev = json.loads(release[0]["evidence"])
    assert ev["min_hours_to_oom"] < memory.CRITICAL_HOURS_TO_OOM


def test_a_leak_keyed_on_decoder_resolution_is_named_for_it_and_bounded():
    """+180 MB per new resolution, 14 in rotation: named for the resolution (not the prompt); at the rate
    new resolutions arrive, 20 GB of headroom last days: a warning."""
    import numpy as np

    s, ooms = _frame(np.random.default_rng(2), leak_on="decoder_resolution", per_value=180e6, headroom=20e9,
                     noise=300e6)
    _procs, rows = memory.analyze_frame(s, ooms)
    release = [r for r in rows if r["scope"] == "release=v2"]
    assert len(release) == 1
    ev = json.loads(release[0]["evidence"])
    assert ev["explained_by"] == "decoder_resolution"
    per_process = [json.loads(r["evidence"]) for r in rows if "worker_id=" in r["scope"]]
    assert per_process and all(e["distinct_shapes"] <= 14 for e in per_process)  # resolutions, not prompts
    assert release[0]["severity"] == "warning" and ev["min_hours_to_oom"] > memory.CRITICAL_HOURS_TO_OOM


def test_no_leak_no_finding_on_literal_noise():
    import numpy as np

    for seed in range(5):
        s, ooms = _frame(np.random.default_rng(10 + seed), leak_on=None)
        assert memory.analyze_frame(s, ooms)[1] == []


def _release(rows):
    release = [r for r in rows if r["scope"] == "release=v2"]
    assert len(release) == 1, rows
    return release[0], json.loads(release[0]["evidence"])


def _pair(ev, a, b):
    """The finding's test of explanation ``a`` against ``b`` (each fitted beyond the other)."""
    return next(t for t in ev["key_tests"] if set(t["keys"]) == {a, b})


def test_sessions_that_reuse_a_prompt_length_tell_a_per_session_leak_from_a_per_prompt_one():
    """A process that has served 200 sessions from 300 prompt lengths has seen ~55 of them again. Under a
    leak per session those sessions grow too; under a leak per prompt length they do not. The detector
    names each for what it is, and says it is sure (both fit the raw curve: the old rule, the best R^2
    with the other as ``also_fits``, swapped them)."""
    import numpy as np

    for seed in range(3):
        for leak, per in ((memory.PER_SESSION, 40e6), ("first_forward_tokens", 24e6)):
            s, ooms = _frame(np.random.default_rng(100 + seed), workers=6, sessions=200, leak_on=leak,
                             per_value=per, headroom=20e9, noise=150e6, prompt_values=300, gap_min=10)
            _row, ev = _release(memory.analyze_frame(s, ooms)[1])
            assert ev["key"] == leak and ev["key_confident"], (seed, leak, ev["key_tests"])
            other = "first_forward_tokens" if leak == memory.PER_SESSION else memory.PER_SESSION
            test = _pair(ev, leak, other)
            assert test["sessions_telling_apart"] > 100  # the sessions that reused a prompt length
            assert test["p_value"][leak] < memory.SEPARATE_P <= test["p_value"][other]


def test_a_young_process_with_every_prompt_new_is_named_ambiguous_with_its_evidence_and_still_critical():
    """In a process's first hours nearly every session brings a new prompt length: "per prompt length"
    and "per session" are the same curve. The finding says so (both keys, the few sessions that tell
    them apart) rather than naming one, and its severity is the time to OOM either way."""
    import numpy as np

    for seed in range(3):
        for leak in (memory.PER_SESSION, "first_forward_tokens"):
            s, ooms = _frame(np.random.default_rng(200 + seed), workers=6, sessions=40, leak_on=leak,
                             per_value=30e6, headroom=1.0e9, noise=60e6, prompt_values=100_000, gap_min=10)
            row, ev = _release(memory.analyze_frame(s, ooms)[1])
            assert not ev["key_confident"], (seed, leak, ev["key_tests"])
            named = {ev["explained_by"], *ev["ambiguous_with"]}
            assert {"first_forward_tokens", memory.PER_SESSION} <= named
            assert _pair(ev, "first_forward_tokens", memory.PER_SESSION)["sessions_telling_apart"] < 5
            assert row["severity"] == "critical" and ev["min_hours_to_oom"] < memory.CRITICAL_HOURS_TO_OOM


def test_a_process_older_than_the_window_counts_its_shapes_from_its_start():
    """Workers live for weeks; the memory window is 7 days. A prompt length the process saw before the
    window is not new inside it: counted as new, a per-prompt leak looks smaller per "new" length and
    the fleet's rate of new lengths (hence the time to OOM) is overstated. Shapes are counted from the
    process's start (``HISTORY`` before the window), the fits judge the window."""
    from datetime import UTC, datetime

    import numpy as np
    import polars as pl

    rng = np.random.default_rng(5)
    cap = memory.GPU_MEMORY_BYTES["h200"]
    end = datetime(2026, 11, 30, tzinfo=UTC)
    start = end - timedelta(days=7)
    rows, truly_new_last_day = [], []
    for w in range(4):
        seen, t, i, new_last = set(), end - timedelta(days=12), 0, 0
        while t < end:
            tokens = 800 + int(rng.integers(300))
            if tokens not in seen and t >= end - timedelta(hours=24):
                new_last += 1
            seen.add(tokens)
            rows.append({"release": "v2", "gpu_kind": "h200", "worker_id": f"w{w}", "session_id": f"s{w}-{i}",
                         "start_ts": t, "buffers_max": 1, "switch_state": "ring_cache",
                         "mem_reserved_max": int(cap - 20e9 + 24e6 * len(seen) + rng.normal(0, 150e6)),
                         "first_forward_tokens": tokens, "cond_tokens": tokens - 757, "decoder_height": 480,
                         "decoder_width": 832, "tp_size": 1, "chunk_frames": 4})
            t += timedelta(minutes=float(rng.exponential(30)))
            i += 1
        truly_new_last_day.append(new_last)
    s = pl.DataFrame(rows)
    procs, out = memory.analyze_frame(s, pl.DataFrame(), start, end)
    _row, ev = _release(out)
    assert ev["key"] == "first_forward_tokens" and ev["key_confident"], ev["key_tests"]
    assert 16e6 < ev["release_bytes_per_unit"] < 32e6  # 24 MB per truly new length
    true_rate = float(np.median(truly_new_last_day)) / 24
    assert procs["start_ts"].min() >= start  # judged on the window
    rate = procs["new_shapes_per_hour"][0]
    assert 0.6 * true_rate < rate < 1.5 * true_rate, (rate, true_rate)


def test_a_worker_exact_reserved_memory_names_its_leak_and_serialises():
    """A real worker's peak reserved memory is exact: the H200 soak held it to the MiB over 95 sessions, so
    a leak of a fixed size per new prompt length is an exact line. The fits then leave no residual: the
    release fit called that "no growth" (p 1) with an infinite spread, the two-slope fits skipped every
    process as degenerate, and the finding's evidence held inf, which the hourly job could not write."""
    import numpy as np

    for leak_on in ("first_forward_tokens", memory.PER_SESSION):
        s, ooms = _frame(np.random.default_rng(3), workers=4, sessions=120, leak_on=leak_on, per_value=24e6,
                         headroom=4e9, noise=0.0, prompt_values=150, gap_min=10)
        _procs, rows = memory.analyze_frame(s, ooms)
        _release_row, ev = _release(rows)
        assert ev["explained_by"] == leak_on and ev["key_confident"], ev["key_tests"]
        assert ev["release_p_value"] < 1e-3 and 23e6 < ev["release_bytes_per_unit"] < 25e6
        for r in rows:
            json.loads(r["evidence"])  # finite: the evidence is written as strict JSON


def test_one_allocator_segment_is_not_a_leak():
    """Exact reserved memory that steps up once by one 20 MiB segment (the caching allocator met a larger
    peak) and stays there: a line fits it with p far below any threshold, but it is the allocator's
    caching, not growth that runs a worker out of memory."""
    import numpy as np

    s, ooms = _frame(np.random.default_rng(4), workers=4, sessions=120, leak_on=None, noise=0.0)
    step = (s["session_id"].str.extract(r"-(\d+)$").cast(int) >= 60).cast(int) * memory.MIN_GROWTH
    s = s.with_columns((s["mem_reserved_max"] + step).alias("mem_reserved_max"))
    assert memory.analyze_frame(s, ooms)[1] == []

