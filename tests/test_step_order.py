"""A step's calls in their one order (scheduler/carry.py): the pure scheduler
refuses them out of order, a result of another step, and a second result."""
from __future__ import annotations

import pytest

from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import worker as wk
from pagedserve.scheduler.plan import StepOrderError, StepPhase
from test_scheduler import add, make_engine


def _settled(core, blocks):  # type: ignore[no-untyped-def]
    sch = core.scheduler
    plan = sch.schedule()
    assert plan is not None and plan.phase is StepPhase.BLOCKS
    reply = blocks.call(plan.request)
    assert isinstance(reply, bm.StepReply)
    assert sch.on_block_reply(plan, reply) is None
    assert plan.phase is StepPhase.SETTLED
    return plan


def test_build_before_the_blockmgr_answered_is_refused() -> None:
    core, _, _ = make_engine(num_gpu_blocks=32)
    add(core, "a", [1, 2, 3], 2)
    plan = core.scheduler.schedule()
    assert plan is not None
    with pytest.raises(StepOrderError, match="build_execute"):
        core.scheduler.build_execute(plan)


def test_a_result_must_carry_the_step_id_of_the_plan_in_flight() -> None:
    core, worker, blocks = make_engine(num_gpu_blocks=32)
    add(core, "a", [1, 2, 3], 2)
    sch = core.scheduler
    plan = _settled(core, blocks)
    step = sch.build_execute(plan)
    assert step is not None and plan.phase is StepPhase.SENT and sch.carry.in_flight is plan
    result = worker.call(step)
    assert isinstance(result, wk.StepResult)
    with pytest.raises(StepOrderError, match="result of step"):
        sch.on_step_result(plan, wk.StepResult(step.step_id + 1, result.sampled))
    deltas = sch.on_step_result(plan, result)
    assert plan.phase is StepPhase.APPLIED and sch.carry.in_flight is None
    assert [d.token_ids for d in deltas if d.request_id == "a"] == [[t.token_id for t in result.sampled]]
    with pytest.raises(StepOrderError, match="on_step_result"):
        sch.on_step_result(plan, result)  # applied twice


def test_the_next_step_waits_for_the_one_in_flight() -> None:
    core, _, blocks = make_engine(num_gpu_blocks=32)
    add(core, "a", [1, 2, 3], 3)
    sch = core.scheduler
    first = _settled(core, blocks)
    assert sch.build_execute(first) is not None
    second = _settled(core, blocks)  # planned while the first runs (async scheduling)
    with pytest.raises(StepOrderError, match="in flight"):
        sch.build_execute(second)


def test_recovery_clears_what_a_step_carries() -> None:
    core, _, blocks = make_engine(num_gpu_blocks=32)
    add(core, "a", [1, 2, 3], 2)
    sch = core.scheduler
    plan = _settled(core, blocks)
    assert sch.build_execute(plan) is not None
    sch.carry.drops.append(99)
    assert sch.requeue_all() == 1
    assert not sch.carry and sch.carry.in_flight is None
    assert [g.request_id for g in sch.waiting] == ["a"]
