"""Incidents on a simulated fleet with a known answer (the August leak: one release, one switch, ~20
per-process memory findings): one incident, one signed notification to a real receiver, one flip at
the incident's scope; a re-run changes nothing and posts nothing; a repeat only after the repeat
interval; a manual re-enable reaches every worker and is not undone; the incident resolves when its
evidence is gone and reopens when it comes back; grouping rules on hand-made findings."""

from __future__ import annotations

import hmac
import threading
from datetime import UTC, datetime, timedelta

import orjson
import pytest
from fastapi import FastAPI, Request

from analytics.findings import finding, write_findings
from analytics.jobs import run_job
from analytics.simulate import simulate_fleet
from api import incidents
from api.alerts import SIG_HEADER, TS_HEADER, signature
from api.notify import Notifier
from api.switchboard import get_switchboard
from tests.api.conftest import SECRET
from tests.api.evaluations import evaluate_release
from tests.api.live import serve


class Receiver:
    """A real HTTP receiver (not ours: what an operator's webhook endpoint is) that records deliveries."""

    def __init__(self):
        self.got: list[dict] = []
        self.lock = threading.Lock()
        self.app = FastAPI()

        @self.app.post("/hook")
        async def hook(request: Request):
            body = await request.body()
            ts = request.headers[TS_HEADER]
            ok = hmac.compare_digest(request.headers[SIG_HEADER].removeprefix("sha256="),
                                     signature(SECRET, body, int(ts)))
            with self.lock:
                self.got.append({"signed": ok, **orjson.loads(body)})
            return {"ok": True}


@pytest.fixture
def receiver():
    r = Receiver()
    with serve(r.app) as base:
        r.url = f"{base}/hook"
        yield r


@pytest.fixture(scope="module")
def august_fleet():
    return {"weeks": 1, "incidents": [("august", 2)], "workers": 8, "sessions_per_day": 24,
            "session_median_s": 20, "seed": 1, "progress": False}


def test_the_august_leak_is_one_incident_one_notification_one_flip(store, receiver, august_fleet):
    sim = simulate_fleet(store, **august_fleet)
    leaking = sim.release("august").name
    findings = run_job("memory", store, now=sim.end)
    per_process = [f for f in findings if "worker_id=" in f["scope"]]
    assert len(per_process) >= 5 and all(f["attribution"] == "fused_allreduce" for f in findings)
    n = Notifier([receiver.url], SECRET)
    rep = incidents.sync(store, now=sim.end, notifier=n)
    assert [c["to"] for c in rep.changed] == ["mitigated"] and rep.changed[0]["events"] == ["opened", "mitigated"]
    assert len(rep.flips) == 1 and len(receiver.got) == 1
    note = receiver.got[0]
    assert note["signed"] and note["status"] == "firing" and note["version"] == "livestep-incident/1"
    assert note["incident"]["scope"] == f"release={leaking}" and note["incident"]["switch"] == "fused_allreduce"
    assert note["incident"]["evidence_count"] == len(findings)  # every finding is evidence of the one incident
    rules = get_switchboard(store).rules()
    assert [(r.name, r.scope, r.value, r.source) for r in rules] == [
        ("fused_allreduce", f"release={leaking}", False, "incident")]  # no per-worker rule
    # the hourly re-run: same findings, nothing changes, nothing is posted
    run_job("memory", store, now=sim.end)
    again = incidents.sync(store, now=sim.end + timedelta(hours=1), notifier=n)
    assert again.as_dict() == {"changed": [], "flips": [], "notifications": []} and len(receiver.got) == 1
    [inc] = incidents.list_incidents(store)
    assert (inc["state"], inc["flips"], inc["notifications"]) == ("mitigated", 1, 1)
    audit = store.query_rows("SELECT count() FROM switch_audit")[0][0]
    assert audit == 1


