"""The worker's /metrics: names and types, values read from the sessions at scrape time, sessions held
weakly, the endpoint's token rule, and a live tiny worker's exposition passing ``promtool check metrics``."""

from __future__ import annotations

import gc
import re
import shutil
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from worker.metrics import MetricsTokenError, WorkerMetrics, serve
from worker.session import Worker


def families(registry) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_openmetrics(registry).decode())}


def sample(fams, family, name=None, **labels) -> float:
    for s in fams[family].samples:
        if s.name == (name or family) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no {name or family}{labels}: {fams[family].samples}")


def test_names_types_and_values_after_sessions():
    w = Worker("tiny", device="cpu", worker_id="w7", release="v3")
    m = WorkerMetrics(w)
    before = families(m.registry)
    assert sample(before, "livestep_worker_session_running") == 0
    s1 = w.run_session(steps=12, realtime=False, switches=["ring_cache=on", "rope_at_write=on"])
    s2 = w.run_session(steps=8, realtime=False)
    fams = families(m.registry)
    types = {n: fams[n].type for n in (
        "livestep_worker", "livestep_worker_step_period_seconds", "livestep_worker_step_diffusion_seconds",
        "livestep_worker_late_chunks", "livestep_worker_stall_seconds", "livestep_worker_sessions",
        "livestep_worker_telemetry_records_dropped", "livestep_worker_session_running")}
    assert types == {"livestep_worker": "info", "livestep_worker_step_period_seconds": "histogram",
                     "livestep_worker_step_diffusion_seconds": "histogram", "livestep_worker_late_chunks": "counter",
                     "livestep_worker_stall_seconds": "counter", "livestep_worker_sessions": "counter",
                     "livestep_worker_telemetry_records_dropped": "counter",
                     "livestep_worker_session_running": "gauge"}
    assert sample(fams, "livestep_worker", "livestep_worker_info", worker_id="w7", release="v3", shape="tiny") == 1
    assert sample(fams, "livestep_worker_step_period_seconds", "livestep_worker_step_period_seconds_count") == 20
    assert sample(fams, "livestep_worker_step_period_seconds", "livestep_worker_step_period_seconds_bucket",
                  le="+Inf") == 20
    assert "0.1667" in {s.labels.get("le") for s in fams["livestep_worker_step_period_seconds"].samples}
    assert sample(fams, "livestep_worker_late_chunks", "livestep_worker_late_chunks_total") == \
        s1.late_chunks + s2.late_chunks
    assert sample(fams, "livestep_worker_sessions", "livestep_worker_sessions_total") == 2
    assert sample(fams, "livestep_worker_session_running") == 0
    total_s = sample(fams, "livestep_worker_step_period_seconds", "livestep_worker_step_period_seconds_sum")
    assert total_s == pytest.approx(s1.streamed_s + s2.streamed_s, rel=1e-6)
    assert sample(fams, "livestep_worker_switch_poll_failures", "livestep_worker_switch_poll_failures_total") == 0


def test_failing_switch_polls_are_counted_and_the_source_reads_down():
    """A control plane that refuses every poll (nothing listens on the port): counted, and the gauge says down."""
    from tests.api.live import bound_socket

    sock = bound_socket()  # bound, never listening: every poll's connection is refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    w = Worker("tiny", device="cpu")
    m = WorkerMetrics(w)
    seen = {}

    def scrape(step):
        if step == 25:
            seen.update(families(m.registry))

    from worker.switches import HttpSource

    src = HttpSource(url, "w0", "dev", "cpu", interval_s=0.01)
    orig_poll = src.poll
    src.poll = lambda step: (scrape(step), orig_poll(step))[1]
    w.run_session(steps=30, chunk_period_s=0.02, switch_source=src)
    sock.close()
    assert sample(seen, "livestep_worker_switch_source_up") == 0
    assert sample(seen, "livestep_worker_switch_poll_failures", "livestep_worker_switch_poll_failures_total") >= 1
    after = families(m.registry)
    assert sample(after, "livestep_worker_switch_poll_failures", "livestep_worker_switch_poll_failures_total") >= 1
    # between sessions the gauge keeps the last state: Prometheus scraping then must not lose the series
    assert sample(after, "livestep_worker_switch_source_up") == 0


def test_warm_sessions_are_not_counted():
    w = Worker("tiny", device="cpu")
    m = WorkerMetrics(w)
    w.warm(buckets=(w.cond_buckets[-1],))  # synthetic sessions without telemetry
    assert sample(families(m.registry), "livestep_worker_sessions", "livestep_worker_sessions_total") == 0
    w.run_session(steps=5, realtime=False, cond_tokens=w.cond_buckets[-1])
    fams = families(m.registry)
    assert sample(fams, "livestep_worker_sessions", "livestep_worker_sessions_total") == 1
    assert sample(fams, "livestep_worker_step_period_seconds", "livestep_worker_step_period_seconds_count") == 5


