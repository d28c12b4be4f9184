"""Alert webhook: each format flips the named switch; every bad input is a 4xx or a recorded no-op."""

from __future__ import annotations

import time

import orjson
import pytest

from api.alerts import sign
from tests.api.conftest import SECRET


def am(status="firing", switch="fused_allreduce", release="v7", fingerprint="fp1", starts="2026-08-10T10:00:00Z"):
    labels = {"alertname": "MemoryGrowth", "severity": "critical", "release": release}
    if switch:
        labels["switch"] = switch
    return {"version": "4", "status": status, "receiver": "livestep", "groupKey": "{}:{}",
            "groupLabels": {}, "commonLabels": labels, "commonAnnotations": {}, "externalURL": "http://am",
            "truncatedAlerts": 0,
            "alerts": [{"status": status, "labels": labels, "annotations": {"summary": "memory grows per shape"},
                        "startsAt": starts, "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prom",
                        "fingerprint": fingerprint}]}


def grafana(status="firing", switch="fused_allreduce"):
    labels = {"alertname": "Late chunks", "switch": switch, "gpu_kind": "h200"}
    return {"receiver": "livestep", "status": status, "orgId": 1, "groupLabels": {}, "commonLabels": labels,
            "commonAnnotations": {}, "externalURL": "http://grafana", "version": "1", "groupKey": "k",
            "truncatedAlerts": 0, "title": "[FIRING:1] Late chunks", "state": "alerting", "message": "m",
            "alerts": [{"status": status, "labels": labels, "annotations": {}, "startsAt": "2026-08-10T10:00:00Z",
                        "endsAt": "0001-01-01T00:00:00Z", "values": {"A": 1}, "generatorURL": "",
                        "fingerprint": "g1", "silenceURL": "", "dashboardURL": "", "panelURL": ""}]}


def finding(status="open", attribution="fused_allreduce", scope="release=v7"):
    return {"findings": [{"kind": "memory_growth", "scope": scope, "metric": "bytes_per_shape",
                          "window_start": "2026-08-10T00:00:00+00:00", "window_end": "2026-08-17T00:00:00+00:00",
                          "value": 1.5e9, "severity": "critical", "status": status, "attribution": attribution,
                          "evidence": "{}"}]}


def post(client, doc, secret=SECRET, ts=None, headers=None, raw=None):
    body = raw if raw is not None else orjson.dumps(doc)
    h = sign(secret, body, ts) if headers is None else headers
    return client.post("/v1/alerts", content=body, headers={"Content-Type": "application/json", **h})


def switch_of(client, name="fused_allreduce", **labels):
    """The value a rule gives the switch for these labels; None when no rule names it."""
    return client.get("/v1/switches", params=labels).json()["switches"].get(name)


@pytest.mark.parametrize("doc,labels,fmt", [
    (am(), {"release": "v7"}, "alertmanager"),
    (grafana(), {"gpu_kind": "h200"}, "grafana"),
    (finding(), {"release": "v7"}, "livestep"),
])
def test_firing_alert_flips_switch_off_in_scope(client, doc, labels, fmt):
    r = post(client, doc)
    assert r.status_code == 200, r.text
    assert r.json()["format"] == fmt and r.json()["flipped"] == 1
    assert switch_of(client, **labels) is False
    assert switch_of(client, release="v6", gpu_kind="a100") is None  # out of scope: no rule
    hist = client.get("/v1/switches/history", params={"source": "alert"}).json()["decisions"]
    assert len(hist) == 1 and hist[0]["changed"] and hist[0]["new_value"] is False
    assert hist[0]["actor"] == f"alert:{fmt}" and hist[0]["ref"]


def test_same_alert_delivered_ten_times_flips_once(client):
    now = int(time.time())  # each delivery signed afresh (a new timestamp), as a sender's retries are
    results = [post(client, am(), ts=now - i).json() for i in range(10)]
    assert [r["flipped"] for r in results] == [1] + [0] * 9
    hist = client.get("/v1/switches/history", params={"source": "alert"}).json()["decisions"]
    assert sum(d["changed"] for d in hist) == 1 and len(hist) == 10
    assert {d["action"] for d in hist if not d["changed"]} == {"alert_duplicate"}


def test_resolved_alerts_are_recorded_noops(client):
    for doc in (am(status="resolved"), grafana(status="resolved"), finding(status="resolved")):
        r = post(client, doc)
        assert r.status_code == 200 and r.json()["flipped"] == 0
    assert switch_of(client, release="v7", gpu_kind="h200") is None
    hist = client.get("/v1/switches/history").json()["decisions"]
    assert len(hist) == 3 and {d["action"] for d in hist} == {"alert_resolved"} and not any(d["changed"] for d in hist)