def test_repeat_interval_bounds_the_notifications_of_an_open_incident(store, august_fleet):
    sim = simulate_fleet(store, **august_fleet)
    run_job("memory", store, now=sim.end)
    t0 = sim.end
    hourly = [incidents.sync(store, now=t0 + timedelta(hours=h), repeat_s=4 * 3600) for h in range(24)]
    sent = [h for h, rep in enumerate(hourly) if rep.notifications]
    assert sent == [0, 4, 8, 12, 16, 20]  # the state change, then one repeat per 4 h
    day = incidents.incident_log(store, start=t0, end=t0 + timedelta(days=1))
    assert len(day) <= 3 + 24 / 4  # opened + flip + mitigated, then the repeats
    assert store.query_rows("SELECT count() FROM switch_audit")[0][0] == 1


def test_re_enable_after_the_fix_reaches_every_worker_then_the_incident_resolves(store, client, admin,
                                                                                   august_fleet):
    sim = simulate_fleet(store, **august_fleet)
    leaking = sim.release("august").name
    run_job("memory", store, now=sim.end)
    incidents.sync(store, now=sim.end)
    workers = [(w.worker_id, w.gpu_kind) for w in sim.workers]

    def on(w):  # a worker polls with its GPU kind: a numeric switch turned on reaches only evidenced kinds
        return client.get("/v1/switches", params={"worker_id": w[0], "release": leaking, "gpu_kind": w[1]}
                          ).json()["switches"].get("fused_allreduce")

    assert {on(w) for w in workers} == {False}
    evaluate_release(store, "fused_allreduce", leaking)  # a numeric switch: on only with its evidence
    r = client.put("/v1/switches/fused_allreduce", headers=admin,
                   json={"value": True, "scope": f"release={leaking}", "who": "op", "why": "fixed"})
    assert r.status_code == 200 and r.json()["changed"]
    assert {on(w) for w in workers} == {True}  # every worker of the release, not the narrow-rule survivors
    rep = incidents.sync(store, now=sim.end + timedelta(minutes=5))
    assert rep.flips == [] and [c["events"] for c in rep.changed] == [["rule_lifted"]]  # the lift is not undone
    assert {on(w) for w in workers} == {True}
    # the evidence goes away (a window after the leak: nothing grows): resolved
    run_job("memory", store, start=sim.end + timedelta(days=1), end=sim.end + timedelta(days=2))
    rep = incidents.sync(store, now=sim.end + timedelta(days=1))
    assert rep.changed == []  # gone for less than RESOLVE_AFTER: a daily detector may just have missed it
    rep = incidents.sync(store, now=sim.end + timedelta(minutes=5) + incidents.RESOLVE_AFTER)
    assert [c["to"] for c in rep.changed] == ["resolved"] and rep.flips == []
    listed = client.get("/v1/incidents", params={"state": "resolved"}).json()["incidents"]
    assert len(listed) == 1 and listed[0]["evidence_count"] == 0
    # and it comes back: reopened, acted on again
    run_job("memory", store, now=sim.end)
    rep = incidents.sync(store, now=sim.end + timedelta(days=4))
    assert [c["events"] for c in rep.changed] == [["reopened", "mitigated"]] and len(rep.flips) == 1


T = datetime(2026, 11, 2, tzinfo=UTC)


def _f(kind, scope, metric, severity="critical", attribution="", day=0, **kw):
    return finding(kind, scope, metric, T + timedelta(days=day), T + timedelta(days=day + 1), value=1.0,
                   severity=severity, attribution=attribution, **kw)


def test_a_finding_no_switch_explains_alerts_and_flips_nothing(store):
    write_findings(store, "regressions", T, T + timedelta(days=7),
                   [_f("regression", {"release": "v2", "gpu_kind": "h200"}, "step_period_ms")])
    rep = incidents.sync(store, now=T + timedelta(days=7))
    assert [c["to"] for c in rep.changed] == ["opened"] and rep.flips == [] and len(rep.notifications) == 1
    [inc] = incidents.list_incidents(store)
    assert inc["switch"] == "" and "no switch explains it" in inc["summary"]
    assert get_switchboard(store).rules() == []