def test_a_running_session_is_read_live_over_http():
    import httpx  # (the GPU test below runs where only the worker's dependencies are)

    w = Worker("tiny", device="cpu")
    m = WorkerMetrics(w)
    server = serve(m.registry, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    t = threading.Thread(target=w.run_session, kwargs={"steps": 30, "chunk_period_s": 0.05,
                                                       "switches": ["ring_cache=on", "rope_at_write=on"]})
    t.start()
    try:
        def live():
            r = httpx.get(url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/openmetrics-text")
            f = {x.name: x for x in text_string_to_metric_families(r.text)}
            steps = sample(f, "livestep_worker_step_period_seconds", "livestep_worker_step_period_seconds_count")
            return f if sample(f, "livestep_worker_session_running") == 1 and steps >= 3 else None
        deadline = time.monotonic() + 30
        while (f := live()) is None:
            assert time.monotonic() < deadline, "no running session seen"
            time.sleep(0.05)
        assert sample(f, "livestep_worker_switches", "livestep_worker_switches_info", ring_cache="on",
                      fp8_cache="off") == 1
        assert 0 <= sample(f, "livestep_worker_playout_depth_chunks") <= 4
        assert sample(f, "livestep_worker_session_sustainable_fps") > 0
        assert 0 < sample(f, "livestep_worker_session_delivered_fps") <= 4 / 0.05 * (1 + 1e-9)  # paced: 80 at most
        from collector.version import __version__

        assert sample(f, "livestep_build", "livestep_build_info", version=__version__) == 1
        assert sample(f, "livestep_worker_memory_allocated_bytes") > 0
        assert httpx.get(url.replace("/metrics", "/nope")).status_code == 404
        t.join(60)
        # between sessions the last session's families stay (a gap at every session end would flap the series)
        r = httpx.get(url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        after = {x.name: x for x in text_string_to_metric_families(r.text)}
        assert sample(after, "livestep_worker_session_running") == 0
        for name in ("livestep_worker_session_sustainable_fps", "livestep_worker_session_delivered_fps",
                     "livestep_worker_memory_reserved_bytes"):
            assert sample(after, name) > 0, name
        assert sample(after, "livestep_worker_switches", "livestep_worker_switches_info", ring_cache="on") == 1
    finally:
        t.join(60)
        server.shutdown()


def test_sessions_are_held_weakly():
    w = Worker("tiny", device="cpu")
    m = WorkerMetrics(w)
    gc.disable()
    try:
        seen = []
        w.observers.append(type("Spy", (), {"session_started": lambda self, s: seen.append(weakref.ref(s)),
                                             "session_ended": lambda self, s, summary: None})())
        w.run_session(steps=4, realtime=False)
        assert seen and seen[0]() is None  # freed by reference counting: the metrics do not keep it
        assert sample(families(m.registry), "livestep_worker_step_period_seconds",
                      "livestep_worker_step_period_seconds_count") == 4
    finally:
        gc.enable()


def test_token_rule():
    import httpx

    w = Worker("tiny", device="cpu")
    reg = WorkerMetrics(w).registry
    with pytest.raises(MetricsTokenError, match="--metrics-token"):
        serve(reg, "0.0.0.0", 0)
    server = serve(reg, "127.0.0.1", 0, token="metrics-token-0123")
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer metrics-token-0123"}).status_code == 200
    finally:
        server.shutdown()


def test_live_worker_cli_passes_promtool_check_metrics():
    import httpx

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: apt-get install prometheus (./dev test installs it when run as root)")
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "worker", "run", "--preset", "tiny", "--device", "cpu",
                             "--seconds", "6", "--metrics-port", "0", "--switch", "ring_cache=on",
                             "--switch", "rope_at_write=on"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        port = int(re.search(r"127\.0\.0\.1:(\d+)/metrics", line).group(1))
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 60
        while True:
            text = httpx.get(url).text
            if re.search(r"^livestep_worker_step_period_seconds_count [1-9]", text, re.MULTILINE):
                break
            assert time.monotonic() < deadline and proc.poll() is None, text[-2000:]
            time.sleep(0.1)
        r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                           timeout=30, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        om = httpx.get(url, headers={"Accept": "application/openmetrics-text; version=1.0.0"}).text
        assert om.rstrip().endswith("# EOF")
        assert "livestep_worker_session_running 1.0" in om or "livestep_worker_session_running 1" in om
    finally:
        proc.wait(60)
    assert proc.returncode == 0


@pytest.mark.gpu
def test_scraping_during_a_cuda_session_syncs_nothing():
    """Every CUDA sync raises in sync-debug mode (it is process-wide): scrapes every 20 ms meanwhile."""
    w = Worker("tiny", device="cuda")
    m = WorkerMetrics(w)
    errors: list[BaseException] = []
    stop = threading.Event()

    def scrape():
        while not stop.is_set():
            try:
                generate_latest(m.registry)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
            time.sleep(0.02)

    t = threading.Thread(target=scrape)
    t.start()
    try:
        w.run_session(steps=40, realtime=False, sync_debug=True, switches=["ring_cache=on", "rope_at_write=on"])
    finally:
        stop.set()
        t.join()
    assert errors == []
    assert torch.cuda.is_available()
