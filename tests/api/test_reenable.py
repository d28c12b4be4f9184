"""A re-enable after an incident's flip reaches only the workers that ran the switch (api/reenable.py), through
the HTTP API: one cause on every GPU kind, one worker of each kind running cuda_graphs, one flip at the release's
scope; ``POST /v1/switches/cuda_graphs/reenable`` turns it on for those workers only, the others (and a worker
that joins later) keep their own value, and the incident sees its rule lifted without flipping again."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from analytics.findings import finding, write_findings
from api import incidents
from collector import records
from collector.switch_names import PRODUCTION_OFF
from tests.collector.helpers import event_row, step_rows

SWITCH = "cuda_graphs"
PRODUCTION = set(records.SWITCH_NAMES) - set(PRODUCTION_OFF)
# worker -> (GPU kind, ran the switch)
WORKERS = {"hw00": ("h100", True), "hw01": ("h100", False), "hw10": ("b200", True), "hw11": ("b200", False)}


def _fleet(store, t0: datetime) -> None:
    for i, (w, (kind, ran)) in enumerate(WORKERS.items()):
        on = PRODUCTION if ran else PRODUCTION - {SWITCH}
        rows = step_rows(20, session_id=f"{w}-s0", worker_id=w, release="v2", gpu_kind=kind,
                         ts=t0 + timedelta(minutes=i), switches=records.encode_switches(on))
        store.insert_arrow("steps", records.to_arrow("step", rows), dedup_token=f"reenable-{w}")


def _flip(store, now: datetime) -> None:
    """The incident logic's one decision: a critical regression of v2 on every kind, blamed on the switch."""
    rows = [finding("regression", {"release": "v2"}, "diffusion_ms", now - timedelta(days=1), now, value=1.15,
                    baseline=1.0, effect=0.15, severity="critical", attribution=SWITCH)]
    write_findings(store, "regressions", now - timedelta(days=1), now, rows, current=True)
    rep = incidents.sync(store, now=now)
    assert [f["scope"] for f in rep.flips] == ["release=v2"]


def _value(client, w: str, kind: str):
    r = client.get("/v1/switches", params={"worker_id": w, "release": "v2", "gpu_kind": kind})
    assert r.status_code == 200, r.text
    return r.json()["switches"].get(SWITCH)


def test_a_reenable_reaches_only_the_workers_that_ran_the_switch(store, client, admin):
    now = datetime.now(UTC).replace(microsecond=0)
    _fleet(store, now - timedelta(hours=3))
    _flip(store, now - timedelta(minutes=30))
    assert {w: _value(client, w, k) for w, (k, _) in WORKERS.items()} == dict.fromkeys(WORKERS, False)
    # a worker with no session in the store before the flip, whose own flip_cost event says the flip turned it off
    cost = event_row("flip_cost", session_id="hw30-s9", worker_id="hw30", release="v2", gpu_kind="h200",
                     ts=datetime.now(UTC), detail={"step": 5, "applied_step": 6, "changed": {SWITCH: False},
                                                             "mode": "inline", "late_chunks": 0, "stall_ms": 0.0})
    store.insert_arrow("events", records.to_arrow("event", [cost]), dedup_token="reenable-cost")

    r = client.post(f"/v1/switches/{SWITCH}/reenable", headers=admin,
                    json={"scope": "release=v2", "who": "op", "why": "fixed in v2.1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["reenabled"] == ["hw00", "hw10", "hw30"] and body["lifted"] == ["release=v2"] and body["still_off_by"] == []
    # on again where it ran; the others are left to their own value (off: they never ran it), not told "on"
    assert {w: _value(client, w, k) for w, (k, _) in WORKERS.items()} == {
        "hw00": True, "hw01": None, "hw10": True, "hw11": None}
    assert _value(client, "hw30", "h200") is True
    assert _value(client, "hw20", "h200") is None  # a worker that joins later: its own value too

    rep = incidents.sync(store, now=now)
    assert rep.flips == [] and [c["events"] for c in rep.changed] == [["rule_lifted"]]

    again = client.post(f"/v1/switches/{SWITCH}/reenable", headers=admin,
                        json={"scope": "release=v2", "who": "op", "why": "again"})
    assert again.status_code == 409 and "nothing to re-enable" in again.json()["detail"]


def test_a_flip_broader_than_the_scope_stays_for_the_workers_that_never_ran_it(store, client, admin):
    now = datetime.now(UTC).replace(microsecond=0)
    _fleet(store, now - timedelta(hours=3))
    r = client.put(f"/v1/switches/{SWITCH}", headers=admin,
                   json={"value": False, "scope": "", "who": "op", "why": "fleet-wide off"})
    assert r.status_code == 200 and r.json()["changed"]
    r = client.post(f"/v1/switches/{SWITCH}/reenable", headers=admin,
                    json={"scope": "release=v2,gpu_kind=h100", "who": "op", "why": "h100 fixed"})
    assert r.status_code == 200, r.text
    assert r.json()["reenabled"] == ["hw00"] and r.json()["lifted"] == [] and r.json()["still_off_by"] == ["(fleet)"]
    assert {w: _value(client, w, k) for w, (k, _) in WORKERS.items()} == {
        "hw00": True, "hw01": False, "hw10": False, "hw11": False}


def test_reenable_needs_an_admin_and_a_known_switch(client, admin):
    body = {"scope": "release=v2", "who": "op", "why": "x"}
    assert client.post(f"/v1/switches/{SWITCH}/reenable", json=body).status_code in (401, 403)
    assert client.post("/v1/switches/nope/reenable", headers=admin, json=body).status_code == 404
    assert client.post(f"/v1/switches/{SWITCH}/reenable", headers=admin, json=body).status_code == 409