def test_unmapped_alert_is_a_recorded_noop(client):
    r = post(client, am(switch=None))
    assert r.status_code == 200 and r.json()["flipped"] == 0
    assert client.get("/v1/switches/history").json()["decisions"][0]["action"] == "alert_unmapped"


@pytest.mark.parametrize("make_headers,fragment", [
    (lambda body: {}, "missing signature"),
    (lambda body: sign("wrong-secret", body), "bad signature"),
    (lambda body: sign(SECRET, body, int(time.time()) - 3600), "stale timestamp"),
    (lambda body: sign(SECRET, body, int(time.time()) + 3600), "stale timestamp"),
    (lambda body: {**sign(SECRET, body), "X-Livestep-Timestamp": "yesterday"}, "unix seconds"),
    (lambda body: sign(SECRET, body + b" "), "bad signature"),
])
def test_bad_signatures_are_401_and_flip_nothing(client, make_headers, fragment):
    body = orjson.dumps(am())
    r = post(client, None, raw=body, headers=make_headers(body))
    assert r.status_code == 401 and fragment in r.json()["detail"]
    assert switch_of(client, release="v7") is None
    assert client.get("/v1/switches/history").json()["decisions"] == []


def test_replayed_signature_is_409(client):
    body = orjson.dumps(am(status="resolved"))
    headers = sign(SECRET, body)
    assert post(client, None, raw=body, headers=headers).status_code == 200
    r = post(client, None, raw=body, headers=headers)
    assert r.status_code == 409 and "replayed" in r.json()["detail"]


class _FailingOnce:
    """The store's client with one failing insert into ``table`` (a store outage mid-delivery)."""

    def __init__(self, client, table):
        self._client, self._table, self.failed = client, table, False

    def __getattr__(self, name):
        return getattr(self._client, name)

    def insert(self, table, *a, **kw):
        if table == self._table and not self.failed:
            self.failed = True
            raise ConnectionError(f"store unavailable while writing {table}")
        return self._client.insert(table, *a, **kw)


def test_a_delivery_that_failed_to_store_can_be_retried(app, store, monkeypatch):
    from fastapi.testclient import TestClient

    real = store.client
    fault = _FailingOnce(real(), "switch_rules")
    monkeypatch.setattr(store, "client", lambda: fault)
    body = orjson.dumps(am())
    headers = sign(SECRET, body)  # the sender retries the very same signed delivery
    with TestClient(app, raise_server_exceptions=False) as c:
        first = post(c, None, raw=body, headers=headers)
        assert first.status_code == 500 and fault.failed
        retry = post(c, None, raw=body, headers=headers)
        assert retry.status_code == 200, retry.text
        assert retry.json()["flipped"] == 1
        assert switch_of(c, release="v7") is False
        again = post(c, None, raw=body, headers=headers)  # stored now: a replay
        assert again.status_code == 409
        hist = c.get("/v1/switches/history").json()["decisions"]
    assert [d["action"] for d in hist if d["changed"]] == ["set"]


@pytest.mark.parametrize("raw,fragment", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"hello": "world"}', "unrecognised payload"),
    (orjson.dumps({"version": "4", "status": "firing", "alerts": [{"status": "burning"}]}), "Alertmanager"),
    (orjson.dumps({"version": "4", "status": "firing", "alerts": "nope"}), "Alertmanager"),
    (orjson.dumps({"orgId": 1, "status": "firing", "alerts": [{"labels": "x"}]}), "Grafana"),
    (orjson.dumps({"findings": [{"scope": "release=v7"}]}), "findings"),
    (orjson.dumps({"findings": "all of them"}), "findings"),
])
def test_malformed_payloads_are_422(client, raw, fragment):
    r = post(client, None, raw=raw)
    assert r.status_code == 422 and fragment in r.json()["detail"]
    assert client.get("/v1/switches/history").json()["decisions"] == []


def test_unknown_switch_is_422_listing_valid_ones(client):
    r = post(client, am(switch="warp_drive"))
    assert r.status_code == 422 and "warp_drive" in r.json()["detail"] and "ring_cache" in r.json()["detail"]
    r = post(client, finding(attribution="warp_drive"))
    assert r.status_code == 422
    assert client.get("/v1/switches/history").json()["decisions"] == []


def test_bad_scope_is_a_recorded_noop(client):
    r = post(client, finding(scope="week=2026-W33"))
    assert r.status_code == 200 and r.json()["flipped"] == 0
    d = client.get("/v1/switches/history").json()["decisions"][0]
    assert d["action"] == "alert_unmapped" and "scope" in d["reason"]


