"""How long the worker sits idle between two steps while work continues: the
time from one step's reply to the next step's arrival, which scheduling on the
critical path costs (gaps over ``busy_gap_s`` are idle time with no work, not
scheduling, and are left out)."""
from __future__ import annotations

import time
from collections import deque


class StepGaps:
    def __init__(self, busy_gap_s: float = 0.5, keep: int = 8192) -> None:
        self.busy_gap_s = busy_gap_s
        self.gaps: deque[float] = deque(maxlen=keep)
        self.busy_s = 0.0  # time inside steps
        self._last_end: float | None = None
        self._start = 0.0

    def begin(self) -> None:
        self._start = time.perf_counter()
        if self._last_end is not None and (gap := self._start - self._last_end) < self.busy_gap_s:
            self.gaps.append(gap)

    def end(self) -> None:
        self._last_end = time.perf_counter()
        self.busy_s += self._last_end - self._start

    def summary(self) -> str:
        if not self.gaps:
            return "no consecutive steps"
        g = sorted(self.gaps)
        pct = lambda q: g[min(len(g) - 1, int(q * len(g)))] * 1000  # noqa: E731
        return (f"idle between consecutive steps: p50 {pct(0.5):.2f} ms, p99 {pct(0.99):.2f} ms, "
                f"{sum(g) / (sum(g) + self.busy_s) * 100:.1f} % of busy time, over {len(g)} gaps")
