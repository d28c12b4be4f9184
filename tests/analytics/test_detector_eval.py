"""evaluate-detectors' scoring of a memory finding's key: right only when named confidently; a key named
as ambiguous is found but not yet judged (the catalog judges it at the first rung that commits); a key
named confidently and wrong is wrong."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from analytics.detector_eval import CATALOG, Outcome, _confident, _correct, summarize
from analytics.findings import finding

T0, T1 = datetime(2026, 11, 23, tzinfo=UTC), datetime(2026, 11, 30, tzinfo=UTC)
LEAK_SESSION = next(c for c in CATALOG if c.name == "leak_session")


def _release_row(**ev):
    return finding("memory_growth", {"release": "v1.1"}, "processes_growing_per_shape", T0, T1, value=9,
                   baseline=9, evidence=ev)


def test_a_confident_right_key_is_right_and_an_ambiguous_one_waits():
    right = _release_row(explained_by="per session", key="per session", key_confident=True, aliases=[])
    assert _correct(LEAK_SESSION, "v1.1", [right], {"h100"})[:2] == (True, True) and _confident(right)
    amb = _release_row(explained_by="first_forward_tokens", key="first_forward_tokens", key_confident=False,
                       ambiguous_with=["per session"], aliases=["cond_tokens"])
    found, scope_right, row = _correct(LEAK_SESSION, "v1.1", [amb], {"h100"})
    assert found and not scope_right and not _confident(row)


def test_a_confident_wrong_key_is_wrong_and_an_alias_counts_as_named():
    wrong = _release_row(explained_by="first_forward_tokens", key="first_forward_tokens", key_confident=True,
                         aliases=["cond_tokens"])
    assert _correct(LEAK_SESSION, "v1.1", [wrong], {"h100"})[:2] == (True, False)
    prompt = next(c for c in CATALOG if c.name == "leak_prompt")
    sized = _release_row(explained_by="first_forward_tokens, sized by its tokens", key="first_forward_tokens",
                         key_confident=True, aliases=[])
    assert _correct(prompt, "v1.1", [sized], {"h100"})[:2] == (True, True)
    assert json.loads(sized["evidence"])["key"] == "first_forward_tokens"


def test_the_table_counts_ambiguous_first_findings_and_the_rung_of_the_judged_one():
    outs = [Outcome("leak_session", 0, found=True, scope_right=True, hours_to_first=24, ambiguous_first=True,
                    hours_to_scope=72),
            Outcome("leak_session", 1, found=True, scope_right=False, hours_to_first=24, ambiguous_first=True),
            Outcome("leak_session", 2, found=True, scope_right=True, hours_to_first=24, ambiguous_first=False,
                    hours_to_scope=24)]
    line = next(ln for ln in summarize(outs, CATALOG) if ln.startswith("leak_session")).split()
    assert line == ["leak_session", "memory", "100.0%", "(3/3)", "66.7%", "(2/3)", "-", "-", "-", "24", "48", "-",
                    "66.7%", "(2/3)", "-"]  # recall, scope right, (attribution, severity, condition), h to first,
    # h to scope (median), ambiguous 1st


def test_a_seed_outcome_does_not_depend_on_the_hour_the_catalog_runs(monkeypatch, chdb_dir):
    """The simulated fleet used to end at "this hour": the daily detectors cut its data at midnight, so
    benign_release seed 4 raised a drift alarm when run at 20:05 and none at 21:05."""
    import analytics.detector_eval as de
    import analytics.simulate as sim

    def at(hour):
        class Clock(datetime):
            @classmethod
            def now(cls, tz=None):
                return datetime(2026, 12, 1, hour, 5, tzinfo=UTC).astimezone(tz)
        monkeypatch.setattr(de, "datetime", Clock)
        monkeypatch.setattr(sim, "datetime", Clock)
        o = de.run_case(next(c for c in CATALOG if c.name == "benign_release"), 4, chdb_dir)
        return o.false_alarms, o.note_found

    assert at(20) == at(21)
    assert de.sim_end(4, datetime(2026, 12, 1, 0, 1, tzinfo=UTC)) == de.sim_end(4, datetime(2026, 12, 1, 23, 59,
                                                                                           tzinfo=UTC))
    assert len({de.sim_end(s).hour for s in range(24)}) == 24  # every phase of the day boundaries, by seed


def test_a_release_scoped_finding_is_right_for_an_incident_on_every_kind_only():
    from analytics.detector_eval import _judge_rows

    every = next(c for c in CATALOG if c.name == "hold_session_age")
    one = next(c for c in CATALOG if c.name == "sync_h100")
    row = finding("regression", {"release": "v2"}, "diffusion_ms_per_step", T0, T1, value=0.02, severity="warning")
    one_row = finding("regression", {"release": "v2"}, "step_period_ms", T0, T1, value=1.0, severity="warning")
    assert _judge_rows(every, "v2", [row], {"h100", "h200"})[:2] == (True, True)
    assert _judge_rows(one, "v2", [one_row], {"h100", "h200"})[:2] == (True, False)