def test_grouping_by_root_cause():
    fs = [
        _f("memory_growth", {"release": "v2", "worker_id": "w1"}, "reserved_bytes_per_shape", attribution="s1"),
        _f("memory_growth", {"release": "v2", "worker_id": "w2"}, "reserved_bytes_per_shape", attribution="s1"),
        _f("memory_growth", {"release": "v2"}, "processes_growing_per_shape", attribution="s1"),
        _f("memory_growth", {"release": "v3", "worker_id": "w1"}, "reserved_bytes_per_shape", attribution="s1"),
        _f("regression", {"release": "v2", "gpu_kind": "h200"}, "step_period_ms", day=1),
        _f("regression", {"release": "v2", "gpu_kind": "h200"}, "diffusion_ms", day=1),
        _f("changepoint", {"gpu_kind": "h200"}, "step_period_ms_p50", day=2),  # explained by v2's regression
        _f("changepoint", {"gpu_kind": "b200"}, "step_period_ms_p50", day=2),  # nothing explains it
        _f("memory_growth", {"release": "v4"}, "processes_growing_per_shape", severity="info"),  # not an incident
    ]
    groups = {g.key: len(g.findings) for g in incidents.group_findings(fs)}
    assert groups == {"memory_growth|release=v2": 3, "memory_growth|release=v3": 1,
                      "regression|release=v2": 3, "changepoint|gpu_kind=b200": 1}


def test_a_change_point_two_releases_could_explain_stays_its_own_incident():
    fs = [_f("regression", {"release": "v2", "gpu_kind": "h200"}, "step_period_ms", day=1),
          _f("regression", {"release": "v3", "gpu_kind": "h200"}, "step_period_ms", day=1),
          _f("changepoint", {"gpu_kind": "h200"}, "step_period_ms_p50", day=2)]
    keys = [g.key for g in incidents.group_findings(fs)]
    assert "changepoint|gpu_kind=h200" in keys  # a tie: no explanation, never list order


def test_incident_routes(client, store):
    write_findings(store, "regressions", T, T + timedelta(days=7),
                   [_f("regression", {"release": "v2", "gpu_kind": "h200"}, "step_period_ms")])
    incidents.sync(store, now=T + timedelta(days=7))
    listed = client.get("/v1/incidents", params={"state": "open"}).json()["incidents"]
    assert len(listed) == 1 and listed[0]["state"] == "opened" and listed[0]["evidence"][0]["kind"] == "regression"
    one = client.get(f"/v1/incidents/{listed[0]['id']}").json()
    assert [e["event"] for e in one["log"]] == ["opened", "notified"]
    assert client.get("/v1/incidents/0123456789ab").status_code == 404
    assert client.get("/v1/incidents", params={"state": "burning"}).status_code == 422
    page = client.get("/dashboard/incidents")
    assert page.status_code == 200 and "Open incidents" in page.text and "no switch explains it" in page.text


def test_one_cause_on_every_kind_is_one_incident_at_the_release_scope():
    """+15% on the workers running one switch, on every GPU kind: one incident, one decision at the release's
    scope, its switch the one the findings blame; a change point and a drift of the same cause join it."""
    fs = [_f("regression", {"release": "v2", "gpu_kind": k}, "diffusion_ms", attribution="cuda_graphs", day=1)
          for k in ("h100", "h200", "b200")]
    fs += [_f("changepoint", {"gpu_kind": "h100"}, "diffusion_ms_p50", day=2),
           _f("drift", {"release": "v2", "gpu_kind": "b200"}, "diffusion_ms_p50", day=2)]
    [g] = incidents.group_findings(fs)
    assert (g.key, g.scope, g.switch, len(g.findings)) == ("regression|release=v2", "release=v2", "cuda_graphs", 5)


