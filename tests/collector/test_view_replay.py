"""session_stats stays exact when the writer replays a block after kill -9 (issue 30 item 1).

The writer logs a block's spool range, inserts it, then commits the range; a process killed between
the insert and the commit replays the same block under the same deduplication tokens at its next
start. The raw table deduplicates it by its token, and the views fed by it must too. Each process
here is a real one (chDB allows one process per data directory): the first migrates a fresh database,
stores a block and is killed with SIGKILL before the commit; the second starts on the same
directories, replays the block and counts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_CRASH = textwrap.dedent("""
    import os, signal, sys
    from collector import records
    from collector.spool import Spool
    from collector.store import open_store
    from collector.writer import BlockWriter
    from tests.collector.helpers import step_rows

    store = open_store(sys.argv[1])
    store.migrate()  # a fresh database: every migration (the views' MODIFY QUERY too) runs in this process
    sp = Spool(sys.argv[2], max_bytes=1 << 26)
    for s in range(24):
        sp.submit(f"b{s}", {"step": records.to_arrow("step", step_rows(100, session_id=f"s{s}"))}).result()
    entries = sp.take(1_000_000)
    sp.log_intent(entries[0].seq, entries[-1].seq)
    BlockWriter(sp, lambda: store)._insert(entries, set())  # the block is in the store ...
    os.kill(os.getpid(), signal.SIGKILL)                    # ... and the process dies before the commit
""")

_REPLAY = textwrap.dedent("""
    import json, sys
    from collector.spool import Spool
    from collector.store import open_store
    from collector.writer import BlockWriter
    from tests.collector.helpers import wait_for

    store = open_store(sys.argv[1])
    store.migrate()
    sp = Spool(sys.argv[2], max_bytes=1 << 26)
    assert sp.recovered_intent is not None, "the crash left no logged block to replay"
    w = BlockWriter(sp, lambda: store, flush_interval_s=0.01)
    w.start()
    wait_for(lambda: sp.stats()["batches"] == 0, what="replay drained the spool")
    w.stop()
    sp.close()
    q = lambda sql: store.query_rows(sql)[0][0]
    print(json.dumps({"raw": q("SELECT count() FROM steps"),
                      "session_stats": q("SELECT countMerge(steps) FROM session_stats"),
                      "session_fleet": q("SELECT sum(steps) FROM session_fleet"),
                      "per_session": store.query_rows(
                          "SELECT count() FROM (SELECT session_id, countMerge(steps) AS n FROM session_stats "
                          "GROUP BY session_id HAVING n != 100)")[0][0]}))
""")


def _run(code: str, *args: str, expect_kill: bool = False) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, check=False,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    if expect_kill:
        assert out.returncode == -9, out.stderr[-2000:]
    else:
        assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow
def test_a_block_replayed_after_kill_9_counts_once_in_session_stats(tmp_path):
    dsn, spool = f"chdb://{tmp_path / 'chdb'}", str(tmp_path / "spool")
    _run(_CRASH, dsn, spool, expect_kill=True)
    counts = json.loads(_run(_REPLAY, dsn, spool).strip().splitlines()[-1])
    assert counts == {"raw": 2400, "session_stats": 2400, "session_fleet": 2400, "per_session": 0}
