"""Mangled Arrow bodies are refused with a 4xx, never crash the process (tests/collector/fuzz_bodies.py).

Each check runs the corpus in a child process: a crash in native code is then a failed test with its
exit status, not a dead test run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[2]


def _corpus(*args: str) -> tuple[int, dict, str]:
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-m", "tests.collector.fuzz_bodies", *args],
                       cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    out = p.stdout.strip().splitlines()
    return p.returncode, orjson.loads(out[-1]) if out else {}, p.stderr[-3000:]


def test_invalid_string_offsets_are_refused_with_400_naming_them():
    rc, answer, err = _corpus("--crafted")
    assert rc == 0, f"exit status {rc} (negative: killed by signal {-rc}); {err}"
    assert answer["status"] == 400
    assert "'session_id'" in answer["detail"] and "offset" in answer["detail"].lower()


def test_seeded_corpus_of_flipped_and_truncated_bodies_answers_cleanly():
    rc, counts, err = _corpus("--cases", "4000", "--seed", "17")
    assert rc == 0, f"exit status {rc} (negative: killed by signal {-rc}); {err}"
    assert counts.get("failed", 0) == 0
    assert sum(counts.values()) == 4000
    # the corpus reaches past the framing checks: some mangled bodies still decode, some are refused
    # for their values (422), most for their bytes (400)
    assert counts["accepted"] > 0 and counts["refused 422"] > 0 and counts["refused 400"] > 0
