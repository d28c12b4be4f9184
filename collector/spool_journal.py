"""The writer's journal (``writer.log``): which spooled range is in the store, and which is on its way.

    journal = Journal(dir)                 # reads what a previous process left
    journal.committed, journal.intent, journal.split     # the range pinned for replay, if any
    journal.log_intent(a, b); ...insert...; journal.log_commit(b)

Lines: ``intent a b`` before a block insert, ``split a b <kinds>`` before the block goes in batch by
batch (the kinds already stored whole, or ``-``), ``commit b`` after it. A replay after a crash
re-forms exactly the logged block, the same way, so its deduplication tokens match. Every line is
fsync'd before the step it announces; a torn last line never completed and is ignored. The file is
compacted at start and every ``COMPACT_LINES`` lines.
"""

from __future__ import annotations

import os
from pathlib import Path

from collector.spool_storage import write_durable

COMPACT_LINES = 10_000


def _split_line(first: int, last: int, stored: frozenset[str]) -> str:
    return f"split {first} {last} {','.join(sorted(stored)) or '-'}\n"


class Journal:
    """``writer.log`` of one spool directory. Used by one writer thread at a time."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / "writer.log"
        self.committed, self.intent, self.split = self._read()
        self._compact()

    def _read(self) -> tuple[int, tuple[int, int] | None, frozenset[str] | None]:
        committed, intent, split = 0, None, None
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                parts = line.split()
                try:
                    if parts[0] == "commit" and len(parts) == 2:
                        committed = max(committed, int(parts[1]))
                    elif parts[0] == "intent" and len(parts) == 3:
                        intent, split = (int(parts[1]), int(parts[2])), None
                    elif parts[0] == "split" and len(parts) == 4 and (int(parts[1]), int(parts[2])) == intent:
                        split = frozenset(k for k in parts[3].split(",") if k != "-")
                except (ValueError, IndexError):
                    continue  # a torn last line: the intent/commit it held never completed
        if intent is not None and intent[1] <= committed:
            intent, split = None, None
        return committed, intent, split

    def _compact(self) -> None:
        text = f"commit {self.committed}\n"
        if self.intent:
            text += f"intent {self.intent[0]} {self.intent[1]}\n"
            if self.split is not None:
                text += _split_line(*self.intent, self.split)
        write_durable(self.path, text.encode())
        self._f = open(self.path, "ab")  # noqa: SIM115 (held open: appended per block)
        self._lines = 2

    def _log(self, line: str) -> None:
        self._f.write(line.encode())
        self._f.flush()
        os.fsync(self._f.fileno())
        self._lines += 1

    def log_intent(self, first: int, last: int) -> None:
        self._log(f"intent {first} {last}\n")
        self.intent, self.split = (first, last), None

    def log_split(self, first: int, last: int, stored: frozenset[str]) -> None:
        self._log(_split_line(first, last, stored))
        self.split = frozenset(stored)

    def log_commit(self, last: int) -> None:
        self._log(f"commit {last}\n")
        self.committed = last
        self.intent, self.split = None, None
        if self._lines > COMPACT_LINES:
            self._f.close()
            self._compact()

    def close(self) -> None:
        self._f.close()