def test_a_power_cap_and_its_change_point_are_one_incident():
    fs = [_f("power", {"gpu_kind": "h100"}, "sm_clock_mhz", severity="warning"),
          _f("power", {"gpu_kind": "h100", "worker_id": "w1"}, "sm_clock_mhz", severity="warning"),
          _f("changepoint", {"gpu_kind": "h100"}, "diffusion_ms_p50", severity="warning", day=1),
          # the step in the daily series also reads as a trend of the release over the drift's window
          _f("drift", {"release": "v1", "gpu_kind": "h100"}, "diffusion_ms_p50", severity="warning")]
    assert [(g.key, len(g.findings)) for g in incidents.group_findings(fs)] == [("power|gpu_kind=h100", 4)]


def test_a_drift_and_the_change_point_it_crosses_are_one_incident():
    # the hold-out fleet's 0.5%/day drift: a drift of v1 on every kind, then a change point on one kind's series
    fs = [_f("drift", {"release": "v1", "gpu_kind": k}, "diffusion_ms_p50", severity="warning") for k in ("h100", "h200")]
    fs += [_f("changepoint", {"gpu_kind": "h200"}, "diffusion_ms_p50", severity="warning", day=2),
           _f("changepoint", {"gpu_kind": "b200"}, "diffusion_ms_p50", severity="warning", day=2),
           _f("changepoint", {"gpu_kind": "h100"}, "late_chunk_rate", severity="warning", day=2)]
    # b200's step joins too (the drift job runs after the change points: its drift may come a run later), and
    # h100's late-chunk rate (it steps as the step time drifts)
    assert [(g.key, len(g.findings)) for g in incidents.group_findings(fs)] == [("drift|release=v1", 5)]
    other = _f("changepoint", {"gpu_kind": "b200"}, "late_chunk_rate", severity="warning", day=2)
    assert [g.key for g in incidents.group_findings([fs[0], other])] == ["changepoint|gpu_kind=b200", "drift|release=v1"]


def test_a_change_point_of_the_release_gaining_share_joins_its_regression_judged_on_other_kinds():
    # the hold-out switch cause: v2 regressed on h100 and h200 (blamed on the switch), b200's daily series stepped
    fs = [_f("regression", {"release": "v2", "gpu_kind": k}, "diffusion_ms", attribution="cuda_graphs")
          for k in ("h100", "h200")]
    step = _f("changepoint", {"gpu_kind": "b200"}, "diffusion_ms_p50", severity="warning", day=2,
              evidence={"release_gaining": "v2"})
    assert [(g.key, g.scope, len(g.findings)) for g in incidents.group_findings([*fs, step])] == [
        ("regression|release=v2", "release=v2", 3)]
    other = _f("changepoint", {"gpu_kind": "b200"}, "diffusion_ms_p50", severity="warning", day=2,
               evidence={"release_gaining": "v3"})
    assert [g.key for g in incidents.group_findings([*fs, other])] == [
        "changepoint|gpu_kind=b200", "regression|release=v2"]


def test_blame_arriving_later_joins_the_incident_and_a_flapping_cause_stays_one(store):
    """Day 0: a regression of v2 on one kind, nobody blamed. Day 1: the same on a second kind, blamed on a
    switch: the same incident, its switch named (and acted on). Day 2: the detector does not see it; day 3 it
    does again: never resolved and reopened. Notifications: at most 3 an incident-day."""
    t = T + timedelta(days=7)
    def day(d, fs):
        write_findings(store, "regressions", T, t + timedelta(days=d), fs, now=t + timedelta(days=d), current=True)
        return incidents.sync(store, now=t + timedelta(days=d, hours=1))

    one = _f("regression", {"release": "v2", "gpu_kind": "h100"}, "diffusion_ms", severity="warning")
    blamed = [_f("regression", {"release": "v2", "gpu_kind": k}, "diffusion_ms", attribution="cuda_graphs")
              for k in ("h100", "h200")]
    reps = [day(0, [one]), day(1, blamed), day(2, []), day(3, blamed)]
    listed = incidents.list_incidents(store)
    assert len(listed) == 1 and listed[0]["switch"] == "cuda_graphs" and listed[0]["scope"] == "release=v2"
    assert listed[0]["state"] != "resolved"
    # opened; escalated and mitigated; nothing the day it was missed; the daily digest
    assert [len(r.notifications) for r in reps] == [1, 1, 0, 1] and reps[3].changed == []
    assert all(c["to"] not in ("resolved", "reopened") for r in reps for c in r.changed)


