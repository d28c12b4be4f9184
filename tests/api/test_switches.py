"""Switch control plane: contract 3 shape, ETag/304, scoped rules, admin writes, audit, no-ops."""

from __future__ import annotations

from tests.api.evaluations import put_evaluation


def test_poll_returns_only_decided_switches_with_etag_and_304(client):
    r = client.get("/v1/switches", params={"worker_id": "w1", "release": "v7", "gpu_kind": "h200"})
    assert r.status_code == 200
    body = r.json()
    assert body["switches"] == {}  # no rule: every switch is the worker's own
    assert isinstance(body["version"], int)
    etag = r.headers["etag"]
    r2 = client.get("/v1/switches", params={"worker_id": "w1", "release": "v7", "gpu_kind": "h200"},
                    headers={"If-None-Match": etag})
    assert r2.status_code == 304 and r2.headers["etag"] == etag and r2.content == b""


def test_change_invalidates_etag_and_is_scoped(client, admin):
    q = {"worker_id": "w1", "release": "v7", "gpu_kind": "h200"}
    etag = client.get("/v1/switches", params=q).headers["etag"]
    r = client.put("/v1/switches/fused_allreduce", headers=admin,
                   json={"value": False, "scope": "release=v7", "who": "alice", "why": "leak"})
    assert r.status_code == 200 and r.json()["changed"] is True
    r = client.get("/v1/switches", params=q, headers={"If-None-Match": etag})
    assert r.status_code == 200 and r.json()["switches"]["fused_allreduce"] is False
    other = client.get("/v1/switches", params={**q, "release": "v6"}).json()
    assert "fused_allreduce" not in other["switches"]


def test_turning_off_an_off_switch_is_a_recorded_noop(client, admin):
    w = {"value": False, "scope": "release=v7", "who": "alice", "why": "leak"}
    first = client.put("/v1/switches/fused_allreduce", headers=admin, json=w).json()
    v = client.get("/v1/switches", params={"release": "v7"}).json()["version"]
    second = client.put("/v1/switches/fused_allreduce", headers=admin, json={**w, "who": "bob"}).json()
    assert first["changed"] is True and second["changed"] is False and second["action"] == "noop"
    assert client.get("/v1/switches", params={"release": "v7"}).json()["version"] == v
    hist = client.get("/v1/switches/history", params={"name": "fused_allreduce"}).json()["decisions"]
    assert [(d["actor"], d["changed"], d["old_value"], d["new_value"]) for d in hist] == [
        ("bob", False, False, False), ("alice", True, None, False)]  # None: no rule before alice's
    assert all(d["reason"] == "leak" and d["source"] == "api" for d in hist)


def test_fleet_off_then_release_on_the_newer_release_rule_decides_it(client, admin, store):
    put_evaluation(store, "compile", "h200", "v8")  # a numeric switch: on only with a passing evaluation
    client.put("/v1/switches/compile", headers=admin, json={"value": False, "who": "a", "why": "b"})
    client.put("/v1/switches/compile", headers=admin,
               json={"value": True, "scope": "release=v8", "who": "a", "why": "fixed in v8"})
    assert client.get("/v1/switches", params={"release": "v7"}).json()["switches"]["compile"] is False
    assert client.get("/v1/switches", params={"release": "v8", "gpu_kind": "h200"}).json()["switches"]["compile"] is True
    rules = client.get("/v1/switches/rules").json()["rules"]
    assert {(r["name"], r["scope"], r["value"]) for r in rules} == {("compile", "", False),
                                                                     ("compile", "release=v8", True)}


def test_writes_need_admin_token_and_who_why(client, admin):
    w = {"value": False, "who": "a", "why": "b"}
    assert client.put("/v1/switches/compile", json=w).status_code == 401
    assert client.put("/v1/switches/compile", json=w, headers={"Authorization": "Bearer nope"}).status_code == 403
    r = client.put("/v1/switches/compile", json={"value": False, "who": "a"}, headers=admin)
    assert r.status_code == 422
    r = client.put("/v1/switches/compile", json={**w, "who": ""}, headers=admin)
    assert r.status_code == 422
    assert client.get("/v1/switches/history").json()["decisions"] == []


def test_unknown_switch_and_bad_scope_list_valid_values(client, admin):
    w = {"value": False, "who": "a", "why": "b"}
    r = client.put("/v1/switches/warp_drive", json=w, headers=admin)
    assert r.status_code == 404 and "ring_cache" in r.json()["detail"]
    r = client.put("/v1/switches/compile", json={**w, "scope": "planet=mars"}, headers=admin)
    assert r.status_code == 422 and "release" in r.json()["detail"]
    r = client.get("/v1/switches/history", params={"name": "warp_drive"})
    assert r.status_code == 404


