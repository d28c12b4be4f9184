"""What an incident's flip cost the live sessions: the workers' flip_cost events of its switch turned off in its
scope, since it opened, on its REST detail and its page (api/incidents.py ``flip_cost``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from analytics.findings import finding, write_findings
from api import incidents
from tests.analytics.test_flips import _insert, flip_event


def test_the_incident_shows_what_its_flip_cost(store, client, admin):
    now = datetime.now(UTC)
    start = now - timedelta(days=1)
    f = finding("memory_growth", {"release": "v1"}, "processes_growing_per_shape", start, now, value=1.0,
                severity="critical", attribution="static_scales")
    write_findings(store, "memory", start, now, [f])
    rep = incidents.sync(store, now=now - timedelta(minutes=5))
    assert len(rep.flips) == 1
    [inc] = incidents.list_incidents(store)
    assert incidents.flip_cost(store, inc)["flips"] == 0  # no worker has reported the flip yet
    _insert(store, [
        flip_event("static_scales", False, 0, 0.0, now - timedelta(minutes=2), worker="w1"),
        flip_event("static_scales", False, 1, 1791.0, now - timedelta(minutes=1), worker="w2"),
        flip_event("static_scales", False, 0, 0.0, now - timedelta(minutes=1), worker="w3", release="v2"),  # other scope
        flip_event("static_scales", True, 0, 0.0, now - timedelta(minutes=1), worker="w1"),  # a re-enable, not its flip
        flip_event("compile", False, 4, 900.0, now - timedelta(minutes=1), worker="w1"),  # another switch
        flip_event("static_scales", False, 0, 0.0, now - timedelta(hours=2), worker="w4"),  # before the incident
    ])
    r = client.get(f"/v1/incidents/{inc['id']}", headers=admin)
    assert r.status_code == 200
    cost = r.json()["flip_cost"]
    assert (cost["flips"], cost["workers"], cost["late_chunks"], cost["max_stall_ms"]) == (2, 2, 1, 1791.0)
    assert cost["max_to_new_config_ms"] == 4700.0 and cost["out_of_service_ms"] == 0.0
    assert {x["worker_id"] for x in cost["recent"]} == {"w1", "w2"}
    page = client.get("/dashboard/incidents", headers=admin)
    assert page.status_code == 200 and "2 flips on 2 workers: 1 late chunks" in page.text