def test_already_off_switch_alert_is_noop(client, admin):
    client.put("/v1/switches/fused_allreduce", headers=admin, json={"value": False, "who": "a", "why": "b"})
    r = post(client, am())
    assert r.status_code == 200 and r.json()["flipped"] == 0
    assert r.json()["decisions"][0]["action"] == "noop"


def test_ten_concurrent_deliveries_on_a_real_server_flip_once(app):
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.api.live import serve

    body = orjson.dumps(am(fingerprint="concurrent"))
    now = int(time.time())
    with serve(app) as base, ThreadPoolExecutor(10) as pool:
        results = list(pool.map(lambda i: httpx.post(f"{base}/v1/alerts", content=body, timeout=30,
                                                     headers={"Content-Type": "application/json",
                                                              **sign(SECRET, body, now - i)}), range(10)))
        assert [r.status_code for r in results] == [200] * 10
        assert sum(r.json()["flipped"] for r in results) == 1
        hist = httpx.get(f"{base}/v1/switches/history", params={"name": "fused_allreduce"}).json()["decisions"]
    assert sum(d["changed"] for d in hist) == 1 and len(hist) == 10


def test_grafana_native_hmac_signing_is_accepted(client):
    from api.alerts import sign_grafana

    body = orjson.dumps(grafana())
    r = post(client, None, raw=body, headers=sign_grafana(SECRET, body))
    assert r.status_code == 200 and r.json()["flipped"] == 1
    stale = sign_grafana(SECRET, body, int(time.time()) - 3600)
    assert post(client, None, raw=body, headers=stale).status_code == 401
    bad = sign_grafana("nope", body)
    assert post(client, None, raw=body, headers=bad).status_code == 401
    # a timestamped signature sent without its timestamp is checked as a body-only one: it does not match
    no_ts = {"X-Grafana-Alerting-Signature": sign_grafana(SECRET, body)["X-Grafana-Alerting-Signature"]}
    r = post(client, None, raw=body, headers=no_ts)
    assert r.status_code == 401 and "body" in r.json()["detail"]


@pytest.mark.parametrize("sig_header,ts_header", [
    ("X-Grafana-Alerting-Signature", "X-Grafana-Alerting-Timestamp"),  # Grafana's default signature header
    ("X-Grafana-Alert-Signature", "X-Grafana-Alert-Timestamp"),
    ("X-Grafana-Alerting-Signature", "X-Grafana-Alert-Timestamp"),
])
def test_grafana_signature_header_names(client, sig_header, ts_header):
    from api.alerts import sign_grafana

    body = orjson.dumps(grafana())
    r = post(client, None, raw=body, headers=sign_grafana(SECRET, body, sig_header=sig_header, ts_header=ts_header))
    assert r.status_code == 200 and r.json()["flipped"] == 1


def test_grafana_without_a_timestamp_header_signs_the_body_and_acts_once(client):
    """No timestamp: the body alone is verified; a replay of the same body changes nothing (its alert keys
    were seen), so replay protection holds without the window."""
    from api.alerts import sign_grafana

    body = orjson.dumps(grafana())
    headers = sign_grafana(SECRET, body, with_timestamp=False)
    assert list(headers) == ["X-Grafana-Alerting-Signature"]
    first = post(client, None, raw=body, headers=headers)
    assert first.status_code == 200 and first.json()["flipped"] == 1
    replay = post(client, None, raw=body, headers=headers)
    assert replay.status_code == 200 and replay.json()["flipped"] == 0
    assert replay.json()["decisions"][0]["action"] == "alert_duplicate"
    assert post(client, None, raw=body, headers=sign_grafana("wrong-secret-0123456", body,
                                                             with_timestamp=False)).status_code == 401
    tampered = body.replace(b"Late chunks", b"Late chunkz")
    assert post(client, None, raw=tampered, headers=headers).status_code == 401


def test_a_resolved_that_arrives_before_its_firing_does_not_use_up_the_firing(client):
    """Alertmanager may deliver out of order (retries, two replicas): the firing still flips."""
    now = int(time.time())
    assert post(client, am(status="resolved"), ts=now).json()["decisions"][0]["action"] == "alert_resolved"
    r = post(client, am(status="firing"), ts=now)
    assert r.json()["flipped"] == 1
    again = post(client, am(status="resolved"), ts=now - 5)  # signed afresh: not a replay
    assert again.json()["decisions"][0]["action"] == "alert_duplicate"
    # the same holds for our own findings
    assert post(client, finding(status="resolved")).json()["flipped"] == 0
    assert post(client, finding(status="open", scope="release=v8")).json()["flipped"] == 1
