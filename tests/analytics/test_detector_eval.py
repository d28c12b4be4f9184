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
    line = next(ln for ln in summarize(outs) if ln.startswith("leak_session")).split()
    assert line == ["leak_session", "memory", "100.0%", "(3/3)", "66.7%", "(2/3)", "-", "-", "24", "48", "-",
                    "66.7%", "(2/3)", "-"]  # recall, scope right, h to first, h to scope (median), ambiguous 1st
