"""The engine path shared by the gRPC API and the HTTP gateway: validate,
admit (bounded queue, per-key concurrency), submit, and turn engine deltas
into client chunks while recording metrics.

Admission: a request counts as *queued* from the moment it is admitted until
the engine reports on it (its first token, or its end). At most
``max_queued_requests`` may be queued; one more is refused at once with
``Rejected`` (RESOURCE_EXHAUSTED / HTTP 429) instead of joining a backlog
that only grows. With auth on, each API key may hold at most
``max_concurrent_per_key`` open streams.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from pagedserve.common.messages import frontend as fe
from pagedserve.common.metrics import FrontendMetrics, RequestTimes
from pagedserve.frontend.core.error_table import RejectReason
from pagedserve.frontend.core.chat_template import has_chat_template, render_chat
from pagedserve.frontend.core.engine_client import EngineClient, EngineUnavailable, Item
from pagedserve.frontend.core.outputs import Chunk, Logprob, OutputState, merge_into
from pagedserve.frontend.core.prompt_bound import max_chars_per_token
from pagedserve.frontend.core.prompt_options import InputOptions, prepared_sampling, truncation
from pagedserve.frontend.core.validation import (
    Limits,
    Prepared,
    ValidationError,
    check_cache_salt,
    check_prompt_ids,
    check_prompt_text,
    check_request_id,
    check_request_size,
)
from pagedserve.v1 import generation_pb2 as pb


BIG_INPUT = 1 << 16  # bytes of request (or ids to detokenize) that go to the big-input thread


def _lower_priority() -> None:
    try:  # Linux schedules threads one by one: this lowers the calling thread only
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + 10)
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True)
class FrontendConfig:
    max_prompt_chars: int = 1_000_000
    max_stop_ids: int = 64
    max_n: int = 16
    max_beam_width: int = 8
    max_queued_requests: int = 1024
    max_concurrent_per_key: int = 64
    auth_enabled: bool = False
    tls_enabled: bool = False


class Rejected(Exception):
    """Refused before reaching the engine; ``reason`` is a metrics label."""

    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EngineError(Exception):
    """The engine failed the request (``message`` is the scheduler's, ``kind`` picks the status)."""

    def __init__(self, message: str, kind: fe.ErrorKind = fe.ErrorKind.INTERNAL) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_ids: list[int]
    prep: Prepared
    cache_salt: str | None


class Admission:
    """Admission control's counts, with one owner: requests admitted without a
    first token yet (bounded by max_queued_requests) and open streams per API
    key (max_concurrent_per_key). A ``RequestStream`` enters once and leaves once."""

    def __init__(self) -> None:
        self.num_queued = 0
        self.per_key: dict[str, int] = {}

    def enter(self, key_id: str | None) -> None:
        self.num_queued += 1
        if key_id is not None:
            self.per_key[key_id] = self.per_key.get(key_id, 0) + 1

    def leave_queue(self) -> None:
        self.num_queued -= 1

    def leave(self, key_id: str | None) -> None:
        if key_id is not None:
            left = self.per_key[key_id] - 1
            if left:
                self.per_key[key_id] = left
            else:
                del self.per_key[key_id]


class GenerationService:
    def __init__(self, engine: EngineClient, tokenizer: Any, cfg: FrontendConfig,
                 metrics: FrontendMetrics | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.metrics = metrics
        self.admission = Admission()
        # Tokenizing a 1 MB prompt takes ~1 s; off the event loop (HF fast
        # tokenizers release the GIL) other streams keep flowing. Big texts get
        # a thread of their own so they do not hold up small requests; both
        # only encode/decode (never change truncation or padding), which a fast
        # tokenizer allows from two threads at once.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        # Big inputs are background work: that thread runs at a lower CPU priority (nice +10).
        self._big_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer-big",
                                            initializer=_lower_priority)
        self._chars_per_token = max_chars_per_token(tokenizer)

    @property
    def info(self) -> fe.EngineInfo:
        assert self.engine.info is not None
        return self.engine.info

    @property
    def ready(self) -> bool:
        return self.engine.info is not None

    @property
    def limits(self) -> Limits:
        info = self.info
        kv_slots = info.num_usable_gpu_blocks * info.block_size
        return Limits(info.model.vocab_size, info.model.max_model_len, self.cfg.max_prompt_chars, kv_slots,
                      self.cfg.max_n, self.cfg.max_beam_width, self.cfg.max_stop_ids)

    def tokenize(self, text: str, add_special_tokens: bool = True, max_len: int | None = None,
                 field: str = "prompt") -> list[int]:
        """With ``max_len``, a text of at least that many tokens raises ``ValidationError``
        (for big texts before the ids become a Python list: ~30 ms of GIL per 400k ids)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if len(text) > BIG_INPUT and hasattr(backend, "encode_batch_fast"):
            # The same ids without offsets: half the time, and the GIL held ~4x shorter.
            enc = backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
            if max_len is not None and len(enc) >= max_len:
                raise ValidationError(field, f"{len(enc)} tokens leaves no room to generate within "
                                             f"max_model_len={max_len}")
            return enc.ids  # type: ignore[no-any-return]
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                         clean_up_tokenization_spaces=False))

    def _check_chars(self, text: str, limits: Limits, field: str) -> None:
        """Refuses, untokenized, a text too long to fit max_model_len tokens (see prompt_bound)."""
        per = self._chars_per_token
        if per is not None and len(text) > limits.max_model_len * per:
            raise ValidationError(field, f"{len(text)} characters are more than max_model_len="
                                            f"{limits.max_model_len} tokens can hold")

    async def off_loop(self, size: int, fn: Any, *args: Any) -> Any:
        """Runs ``fn(*args)`` on a tokenizer thread (by ``size``, bytes or ids); exceptions propagate."""
        pool = self._big_pool if size > BIG_INPUT else self._pool
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def prepare_async(self, request: pb.GenerateRequest, add_special_tokens: bool = True,
                            options: InputOptions | None = None) -> PreparedRequest:
        """``prepare`` on a tokenizer thread (size bounds are checked before tokenizing)."""
        return await self.off_loop(request.ByteSize(), self.prepare, request,  # type: ignore[no-any-return]
                                   add_special_tokens, options)

    def prepare(self, request: pb.GenerateRequest, add_special_tokens: bool = True,
                options: InputOptions | None = None) -> PreparedRequest:
        """Validates every field; raises ``ValidationError``. ``options`` (HTTP) replaces
        ``add_special_tokens``, adds truncation and carries the body's sampling fields."""
        opt = options or InputOptions(add_special_tokens=add_special_tokens)
        limits = self.limits
        check_request_size(request)
        check_request_id(request.request_id)
        check_cache_salt(request.cache_salt)
        check_prompt_text(request, limits)
        truncate = truncation(opt, limits)
        # A prompt that will be truncated may be longer than the model takes.
        max_len = limits.max_model_len if truncate is None else None
        which = request.WhichOneof("input")
        if which == "prompt":
            if truncate is None:
                self._check_chars(request.prompt, limits, "prompt")
            ids = self.tokenize(request.prompt, opt.add_special_tokens, max_len, "prompt")
        elif which == "messages":
            if not has_chat_template(self.tokenizer):
                raise ValidationError("messages", "this model has no chat template; send a prompt")
            conv = [{"role": m.role, "content": m.content} for m in request.messages.messages]
            text = render_chat(self.tokenizer, conv)
            self._check_chars(text, limits, "messages")
            # The template already wrote the special tokens it wants.
            ids = self.tokenize(text, False, limits.max_model_len, "messages")
        else:
            ids = list(request.prompt_token_ids.ids)
        if truncate is not None and len(ids) > truncate:
            ids = (ids[len(ids) - truncate:] if truncate else []) if opt.truncate_left else ids[:truncate]
        check_prompt_ids(ids, limits, which if which in ("prompt", "messages") else "prompt_token_ids")
        prep = prepared_sampling(request.sampling_params, opt, len(ids), limits)
        if not (opt.skip_special_tokens and opt.spaces_between_special_tokens):
            prep = replace(prep, skip_special_tokens=opt.skip_special_tokens,
                           spaces_between_special_tokens=opt.spaces_between_special_tokens)
        # Prompt logprobs need every prompt position computed: the scheduler asks
        # the blockmgr to skip the prefix lookup for them (Allocate.skip_prefix_lookup).
        return PreparedRequest(request.request_id or uuid.uuid4().hex, ids, prep, request.cache_salt or None)

    def reject(self, reason: RejectReason, message: str) -> Rejected:
        if self.metrics:
            self.metrics.request_rejected.labels(reason.value).inc()
        return Rejected(reason, message)

    async def open(self, req: PreparedRequest, key_id: str | None = None) -> "RequestStream":
        """Admit and submit; raises ``Rejected``."""
        if not self.engine.accepting:
            raise self.reject(RejectReason.UNAVAILABLE, "the engine is unavailable")
        if self.admission.num_queued >= self.cfg.max_queued_requests:
            raise self.reject(RejectReason.QUEUE_FULL, f"server busy: {self.admission.num_queued} requests queued "
                                            f"(max_queued_requests={self.cfg.max_queued_requests})")
        if key_id is not None and self.admission.per_key.get(key_id, 0) >= self.cfg.max_concurrent_per_key:
            raise self.reject(RejectReason.KEY_CONCURRENCY, f"this API key already has {self.admission.per_key[key_id]} requests in "
                                                 f"flight (max_concurrent_per_key={self.cfg.max_concurrent_per_key})")
        stream = RequestStream(self, req, key_id)
        stream.admit()  # before the await: concurrent opens must see this one
        try:
            stream.queue = await self.engine.add_request(
                fe.AddRequest(req.request_id, req.prompt_ids, req.prep.params, time.time(), req.cache_salt))
        except BaseException as e:
            stream.unadmit()
            if isinstance(e, EngineUnavailable):
                raise self.reject(RejectReason.UNAVAILABLE, str(e)) from e
            raise
        return stream

    @property
    def num_queued(self) -> int:
        return self.admission.num_queued


class RequestStream:
    """One admitted request: ``await next()`` returns the chunks new since
    the last call (every delta already waiting is folded in, so a slow
    client gets fewer, larger messages), or None once every output finished.
    ``close()`` must run (finally): it aborts the request if unfinished."""

    def __init__(self, svc: GenerationService, req: PreparedRequest, key_id: str | None) -> None:
        self.svc = svc
        self.req = req
        self.key_id = key_id
        self.queue: asyncio.Queue[Item] | None = None
        self.n = req.prep.params.n
        self.outputs: dict[int, OutputState] = {}
        self.prompt_logprobs: list[Logprob] | None = None
        self.prompt_logprob_ranks: list[int] = []  # per prompt_logprobs entry; empty: not known (an older peer)
        self.arrival = time.monotonic()
        self.times = RequestTimes(self.arrival)  # for the per-request metrics at its end
        self._last_token_at: dict[int, float] = {}
        self._queued = False
        self._admitted = False
        self.done = False
        self.finish_reason: str | None = None

    @property
    def request_id(self) -> str:
        return self.req.request_id

    def admit(self) -> None:
        self._admitted = self._queued = True
        self.svc.admission.enter(self.key_id)

    def unadmit(self) -> None:
        """Undo ``admit`` for a request the engine never got."""
        self._admitted = False
        self._dequeue()
        self.svc.admission.leave(self.key_id)

    def _dequeue(self) -> None:
        if self._queued:
            self._queued = False
            self.svc.admission.leave_queue()

    @property
    def num_completion_tokens(self) -> int:
        return sum(o.num_tokens for o in self.outputs.values())

    async def next(self) -> list[Chunk] | None:
        if self.done:
            return None
        assert self.queue is not None
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        merged: dict[int, Chunk] = {}
        m = self.svc.metrics
        for t, d in items:
            self._dequeue()
            if d.error is not None:
                self.done = True
                self.finish_reason = "error"
                if m:
                    m.request_success.labels("error").inc()
                raise EngineError(d.error, d.error_kind)
            if d.prompt_logprobs and self.prompt_logprobs is None:
                self.prompt_logprobs = list(d.prompt_logprobs)
                self.prompt_logprob_ranks = list(d.prompt_logprob_ranks)
            if d.queue_time_s is not None:
                self.times.queue_time_s, self.times.num_cached_tokens = d.queue_time_s, d.num_cached_tokens
            self.times.num_preemptions = max(self.times.num_preemptions, d.num_preemptions)
            st = self.outputs.get(d.index)
            if st is None:
                p = self.req.prep
                st = self.outputs[d.index] = OutputState(d.index, self.svc.tokenizer if p.detokenize else None,
                                                         self.req.prompt_ids, p.stop, p.include_stop_str_in_output,
                                                         p.params.logprobs is not None, p.skip_special_tokens,
                                                         p.spaces_between_special_tokens)
            if d.token_ids and not st.finished:
                if self.times.on_tokens(t, d.index, len(d.token_ids), d.replace) and m:
                    m.first_token(self.times, len(self.req.prompt_ids))
                if m:
                    m.generation_tokens.inc(len(d.token_ids))
                    last = self._last_token_at.get(d.index)
                    if last is not None and not d.replace:
                        m.itl.observe(t - last)
                self._last_token_at[d.index] = t
            chunk = st.on_delta(d)
            if chunk is not None:
                merge_into(merged, chunk)
                if chunk.finish_reason is not None:
                    self.finish_reason = chunk.finish_reason
        if sum(o.finished for o in self.outputs.values()) >= self.n:
            self.done = True
            if m:
                m.finished(self.times, time.monotonic(), len(self.req.prompt_ids), self.n,
                           self.req.prep.params.max_tokens, self.finish_reason or "stop",
                           self.svc.info.model.max_model_len)
        return sorted(merged.values(), key=lambda c: c.index)

    async def collect(self) -> dict[int, Chunk]:
        """Every chunk to the end, merged per index (non-streaming answers)."""
        merged: dict[int, Chunk] = {}
        while (chunks := await self.next()) is not None:
            for c in chunks:
                merge_into(merged, c)
        return merged

    def close(self) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._dequeue()
        self.svc.admission.leave(self.key_id)
        # Outputs ended by a stop string are finished for the client, not for the engine.
        engine_busy = not self.done or any(o.stopped_by_string for o in self.outputs.values())
        if not self.done and self.svc.metrics:
            self.svc.metrics.request_success.labels("abort").inc()
        # An error may be the frontend's own (a lost engine, a broken stream):
        # abort then too, so nothing runs for nobody (unknown ids are ignored).
        self.svc.engine.release(self.request_id, abort=engine_busy or self.finish_reason == "error")
