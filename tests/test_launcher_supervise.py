"""serve's supervision loop (issue 11): a child that exits is started again
after a delay that doubles while it keeps crashing; nothing restarts once
stopping."""
from __future__ import annotations

import subprocess
import sys
import time

from pagedserve import launcher


def test_a_crashing_child_is_restarted_with_a_doubling_delay() -> None:
    starts: dict[str, list[float]] = {"a": [], "b": []}

    def start(name: str) -> subprocess.Popen[bytes]:
        starts[name].append(time.monotonic())
        code = "pass" if name == "a" else "import time; time.sleep(60)"  # a: exits at once; b: lives
        return subprocess.Popen([sys.executable, "-c", code])

    procs = {n: start(n) for n in ("a", "b")}
    t0 = time.monotonic()
    try:
        launcher.supervise(procs, start, lambda: time.monotonic() - t0 > 3.0, poll_s=0.01)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    a = starts["a"]
    gaps = [y - x for x, y in zip(a, a[1:])]  # each: the delay plus the child's short life
    assert len(gaps) >= 3, gaps
    assert gaps[0] >= launcher.RESTART_BACKOFF_S[0]
    # Delays 0.2, 0.4, 0.8 s: each gap grows by the previous delay (0.2 s, then 0.4 s).
    assert gaps[1] - gaps[0] > 0.1 and gaps[2] - gaps[1] > 0.25, gaps
    assert len(starts["b"]) == 1  # the live one is left alone