def test_a_power_cap_keeps_its_incident_when_its_change_is_no_longer_new(store):
    """Day 0: a power cap on h100 (the power detector's change), its change point and the drift of its series:
    one incident. Day 1: the cap is now the power detector's baseline (no change), the change point and the
    drift remain: the same incident, not a new drift incident."""
    t = T + timedelta(days=7)

    def day(d, jobs):
        for job, fs in jobs.items():
            write_findings(store, job, T, t + timedelta(days=d), fs, now=t + timedelta(days=d), current=True)
        return incidents.sync(store, now=t + timedelta(days=d, hours=1))

    cap = _f("power", {"gpu_kind": "h100"}, "sm_clock_mhz", severity="warning")
    step = _f("changepoint", {"gpu_kind": "h100"}, "diffusion_ms_p50", severity="warning")
    trend = _f("drift", {"release": "v1", "gpu_kind": "h100"}, "diffusion_ms_p50", severity="warning")
    reps = [day(0, {"power": [cap], "changepoints": [step], "drift": [trend]}),
            day(1, {"power": [], "changepoints": [step], "drift": [trend]})]
    listed = incidents.list_incidents(store)
    assert [(i["key"], i["state"], i["evidence_count"]) for i in listed] == [("power|gpu_kind=h100", "opened", 2)]
    assert [c["events"] for c in reps[0].changed] == [["opened"]] and reps[1].changed == []


def test_new_evidence_of_an_unchanged_incident_is_stored(store):
    """A second kind's finding joins an open incident without changing its state: nobody is notified, but the
    incident's evidence (and the time it was last seen, which its resolution counts from) is stored."""
    t = T + timedelta(days=7)
    one, two = (_f("regression", {"release": "v2", "gpu_kind": k}, "diffusion_ms", severity="warning")
                for k in ("h100", "h200"))
    for h, fs in ((0, [one]), (2, [one, two])):
        write_findings(store, "regressions", T, t + timedelta(hours=h), fs, now=t + timedelta(hours=h), current=True)
        rep = incidents.sync(store, now=t + timedelta(hours=h, minutes=5))
    assert rep.changed == [] and rep.notifications == []
    [inc] = incidents.list_incidents(store)
    assert inc["evidence_count"] == 2 and incidents._utc(inc["evidence_at"]) == t + timedelta(hours=2, minutes=5)


def test_every_finding_kind_that_can_be_critical_can_open_an_incident():
    """findings.INCIDENT_KINDS is the one list: a critical drift finding opens an incident (it never did
    while api/incidents.py kept its own list), and an info-only kind (variance notes) never does."""
    from analytics import findings

    fs = [_f("drift", {"release": "v2", "gpu_kind": "h200"}, "step_period_ms_p50", severity="critical"),
          _f("variance", {"release": "v2", "gpu_kind": "h200"}, "step_period_ms", severity="critical")]
    keys = [g.key for g in incidents.group_findings(fs)]
    assert keys == ["drift|release=v2"]
    assert incidents.KINDS == findings.INCIDENT_KINDS and set(findings.INCIDENT_KINDS) <= set(findings.KINDS)
