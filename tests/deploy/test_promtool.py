"""The shipped Prometheus rules and Alertmanager routing pass the real tools: syntax, and the rules' own unit tests."""

from __future__ import annotations

import yaml

from tests.deploy.peers import DEPLOY, binary, run


def test_rules_check():
    r = run(binary("promtool"), "check", "rules", str(DEPLOY / "prometheus" / "rules.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_rules_unit_tests():
    r = run(binary("promtool"), "test", "rules", str(DEPLOY / "prometheus" / "tests" / "rules_test.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_prometheus_example_config():
    r = run(binary("promtool"), "check", "config", "--syntax-only", str(DEPLOY / "prometheus" / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_alertmanager_config():
    r = run(binary("amtool"), "check-config", str(DEPLOY / "alertmanager" / "alertmanager.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_labels_what_the_webhook_and_routing_need():
    """Each alert has a severity and an incident (Alertmanager groups by it); those that can name a switch
    carry the scope labels through (release, gpu_kind), which api/alerts.py maps back to a scope."""
    groups = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())["groups"]
    alerts = [r for g in groups for r in g["rules"] if "alert" in r]
    assert len(alerts) >= 9
    for a in alerts:
        assert a["labels"]["severity"] in ("warning", "critical"), a["alert"]
        assert "incident" in a["labels"], a["alert"]
        assert a["annotations"]["summary"], a["alert"]
    switched = [a for a in alerts if "switch" in a["expr"] or "switch" in a["labels"]["incident"]]
    assert {a["alert"] for a in switched} >= {"LivestepLateChunks", "LivestepFpsBelow24", "LivestepCriticalFinding",
                                             "LivestepCriticalIncident"}
    for a in switched:
        assert "release" in a["labels"]["incident"], a["alert"]
    am = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yml").read_text())
    assert am["route"]["group_by"] == ["incident"]
    hook = next(r for r in am["receivers"] if r["name"] == "livestep")["webhook_configs"][0]
    assert hook["url"].endswith("/v1/alerts") and hook["send_resolved"]
    assert hook["http_config"]["authorization"]["type"] == "Bearer"
