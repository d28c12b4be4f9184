"""Where the simulator's Arrow blocks go: straight into a Store (bulk) or row by row through the worker's
``TelemetryClient`` (the real collector path); ``as_sink`` picks one for a target."""

from __future__ import annotations

import pyarrow as pa

from analytics.sim_fleet import SimulationError
from collector import records


class DirectSink:
    """Bulk path: Arrow blocks straight into ``Store.insert_arrow`` (one dedup token per block)."""

    def __init__(self, store):
        self.store = store

    def write(self, kind: str, table: pa.Table, token: str) -> None:
        self.store.insert_arrow(records.TABLES[kind], table, dedup_token=token)

    def close(self) -> None:
        pass


class ClientSink:
    """The real collector path: every row through ``collector.client.TelemetryClient.put``.

    ``put`` never blocks (it drops when the client's queue is full), so the simulator, which produces
    rows far faster than a worker, waits for the client to ship every ``backpressure_rows`` rows."""

    def __init__(self, client, flush_timeout_s: float = 30.0, backpressure_rows: int = 20_000):
        self.client = client
        self.flush_timeout_s = flush_timeout_s
        self.backpressure_rows = backpressure_rows

    def write(self, kind: str, table: pa.Table, token: str) -> None:
        for batch in table.to_batches(max_chunksize=self.backpressure_rows):
            for row in batch.to_pylist():
                self.client.put(kind, row)
            if getattr(self.client, "buffered", 0) >= self.backpressure_rows and not self.client.flush(
                timeout_s=self.flush_timeout_s
            ):
                raise SimulationError(
                    f"the collector did not take {self.backpressure_rows} rows within {self.flush_timeout_s} s "
                    f"(dropped={self.client.dropped}, failed_batches={self.client.failed_batches}); is "
                    "`livestep serve` running at that URL? (or write into the store with --direct)"
                )

    def close(self) -> None:
        if not self.client.flush(timeout_s=self.flush_timeout_s):
            raise SimulationError(
                f"the collector did not take every row within {self.flush_timeout_s} s "
                f"(dropped={self.client.dropped}, failed_batches={self.client.failed_batches}); is "
                "`livestep serve` running at that URL? (or write into the store with --direct)"
            )


def as_sink(target):
    """A Store, a TelemetryClient or a sink -> a sink."""
    if hasattr(target, "write") and hasattr(target, "close"):
        return target
    if hasattr(target, "insert_arrow"):
        return DirectSink(target)
    if hasattr(target, "put"):
        return ClientSink(target)
    raise SimulationError("target must be a Store (insert_arrow), a TelemetryClient (put) or a sink (write)")
