"""Requests whose grammar is still compiling: vLLM's WAITING_FOR_FSM (issue 19).

Compiling a grammar (xgrammar) can take seconds; inside a step it froze every
other stream. So a request with a structured-output spec the worker has not
compiled yet waits here, not in the scheduler's queue: the next ExecuteStep
asks the worker to compile the spec (``ExecuteStep.compile``; the worker
compiles on a thread of its own, off the step path) and a later StepResult
says it is ready or why it failed (``StepResult.grammars``). Meanwhile the
batch runs without it. When nothing else runs, the steps that carry the asks
and bring the answers are empty ones (the worker waits briefly for a compile
to end, which paces them). The worker keeps the last ``GRAMMAR_CACHE_SIZE``
compiled grammars; ``ready`` mirrors that set (LRU of the same size), so a spec
counted ready is compiled there, except after a worker restart (``reset``)."""
from __future__ import annotations

from collections import OrderedDict

from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.types import StructuredSpec
from pagedserve.scheduler.sequence import SequenceGroup


class GrammarGate:
    def __init__(self) -> None:
        self._ready: OrderedDict[StructuredSpec, None] = OrderedDict()  # mirrors the worker's cache
        self._asked: set[StructuredSpec] = set()  # sent in a step, not answered yet
        self._to_ask: list[StructuredSpec] = []
        self.waiting: list[SequenceGroup] = []  # arrival order

    def admit(self, group: SequenceGroup) -> bool:
        """True: the group may queue for scheduling now. False: it waits here."""
        spec = group.params.structured
        if spec is None:
            return True
        if spec in self._ready:
            self._ready.move_to_end(spec)
            return True
        self._ask(spec)
        self.waiting.append(group)
        return False

    def _ask(self, spec: StructuredSpec) -> None:
        if spec not in self._asked:
            self._asked.add(spec)
            self._to_ask.append(spec)

    def take_asks(self) -> list[StructuredSpec]:
        asks, self._to_ask = self._to_ask, []
        return asks

    def unask(self, specs: list[StructuredSpec]) -> None:
        """A step that carried these failed: ask again with the next one."""
        for spec in specs:
            if spec in self._asked:
                self._to_ask.append(spec)

    def remove(self, group: SequenceGroup) -> bool:
        if group in self.waiting:
            self.waiting.remove(group)
            return True
        return False

    def on_compiled(self, statuses: list[wk.GrammarStatus]) -> tuple[list[SequenceGroup],
                                                                      list[tuple[SequenceGroup, str]]]:
        """The groups now ready to queue, and those whose grammar failed (with why)."""
        errors: dict[StructuredSpec, str] = {}
        for st in statuses:
            self._asked.discard(st.spec)
            if st.error is None:
                self._ready[st.spec] = None
                self._ready.move_to_end(st.spec)
                while len(self._ready) > wk.GRAMMAR_CACHE_SIZE:
                    self._ready.popitem(last=False)
            else:
                errors[st.spec] = st.error
        ready: list[SequenceGroup] = []
        failed: list[tuple[SequenceGroup, str]] = []
        still: list[SequenceGroup] = []
        for g in self.waiting:
            spec = g.params.structured
            if spec in errors:
                failed.append((g, errors[spec]))
            elif spec in self._ready:
                ready.append(g)
            else:
                still.append(g)
        self.waiting = still
        return ready, failed

    def reset(self) -> None:
        """The worker restarted: nothing is compiled there; ask again for what waits."""
        self._ready.clear()
        self._asked.clear()
        self._to_ask = []
        for g in self.waiting:
            if g.params.structured is not None:
                self._ask(g.params.structured)
