"""``livestep replay PATH --collector URL``: ship a telemetry file's batches later, each stored once.

    livestep worker run --preset tiny --sessions 3 --telemetry-file run.arrows     # no collector here
    livestep replay run.arrows --collector http://collector:8000 --token T         # later, elsewhere

Each batch of the file (collector/telemetry_file.py) is POSTed as it was filed: the same Arrow
body under the same ``Idempotency-Key`` the worker's client gave it. The collector answers a key it
already holds with ``duplicate: true`` and stores nothing, so replaying a file twice, running a
replay again after it was cut short, or replaying a batch that had reached the collector live
before its ack was lost stores every batch once. Retries are the shipping client's
(``TelemetryClient.post_batch``: 5xx, 429 with ``Retry-After`` and connection errors, with backoff,
until ``--give-up-after-s``); a batch the collector refuses (4xx) is reported and the replay goes
on. A torn tail (the worker died mid-write) is reported; the complete batches before it are shipped.
Exit status 0 when every batch is acked (stored now or before), 1 when one is not.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from collector.telemetry_file import read_file


class ReplayError(Exception):
    """The replay cannot start (no such file, no collector URL)."""


@dataclass
class ReplayReport:
    path: str
    batches: int = 0
    rows: dict[str, int] = field(default_factory=dict)  # per record kind, of the file's batches
    stored: int = 0  # batches the collector stored now
    duplicate: int = 0  # batches the collector already held (an earlier replay, or shipped live)
    lost: dict[str, int] = field(default_factory=dict)  # batches not acked, per reason (client.DROP_REASONS)
    errors: list[str] = field(default_factory=list)  # the first few, one line each
    torn: bool = False

    @property
    def ok(self) -> bool:
        return not self.lost


def replay(path: str | Path, url: str, token: str | None = None, **client_kwargs) -> ReplayReport:
    """Ship every batch of the telemetry file at ``path`` to the collector at ``url``, in file order."""
    from collector.client import TelemetryClient

    path = Path(path)
    if not path.is_file():
        raise ReplayError(f"{path}: no such telemetry file")
    scan = read_file(path)
    report = ReplayReport(str(path), batches=len(scan.batches), torn=scan.torn)
    rows: Counter[str] = Counter()
    lost: Counter[str] = Counter()
    client = TelemetryClient(url, token=token, report_drops_s=None, **client_kwargs)
    try:
        for b in scan.batches:
            rows[b.kind] += b.rows
            why, ack = client.post_batch(b.kind, b.body, b.rows, b.batch_id)
            if why is not None:
                lost[why] += 1
                if len(report.errors) < 5:
                    report.errors.append(f"batch {b.batch_id} ({b.rows} {b.kind} rows): {client.last_error}")
            elif ack.get("duplicate"):
                report.duplicate += 1
            else:
                report.stored += 1
    finally:
        client.close(timeout_s=1.0)
    report.rows, report.lost = dict(rows), dict(lost)
    return report


def register(subparsers) -> None:
    p = subparsers.add_parser("replay", help="ship a telemetry file (worker run --telemetry-file) to a collector")
    p.add_argument("path", help="the telemetry file")
    p.add_argument("--collector", required=True, help="collector URL (http://host:port)")
    p.add_argument("--token", default=os.environ.get("LIVESTEP_TOKEN"),
                   help="ingest bearer token (default: $LIVESTEP_TOKEN)")
    p.add_argument("--give-up-after-s", type=float, default=60.0,
                   help="per batch: stop retrying a collector that fails after this long")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_replay)


def cmd_replay(args) -> int:
    r = replay(args.path, args.collector, token=args.token, give_up_after_s=args.give_up_after_s)
    if args.json:
        print(json.dumps({**asdict(r), "ok": r.ok}))
    else:
        rows = ", ".join(f"{n} {k}" for k, n in sorted(r.rows.items())) or "no rows"
        print(f"replayed {r.path}: {r.batches} batches ({rows}); stored {r.stored}, already stored "
              f"{r.duplicate}, not acked {sum(r.lost.values())}" + (f" {r.lost}" if r.lost else ""))
        if r.torn:
            print("the file ends in a batch cut short (the worker stopped mid-write): left out", file=sys.stderr)
        for e in r.errors:
            print(f"  {e}", file=sys.stderr)
    return 0 if r.ok else 1
