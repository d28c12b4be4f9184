"""evaluate-detectors measures incidents per cause and notifications per incident-day with the service's own
incident logic (api.incidents.sync, registered by ``install_evaluation`` as the CLI does): the hold-out fleet's
+15% cause on the workers with one switch on, on 3 GPU kinds, is one incident, one flip and at most one
notification a day; the table prints them against the goals."""

from __future__ import annotations

import pytest

from analytics import holdout_eval
from analytics.detector_eval import CATALOG, Outcome, run_case, summarize
from api.incidents import install_evaluation


@pytest.fixture
def registered():
    install_evaluation()
    yield
    holdout_eval.set_incident_sync(None)


def test_one_cause_on_every_kind_is_one_incident_with_few_notifications(registered, chdb_dir):
    case = next(c for c in CATALOG if c.name == "hold_switch_cause")
    o = run_case(case, 0, chdb_dir)
    assert o.found and o.attribution_right
    assert o.incidents["incidents"] == 1 and o.incidents["flips"] == 1 and o.incidents["reopened"] == 0
    assert 1 <= o.incidents["max_notifications_day"] <= 3 and o.incidents["incident_days"] >= 2


def test_the_table_prints_incidents_per_cause_and_notifications_per_incident_day():
    inc = {"reopened": 0, "flips": 1}
    outs = [Outcome("hold_switch_cause", 0, found=True, incidents={**inc, "incidents": 1, "notifications": 3,
                                                                  "incident_days": 3, "max_notifications_day": 1}),
            Outcome("hold_switch_cause", 1, found=True, incidents={**inc, "incidents": 2, "notifications": 8,
                                                                  "incident_days": 3, "max_notifications_day": 4}),
            Outcome("hold_healthy", 0, incidents={**inc, "flips": 0, "incidents": 0, "notifications": 0,
                                                 "incident_days": 0, "max_notifications_day": 0})]
    lines = summarize(outs, CATALOG)
    assert [ln for ln in lines if ln.startswith("hold_switch_cause")][-1].split() == [
        "hold_switch_cause", "50.0%", "(1/2)", "1.5/2", "0", "1", "1.83", "4"]
    assert lines[-1] == ("incidents per cause within the goal (<= 1; benign: 0)  66.7% (2/3); notifications per "
                         "incident-day 1.83, worst incident-day 4 (goal <= 3)")
