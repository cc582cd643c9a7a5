"""frontend <-> scheduler.

The frontend pushes requests; the scheduler pushes one ``Outputs`` batch per
step with the new tokens of every request that produced any.
"""
from __future__ import annotations

import enum

import msgspec

from pagedserve.common.blocks import kv_usage, usable_gpu_blocks
from pagedserve.common.messages.types import ModelInfo, SamplingParams


class FinishReason(str, enum.Enum):
    """Why an output ended, on the wire as its value (msgpack: the string)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class ErrorKind(enum.IntEnum):
    """Why the engine failed a request; the frontend maps it to a status code
    (frontend/core/error_table.py, ENGINE_ERRORS: gRPC, HTTP and OpenAI type) instead of reading the message."""

    INTERNAL = 0
    KV_CACHE = 1  # the request can never fit in the KV pool
    UNAVAILABLE = 2  # the engine is gone, restarting or shutting down
    INVALID_REQUEST = 3  # a field the scheduler refuses (scheduler/admission.check_add)
    DATA_LOSS = 4  # outputs were lost on the way (a gap in Outputs.seq): the stream cannot be complete


class AddRequest(msgspec.Struct, tag=50, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    # A resumed request (the frontend re-sends it to a restarted scheduler):
    # the prompt's last ``num_output_tokens`` are output already streamed, so
    # max_tokens, min_tokens and penalties count them as output.
    num_output_tokens: int = 0
    resume: bool = False  # a request id already known here is this request: ignore the copy


class AbortRequest(msgspec.Struct, tag=51, array_like=True):
    request_ids: list[str]


class InfoQuery(msgspec.Struct, tag=52, array_like=True):
    """Asks for an ``EngineInfo`` (answered once the engine is ready)."""

    query_id: int


class StatsQuery(msgspec.Struct, tag=53, array_like=True):
    query_id: int


Request = AddRequest | AbortRequest | InfoQuery | StatsQuery


class TokenDelta(msgspec.Struct, array_like=True):
    request_id: str
    index: int  # which of the request's n outputs
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    error: str | None = None
    # One entry per token in token_ids when params.logprobs is set:
    # (logprob of the token, top-k (token, logprob)).
    logprobs: list[tuple[float, list[tuple[int, float]]]] = []
    # Sent once, with the first delta, when params.prompt_logprobs is set
    # (the first prompt token has no logprob and is left out).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = []
    # Beam search sends each final beam whole: token_ids then replace, not extend.
    replace: bool = False
    cumulative_logprob: float | None = None
    # On a request's first delta: seconds from arrival to its first scheduled step.
    queue_time_s: float | None = None
    error_kind: ErrorKind = ErrorKind.INTERNAL  # read only when ``error`` is set
    # Per-request figures for the frontend's vllm:* histograms. With queue_time_s
    # (the request's first delta): prompt tokens its first admission found in the
    # prefix cache. On a finishing delta: times the request was preempted.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Per prompt_logprobs entry: the token's vocabulary rank (empty: not known). Last, as the
    # struct is array_like: a field appended keeps every earlier position on the wire.
    prompt_logprob_ranks: list[int] = []


class Outputs(msgspec.Struct, tag=60, array_like=True):
    deltas: list[TokenDelta]
    # Numbered on the wire (scheduler/frontend_link.py): ``epoch`` names the
    # scheduler process, ``seq`` counts its Outputs from 0. A gap means frames
    # were lost or taken by another reader, and the frontend ends the open
    # streams with DATA_LOSS instead of a silently short output.
    epoch: int = 0
    seq: int = 0


class EngineInfo(msgspec.Struct, tag=61, array_like=True):
    query_id: int
    model: ModelInfo
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def num_usable_gpu_blocks(self) -> int:
        return usable_gpu_blocks(self.num_gpu_blocks)


class EngineStats(msgspec.Struct, tag=62, array_like=True):
    query_id: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    # True while the scheduler re-initialises a restarted blockmgr/gpuworker
    # (health NOT_SERVING; open streams resume afterwards); block counts are 0.
    recovering: bool = False
    # Seconds the step now running has taken so far (0 between steps): a live
    # but slow engine (an overloaded machine, a stopped worker) is waited for,
    # up to --step-timeout, and the frontend reports it as degraded.
    step_running_s: float = 0.0
    # Outputs.epoch, and how many Outputs were sent before this reply (stamped
    # by the scheduler's link): the frontend finds a lost last frame by it.
    epoch: int = 0
    outputs_sent: int = 0
    # Of num_waiting, those waiting for their grammar to compile, not for room
    # (vLLM's "deferred" waiting reason; the rest wait for capacity).
    num_waiting_deferred: int = 0

    @property
    def kv_usage(self) -> float:
        return kv_usage(self.num_free_gpu_blocks, self.num_gpu_blocks)


Reply = Outputs | EngineInfo | EngineStats
