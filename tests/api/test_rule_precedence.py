"""The switch rules' precedence model (api/switchboard.py's docstring): the most recent rule covering a
worker decides; a broader manual decision supersedes the narrower automatic rules it covers; a canary
reaches exactly its cohort, its hash salted per switch; ``GET /v1/switches/explain`` names the deciding
rule. Fleets of known workers; every answer is checked worker by worker."""

from __future__ import annotations

from api.switchboard import bucket, get_switchboard
from tests.api.evaluations import put_evaluation

WORKERS = [f"w{i:04d}" for i in range(1, 9)]  # the August fleet: 8 workers of release v1.2
S = "fused_allreduce"
P = "decoder_own_gpu"  # precedence alone: a switch that moves no number, so no evaluation gates turning it on


def on_for(client, workers, release="v1.2", name=S):
    """The workers whose poll says the switch is on (None / absent = not decided by any rule)."""
    return {w for w in workers
            if client.get("/v1/switches", params={"worker_id": w, "release": release, "gpu_kind": "h200"}
                          ).json()["switches"].get(name) is True}


def put(client, admin, value, scope, name=S):
    r = client.put(f"/v1/switches/{name}", headers=admin, json={"value": value, "scope": scope, "who": "op",
                                                                "why": "test"})
    assert r.status_code == 200, r.text
    return r.json()


def august_rules(store):
    """What the old webhook wrote for the August leak: six worker-scoped automatic rules, then one
    release-wide."""
    board = get_switchboard(store, cache_s=0)
    for w in WORKERS[:6]:
        board.set(S, False, f"release=v1.2,worker_id={w}", actor="alert:livestep", reason="leak",
                  source="alert")
    board.set(S, False, "release=v1.2", actor="alert:livestep", reason="leak", source="alert")
    return board


def test_a_release_wide_re_enable_reaches_every_worker(client, admin, store):
    put_evaluation(store, S, "h200", "v1.2")  # a numeric switch: on only with a passing evaluation
    board = august_rules(store)
    assert on_for(client, WORKERS) == set()
    d = put(client, admin, True, "release=v1.2")
    assert d["changed"] and on_for(client, WORKERS) == set(WORKERS)  # 8 of 8, not 2
    # the narrower automatic rules are superseded (withdrawn), not merely outranked
    assert sorted(d["evidence"]["superseded_automatic_rules"]) == sorted(
        f"release=v1.2,worker_id={w}" for w in WORKERS[:6])
    assert [r.scope for r in board.rules() if r.name == S] == ["release=v1.2"]
    # so clearing the re-enable later does not bring the stale worker rules back
    client.post(f"/v1/switches/{S}/clear", headers=admin, json={"scope": "release=v1.2", "who": "op", "why": "t"})
    assert all(S not in client.get("/v1/switches", params={"worker_id": w, "release": "v1.2"}).json()["switches"]
               for w in WORKERS)


def test_the_most_recent_covering_rule_wins_whatever_its_specificity(client, admin):
    put(client, admin, False, "", name=P)                 # v1: fleet off
    put(client, admin, True, "worker_id=w0001", name=P)   # v2: one worker back on (newer, narrower)
    assert on_for(client, WORKERS, name=P) == {"w0001"}
    d = put(client, admin, False, "", name=P)             # v3: fleet off again: newer than w0001's rule
    assert d["changed"] and d["evidence"]["overrides"] == ["worker_id=w0001"]
    assert on_for(client, WORKERS, name=P) == set()
    # a manual narrower rule is overridden, not withdrawn: clearing the fleet rule brings it back
    client.post(f"/v1/switches/{P}/clear", headers=admin, json={"scope": "", "who": "op", "why": "t"})
    assert on_for(client, WORKERS, name=P) == {"w0001"}


def test_an_automatic_broad_rule_overrides_an_older_manual_narrow_one_and_keeps_it(client, admin, store):
    put_evaluation(store, S, "h200", "v1.2")
    put(client, admin, True, "release=v1.2,worker_id=w0001")
    get_switchboard(store).set(S, False, "release=v1.2", actor="incident:x", reason="leak", source="incident")
    assert on_for(client, WORKERS) == set()
    rules = client.get("/v1/switches/rules").json()["rules"]
    assert {(r["scope"], r["source"]) for r in rules} == {("release=v1.2,worker_id=w0001", "api"),
                                                         ("release=v1.2", "incident")}


def test_a_write_that_changes_no_worker_is_a_noop_and_one_that_changes_some_is_not(client, admin, store):
    put_evaluation(store, S, "h200", "v1.2")
    put(client, admin, False, "release=v1.2")
    assert put(client, admin, False, "release=v1.2")["action"] == "noop"
    put(client, admin, True, "release=v1.2,worker_id=w0003")
    assert put(client, admin, False, "release=v1.2")["changed"]  # w0003 would have stayed on
    assert on_for(client, WORKERS) == set()


