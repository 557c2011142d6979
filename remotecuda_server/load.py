"""How busy each GPU of a gateway has been lately, from its workers' reports.

Each session's worker reports cumulative figures to the supervisor (internal.STATS, at most
every 0.25 s while they change): ``busy_s``, the seconds its executor has spent running
messages (the running one included), ``run_s``, those of finished messages, and ``ops``.
The supervisor adds each report's increase to its GPU's ``GpuLoad`` and samples the sums
every maintenance tick (0.5 s); a GPU's utilization is then the busy seconds added over the
last ``WINDOW`` seconds as a fraction of the window (0 to 1), and its latency the mean time
per op over it.
What the scheduler and ``remotecuda servers`` read comes from here (STATUS, beacons).
"""
from __future__ import annotations

from collections import deque

#: seconds over which utilization and op latency are measured
WINDOW = 3.0


class GpuLoad:
    def __init__(self, now: float):
        self.busy = self.run = 0.0
        self.ops = 0
        self.samples: deque[tuple[float, float, float, int]] = deque([(now, 0.0, 0.0, 0)])  # (t, busy, run, ops)
        self.latency_ms = 0.0  # the last measured mean op time (0 until an op has run)

    def report(self, before: dict, after: dict) -> None:
        """A worker's new cumulative figures (``before``: its previous report, {} for its first)."""
        self.busy += max(0.0, after.get("busy_s", 0.0) - before.get("busy_s", 0.0))
        self.run += max(0.0, after.get("run_s", 0.0) - before.get("run_s", 0.0))
        self.ops += max(0, after.get("ops", 0) - before.get("ops", 0))

    def sample(self, now: float) -> None:
        self.samples.append((now, self.busy, self.run, self.ops))
        while len(self.samples) > 2 and now - self.samples[1][0] >= WINDOW:
            self.samples.popleft()

    def utilization(self, now: float) -> float:
        """The fraction of the window the GPU's workers were running ops (two at once count once)."""
        t0, busy0, _, _ = self.samples[0]
        span = now - t0
        return 0.0 if span <= 0 else round(min(1.0, (self.busy - busy0) / span), 3)

    def latency(self) -> float:
        """Mean execution time of the window's ops, in ms (the last known when none ran, or when
        those that ran are too brief to measure: a closing session's frees would read as a GPU of
        no latency, which the latency-optimized strategy would then prefer)."""
        _, _, run0, ops0 = self.samples[0]
        if self.ops > ops0:
            mean = round((self.run - run0) / (self.ops - ops0) * 1000.0, 4)
            self.latency_ms = mean or self.latency_ms
        return self.latency_ms
