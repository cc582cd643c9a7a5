"""Grammars compiled off the step path (issue 19), as vLLM compiles them in a
thread pool while the request waits (WAITING_FOR_FSM).

The scheduler asks for a spec (``ExecuteStep.compile``) before it schedules
the request; ``start`` hands it to one compile thread (xgrammar releases the
GIL while it compiles, so the forward keeps running beside it), and
``finished`` reports, in a later step's result, each spec that is ready or
that failed. A compile that runs past ``COMPILE_TIMEOUT_S`` is reported failed
(its thread cannot be stopped; the frontend's cost bounds keep that rare). The
compiled grammar joins ``StructuredDecoding``'s cache only on the step loop's
thread, so the cache has one writer."""
from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Any, Callable

from pagedserve.common.messages.types import StructuredSpec
from pagedserve.common.messages.worker import GrammarStatus

COMPILE_TIMEOUT_S = 60.0
IDLE_WAIT_S = 0.05  # an empty step (only waiting for compiles) waits this long for one to end


class AsyncCompiles:
    """``compiler()`` (step-loop thread) returns the xgrammar compiler, or
    raises when this worker cannot compile; ``compile_fn(compiler, spec)`` runs
    on the compile thread; ``cached(spec)`` says whether the cache has it;
    ``keep(spec, compiled)`` puts it there (step-loop thread)."""

    def __init__(self, compiler: Callable[[], Any], compile_fn: Callable[[Any, StructuredSpec], Any],
                 cached: Callable[[StructuredSpec], bool], keep: Callable[[StructuredSpec, Any], None]) -> None:
        self._compiler = compiler
        self._compile = compile_fn
        self._cached = cached
        self._keep = keep
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pending: dict[StructuredSpec, tuple[cf.Future[Any], float]] = {}
        self._done: list[GrammarStatus] = []

    def start(self, specs: list[StructuredSpec]) -> None:
        for spec in specs:
            if spec in self._pending:
                continue
            if self._cached(spec):
                self._done.append(GrammarStatus(spec))
                continue
            try:  # built here, once: the compile thread only uses it
                compiler = self._compiler()
            except Exception as e:  # noqa: BLE001 - e.g. no tokenizer: the request fails, not the step
                self._done.append(GrammarStatus(spec, str(e)[:300]))
                continue
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
            self._pending[spec] = (self._pool.submit(self._compile, compiler, spec), time.monotonic())

    def finished(self, wait_s: float = 0.0) -> list[GrammarStatus]:
        """What ended since the last call; waits up to ``wait_s`` for a first one."""
        if wait_s > 0 and self._pending and not self._done:
            cf.wait([f for f, _ in self._pending.values()], timeout=wait_s, return_when=cf.FIRST_COMPLETED)
        now = time.monotonic()
        for spec, (fut, t0) in list(self._pending.items()):
            if fut.done():
                del self._pending[spec]
                self._done.append(self._settle(spec, fut))
            elif now - t0 > COMPILE_TIMEOUT_S:
                del self._pending[spec]  # the thread finishes it for nobody
                self._done.append(GrammarStatus(spec, f"compiling the grammar took longer than {COMPILE_TIMEOUT_S:g}s"))
        out, self._done = self._done, []
        return out

    def settle(self, spec: StructuredSpec) -> None:
        """A sequence needs ``spec`` now (a NewSeq): wait for its compile if one runs."""
        entry = self._pending.pop(spec, None)
        if entry is not None:
            self._done.append(self._settle(spec, entry[0]))

    def _settle(self, spec: StructuredSpec, fut: cf.Future[Any]) -> GrammarStatus:
        try:
            self._keep(spec, fut.result())
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError; the request fails
            return GrammarStatus(spec, str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__)
        return GrammarStatus(spec)

    def clear(self) -> None:
        """A reset worker: answers owed to the old scheduler are dropped."""
        self._pending.clear()
        self._done = []
