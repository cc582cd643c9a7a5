"""The scheduler's control loop: the frontend's inbox, served between steps
and, while a step waits on the worker or the blockmgr, every ipc.POLL_MS
(issue 19). A slow step (an overloaded machine, a stopped worker, a costly
grammar) must not look like a dead scheduler: stats and info queries are
answered at once from what the scheduler already knows, and requests and
aborts are kept, in arrival order, for the loop to apply after the step."""
from __future__ import annotations

import logging
from collections import deque

from pagedserve.common import ipc
from pagedserve.common.messages import frontend as fe
from pagedserve.scheduler.admission import check_add
from pagedserve.scheduler.engine import ComponentError, EngineCore
from pagedserve.scheduler.frontend_link import FrontendLink

log = logging.getLogger("pagedserve.scheduler")


def handle(core: EngineCore, msg: fe.Request) -> fe.Reply | None:
    """A well-typed message the scheduler cannot apply (a bad field value,
    a duplicate id) is dropped like an undecodable frame; losing a component
    (ComponentError) still ends the loop."""
    if isinstance(msg, fe.AddRequest) and (why := check_add(msg, core.ready.model)) is not None:
        ipc.note_dropped("scheduler_in", ValueError(f"AddRequest {msg.request_id[:64]!r} refused: {why}"))
        return fe.Outputs([fe.TokenDelta(msg.request_id, 0, [], fe.FinishReason.ERROR, len(msg.prompt_token_ids),
                                         f"invalid request: {why}", error_kind=fe.ErrorKind.INVALID_REQUEST)])
    try:
        return core.handle(msg)
    except ComponentError:
        raise
    except Exception as e:  # noqa: BLE001 - one bad request must not end the server
        ipc.note_dropped("scheduler_in", e)
        return None


def abort_all(core: EngineCore) -> None:
    """The frontend went away: its clients are gone, so are their requests."""
    sch = core.scheduler
    if sch.groups:
        log.warning("the frontend disconnected: aborting its %d requests", len(sch.groups))
        sch.abort(list(sch.groups))
    sch.take_deltas()  # for streams nobody reads any more


class Control:
    """Owns the order in which the frontend's messages reach the engine."""

    def __init__(self, inbox: ipc.PullQueue[fe.Request], link: FrontendLink) -> None:
        self.inbox = inbox
        self.link = link
        self.core: EngineCore | None = None  # set once the engine is ready
        self._kept: deque[fe.Request] = deque()  # arrived during a step, applied after it

    def while_waiting(self) -> None:
        """Runs inside a component call. Only during a step or a recovery: a
        stats call of our own between steps must not start another call."""
        core = self.core
        if core is None or not core.in_step:
            return
        while (msg := self.inbox.get_nowait()) is not None:
            if isinstance(msg, fe.StatsQuery):
                self.link.put(core.stats(msg.query_id))
            elif isinstance(msg, fe.InfoQuery):
                self.link.put(core.info(msg.query_id))
            else:
                self._kept.append(msg)

    def has_input(self, timeout_ms: int) -> bool:
        return bool(self._kept) or self.inbox.poll(timeout_ms)

    def drain(self) -> None:
        """Applies what was kept during the last step, then what is waiting."""
        core = self.core
        assert core is not None
        if self.link.lost():
            abort_all(core)
        while (msg := self._kept.popleft() if self._kept else self.inbox.get_nowait()) is not None:
            reply = handle(core, msg)
            if reply is not None:
                self.link.put(reply)
