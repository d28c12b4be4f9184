"""A store that answers pings but refuses writes (ClickHouse's "too many parts"), then recovers: the
writer retries for as long as it lasts (health degraded), quarantines nothing, and stores every acked
row exactly once. The refusal is the real store's: ``parts_to_throw_insert`` set below the part count."""

from __future__ import annotations

from tests.collector.helpers import ARROW, arrow_body, drained, step_rows, wait_for
from tests.collector.test_collector_metrics import scrape, value


def test_writes_refused_while_pings_answer_then_recovered_stores_every_acked_row_once(collector):
    c = collector(poison_after_failures=3, retry_max_s=0.05)
    post = lambda body, key: c.post("/v1/telemetry", content=body,
                                    headers={"content-type": ARROW, "idempotency-key": key})
    assert post(arrow_body("step", step_rows(20, session_id="seed")), "seed").status_code == 200
    wait_for(lambda: drained(c.app), what="seed stored")
    store, writer = c.app.state.store, c.app.state.writer
    store.command("ALTER TABLE steps MODIFY SETTING parts_to_throw_insert = 1")  # every insert refused

    sent = 20
    for i in range(30):
        body = arrow_body("step", step_rows(40, session_id=f"s{i % 3}", start=40 * i))
        for _ in range(2 if i % 5 == 0 else 1):  # some retried by the client: acked as duplicates
            assert post(body, f"b{i}").status_code == 200
        sent += 40
    wait_for(lambda: writer.failures >= 12, what="the writer past poison_after, inserting batch by batch")
    h = c.get("/v1/health")
    assert h.status_code == 200 and h.json()["store"]["reachable"]  # pings answer
    body = h.json()
    assert body["status"] == "degraded" and any("Too many parts" in r for r in body["reasons"]), body
    assert body["quarantine"] == {"batches": 0, "rows": 0} and writer.quarantined == 0
    assert body["spool"]["batches"] >= 25 and body["writer"]["failing_for_s"] > 0
    fams = scrape(c)  # what /v1/health says, as a scraper sees it
    assert value(fams, "livestep_collector_degraded", "livestep_collector_degraded") == 1
    assert value(fams, "livestep_collector_writer_failing_seconds", "livestep_collector_writer_failing_seconds") > 0
    assert value(fams, "livestep_collector_quarantine_batches", "livestep_collector_quarantine_batches") == 0

    store.command("ALTER TABLE steps MODIFY SETTING parts_to_throw_insert = 3000")  # the operator's fix
    wait_for(lambda: drained(c.app), what="spool drained after the store recovered")
    assert store.query_rows("SELECT count() FROM steps") == [(sent,)]
    dup = "SELECT count() FROM (SELECT session_id, step FROM steps GROUP BY 1, 2 HAVING count() > 1)"
    assert store.query_rows(dup) == [(0,)]
    assert store.query_rows("SELECT countMerge(steps) FROM session_stats") == [(sent,)]
    assert writer.quarantined == 0
    assert value(scrape(c), "livestep_collector_degraded", "livestep_collector_degraded") == 0
    h = c.get("/v1/health").json()
    assert h["status"] == "ok" and h["reasons"] == [], h
