"""Process lifecycle shared by every component's service module."""
from __future__ import annotations

import ctypes
import signal
from types import FrameType


def die_with_parent() -> None:
    """``preexec_fn`` of a child process: SIGTERM it when its parent dies
    (Linux PR_SET_PDEATHSIG), so no component outlives ``serve``."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class StopFlag:
    """Set by SIGTERM or SIGINT; service loops poll it and then clean up
    (close sockets, remove ipc files) instead of dying mid-reply. ``count``:
    how many signals came (``serve`` hurries its drain on the second)."""

    def __init__(self) -> None:
        self.count = 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1

    def __bool__(self) -> bool:
        return self.count > 0