def test_cuda_gpu_kind_names_with_spaces_are_valid_scopes(client, admin):
    r = client.put("/v1/switches/cuda_graphs", headers=admin,
                   json={"value": False, "scope": "gpu_kind=NVIDIA H200", "who": "a", "why": "b"})
    assert r.status_code == 200 and r.json()["scope"] == "gpu_kind=NVIDIA H200"
    got = client.get("/v1/switches", params={"worker_id": "w1", "release": "v7", "gpu_kind": "NVIDIA H200"})
    assert got.status_code == 200 and got.json()["switches"]["cuda_graphs"] is False
    assert "cuda_graphs" not in client.get("/v1/switches", params={"gpu_kind": "cpu"}).json()["switches"]


def test_alert_flips_and_canaries_become_control_plane_events(store):
    from api.switchboard import get_switchboard

    board = get_switchboard(store, cache_s=0)
    board.set("compile", False, "release=v7", actor="alert:alertmanager", reason="r", source="alert", ref="k1")
    board.set("compile", False, "release=v7", actor="alert:alertmanager", reason="r", source="alert", ref="k2")
    board.set("cuda_graphs", False, "", actor="alice", reason="r")  # an admin change: audit only
    rows = store.query_rows("SELECT kind, worker_id, release, session_id FROM events ORDER BY ts")
    assert rows == [("rollback", "control-plane", "v7", "k1")]


def test_clear_removes_the_scopes_own_rule(client, admin):
    w = {"who": "a", "why": "b"}
    client.put("/v1/switches/compile", headers=admin, json={**w, "value": False, "scope": "release=v7"})
    r = client.post("/v1/switches/compile/clear", headers=admin, json={**w, "scope": "release=v7"})
    assert r.status_code == 200 and r.json()["changed"] is True and r.json()["new_value"] is None
    assert "compile" not in client.get("/v1/switches", params={"release": "v7"}).json()["switches"]
    again = client.post("/v1/switches/compile/clear", headers=admin, json={**w, "scope": "release=v7"}).json()
    assert again["changed"] is False and again["action"] == "noop"
    assert client.post("/v1/switches/warp/clear", headers=admin, json=w).status_code == 404
    assert client.post("/v1/switches/compile/clear", json=w).status_code == 401


def test_cohort_buckets_are_stable_and_uniform():
    from api.switchboard import bucket

    # pinned: every server and every release must put a worker in the same bucket
    assert (bucket("w0001"), bucket("live-1")) == (95, 73)
    ids = [f"worker-{i}" for i in range(10_000)]
    share = sum(bucket(w) < 30 for w in ids) / len(ids)
    assert 0.28 < share < 0.32 and {bucket(w) for w in ids} == set(range(100))


def test_scope_parsing_is_canonical_and_strict():
    import pytest

    from api.switchboard import SwitchError, canonical_scope

    assert canonical_scope("release=v7, gpu_kind=NVIDIA H200") == "gpu_kind=NVIDIA H200,release=v7"
    assert canonical_scope({"worker_id": "w1"}) == "worker_id=w1" and canonical_scope("") == ""
    for bad in ("release", "release=", "planet=mars", "release=v7,release=v8", "release=" + "x" * 200):
        with pytest.raises(SwitchError):
            canonical_scope(bad)


def _run_polling_worker(client, switches, steps=4):
    """A real tiny worker whose switch source is the control plane's poll (one poll at step 1)."""
    from worker.session import run_session
    from worker.switches import CallableSource

    q = {"worker_id": "w-plain", "release": "v7", "gpu_kind": "cpu"}
    polled = []

    def poll(step):
        if step != 1:
            return None
        r = client.get("/v1/switches", params=q)
        assert r.status_code == 200 and "version" in r.json() and r.headers["etag"]
        polled.append(r.json()["switches"])
        return polled[-1]

    s = run_session("tiny", steps=steps, switches=switches, switch_source=CallableSource(poll), release="v7",
                    worker_id="w-plain", realtime=False, telemetry=False, seed=0)
    return s, polled


def test_a_worker_keeps_the_switches_no_rule_names(client, admin):
    from worker.config import Switches

    plain, polled = _run_polling_worker(client, Switches())
    assert plain.switch_events == [] and plain.switches == Switches().encode()  # stays plain
    assert polled == [{}]
    leak = Switches(ring_cache=True, rope_at_write=True, buffer_per_shape=True)
    s, _ = _run_polling_worker(client, leak)
    assert s.switch_events == [] and s.switches == leak.encode()  # still reproducing the leak
    # a rule decides only its own switch; the rest stay the worker's
    client.put("/v1/switches/ring_cache", headers=admin, json={"value": False, "scope": "release=v7", "who": "a",
                                                               "why": "b"})
    s, polled = _run_polling_worker(client, leak)
    assert polled == [{"ring_cache": False}]
    assert [e["changed"] for e in s.switch_events] == [{"ring_cache": False}]
    assert s.switches == Switches(rope_at_write=True, buffer_per_shape=True).encode()


def test_the_production_defaults_are_a_separate_field(client):
    from api.switchboard import DEFAULTS

    rules = client.get("/v1/switches/rules").json()
    assert rules["defaults"] == DEFAULTS and rules["defaults"]["buffer_per_shape"] is False
    assert client.get("/v1/switches").json()["switches"] == {}
