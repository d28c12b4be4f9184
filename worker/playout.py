"""The playout clock: the player consumes one chunk per period from a small buffer; a chunk delivered after
its due time is a stall, counted and never hidden."""

from __future__ import annotations


class Playout:
    """The player takes one chunk per period from a buffer; a chunk that arrives late is a stall.

    Playback starts once ``prebuffer`` chunks are in. Chunk k is due at start + k*period + the
    stalls so far; a chunk delivered after its due time stalls the player by the difference
    (counted in ``late_chunks`` / ``stall_s``, never hidden) and plays on arrival.
    """

    def __init__(self, period_s: float = 1 / 6, capacity: int = 4, prebuffer: int = 2):
        self.period_s, self.capacity, self.prebuffer = period_s, capacity, prebuffer
        self.start: float | None = None
        self.stall_s = 0.0
        self.late_chunks = 0
        self.delivered = 0
        self._pending_start: list[float] = []

    def started(self, t: float, upto: int) -> int:
        """Chunks whose playback has begun by time t (of the first ``upto``)."""
        if self.start is None or t < self.start:
            return 0
        return min(upto, int((t - self.start - self.stall_s) / self.period_s) + 1)

    def deliver(self, i: int, t: float) -> tuple[bool, int]:
        """Chunk i arrived at time t -> (late, chunks buffered for the player)."""
        assert i == self.delivered, (i, self.delivered)
        self.delivered += 1
        late = False
        if self.start is None:
            if self.delivered >= self.prebuffer:
                self.start = t
        else:
            due = self.start + i * self.period_s + self.stall_s
            if t > due:
                late = True
                self.late_chunks += 1
                self.stall_s += t - due
        return late, self.delivered - self.started(t, self.delivered)

    def room(self, i: int, t: float) -> bool:
        """May the producer start chunk i at time t without overfilling the buffer?"""
        return i - self.started(t, i) < self.capacity

    def wait_s(self, i: int, t: float) -> float:
        """Seconds until chunk i may start (0 if now)."""
        if self.room(i, t) or self.start is None:
            return 0.0
        k = i - self.capacity  # chunk whose playback must have begun
        return max(0.0, self.start + k * self.period_s + self.stall_s - t) + 1e-4

    @property
    def streamed_s(self) -> float:
        return self.delivered * self.period_s + self.stall_s