def test_a_canary_reaches_exactly_its_cohort(client, admin, store):
    put_evaluation(store, S, "h200", "v1.2")  # a numeric switch: the gate's evidence
    fleet = [f"w{i:04d}" for i in range(1, 41)]
    board = get_switchboard(store, cache_s=0)
    for w in fleet[:10]:  # older, narrower automatic rules must not shadow the cohort rule
        board.set(S, False, f"release=v1.2,worker_id={w}", actor="alert:livestep", reason="leak", source="alert")
    board.set(S, False, "release=v1.2", actor="alert:livestep", reason="leak", source="alert")
    r = client.post("/v1/canaries", headers=admin, json={"switch": S, "scope": "release=v1.2", "fraction": 0.5,
                                                         "who": "op", "why": "fixed"})
    assert r.status_code == 201, r.text
    cohort = {w for w in fleet if bucket(w, S) < 50}
    assert 0 < len(cohort) < len(fleet)
    assert on_for(client, fleet) == cohort
    assert on_for(client, fleet, release="v1.1") == set()  # other releases untouched


def test_a_canary_does_not_start_when_the_rest_of_the_scope_is_not_off(client, admin, store):
    put_evaluation(store, S, "h200", "v1.2")
    put(client, admin, False, "release=v1.2")
    put(client, admin, True, "release=v1.2,worker_id=w0002")
    r = client.post("/v1/canaries", headers=admin, json={"switch": S, "scope": "release=v1.2", "fraction": 0.5,
                                                         "who": "op", "why": "fixed"})
    assert r.status_code == 409 and "worker_id=w0002" in r.json()["detail"]


def test_canary_cohorts_are_salted_per_switch():
    ids = [f"worker-{i}" for i in range(2000)]
    a = {w for w in ids if bucket(w, "fused_allreduce") < 10}
    b = {w for w in ids if bucket(w, "cuda_graphs") < 10}
    assert 150 < len(a) < 250 and 150 < len(b) < 250
    assert len(a & b) < 60  # independent: ~10 % of 10 % (20), not the same workers
    assert bucket("w0001", "fused_allreduce") == bucket("w0001", "fused_allreduce")  # stable


def test_explain_names_the_deciding_rule_and_why_the_others_do_not(client, admin, store):
    put_evaluation(store, S, "h200", "v1.2")
    august_rules(store)
    r = client.get("/v1/switches/explain", params={"worker_id": "w0001", "release": "v1.2", "gpu_kind": "h200"})
    assert r.status_code == 200
    e = r.json()["switches"][S]
    assert e["value"] is False and e["decided_by"]["scope"] == "release=v1.2"
    assert e["decided_by"]["source"] == "alert" and "most recent" in e["why"]
    assert [o["scope"] for o in e["not_deciding"]] == ["release=v1.2,worker_id=w0001"]
    assert e["not_deciding"][0]["why_not"].startswith("older")
    plain = r.json()["switches"]["cuda_graphs"]
    assert plain["value"] is None and plain["decided_by"] is None and "no rule covers" in plain["why"]
    # a canary cohort rule that does not cover this worker says so
    put(client, admin, True, "release=v1.2")
    put(client, admin, False, "release=v1.2")
    client.post("/v1/canaries", headers=admin, json={"switch": S, "scope": "release=v1.2", "fraction": 0.5,
                                                     "who": "op", "why": "fixed"})
    outside = next(w for w in (f"w{i:04d}" for i in range(100)) if bucket(w, S) >= 50)
    inside = next(w for w in (f"w{i:04d}" for i in range(100)) if bucket(w, S) < 50)
    def explain(w, **kind):
        return client.get("/v1/switches/explain", params={"worker_id": w, "release": "v1.2", **kind}
                          ).json()["switches"][S]

    e_out = explain(outside, gpu_kind="h200")
    assert e_out["value"] is False and "not in its cohort" in e_out["not_deciding"][0]["why_not"]
    e_in = explain(inside, gpu_kind="h200")
    assert e_in["value"] is True and e_in["decided_by"]["cohort"].startswith("canary=")
    # a numeric switch turned on does not reach a worker whose GPU kind the gate has no evidence for
    e_b200 = explain(inside, gpu_kind="b200")
    assert e_b200["value"] is False and e_b200["decided_by"]["scope"] == "release=v1.2"
    assert "no passing evaluation" in e_b200["not_deciding"][0]["why_not"] and "gpu_kind=b200" in e_b200[
        "not_deciding"][0]["why_not"]
    assert "names no gpu_kind" in explain(inside)["not_deciding"][0]["why_not"]
    assert client.get("/v1/switches/explain", params={"release": "x" * 300}).status_code == 422
