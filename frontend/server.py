"""The public gRPC API: pagedserve.v1.Generation, with standard health and
reflection on the same port."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.common.messages import frontend as fe
from pagedserve.frontend.detokenizer import IncrementalDetokenizer
from pagedserve.frontend.engine_client import DuplicateRequestId, EngineClient
from pagedserve.frontend.validation import (
    Limits,
    UnimplementedError,
    ValidationError,
    check_prompt_ids,
    check_prompt_text,
    check_request_id,
    sampling_params,
)
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("pagedserve.frontend")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_ERROR_CODES = {"KV": grpc.StatusCode.RESOURCE_EXHAUSTED}


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, engine: EngineClient, tokenizer: Any, max_prompt_chars: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_prompt_chars = max_prompt_chars

    @property
    def info(self) -> fe.EngineInfo:
        assert self.engine.info is not None
        return self.engine.info

    @property
    def limits(self) -> Limits:
        info = self.info
        # Block 0 is the blockmgr's null block; a prompt needs room for one more token.
        kv_slots = (info.num_gpu_blocks - 1) * info.block_size
        return Limits(info.model.vocab_size, info.model.max_model_len, self.max_prompt_chars, kv_slots)

    async def _require_ready(self, context: grpc.aio.ServicerContext) -> None:
        if self.engine.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still starting")

    def _prepare(self, request: pb.GenerateRequest) -> tuple[str, list[int], Any]:
        check_request_id(request.request_id)
        check_prompt_text(request, self.limits)
        if request.WhichOneof("input") == "prompt":
            ids = list(self.tokenizer(request.prompt).input_ids)
            check_prompt_ids(ids, self.limits, "prompt")
        else:
            ids = list(request.prompt_token_ids.ids)
            check_prompt_ids(ids, self.limits, "prompt_token_ids")
        params = sampling_params(request.sampling_params, len(ids), self.limits)
        return request.request_id or uuid.uuid4().hex, ids, params

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        await self._require_ready(context)
        try:
            rid, ids, params = self._prepare(request)
        except ValidationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except UnimplementedError as e:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(e))
        try:
            queue = await self.engine.add_request(fe.AddRequest(rid, ids, params, time.time()))
        except DuplicateRequestId:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already running")
        detok = IncrementalDetokenizer(self.tokenizer, ids)
        completion = 0
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                finished = delta.finish_reason is not None
                if delta.error is not None:
                    code = next((c for k, c in _ERROR_CODES.items() if k in delta.error), grpc.StatusCode.INTERNAL)
                    await context.abort(code, delta.error)
                completion += len(delta.token_ids)
                out = pb.CompletionOutput(index=delta.index, token_ids=delta.token_ids,
                                          text=detok.add(delta.token_ids, final=finished),
                                          finish_reason=delta.finish_reason or "")
                resp = pb.GenerateResponse(request_id=rid, outputs=[out])
                if finished:
                    resp.usage.prompt_tokens = len(ids)
                    resp.usage.completion_tokens = completion
                yield resp
        finally:
            # Cancelled or disconnected clients land here unfinished: free everything.
            self.engine.release(rid, abort=not finished)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._require_ready(context)
        m = self.info.model
        return pb.ModelInfo(model_name=m.model_name, max_model_len=m.max_model_len,
                            block_size=self.info.block_size, vocab_size=m.vocab_size, eos_token_ids=m.eos_token_ids)

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.ServerInfo:
        await self._require_ready(context)
        try:
            s = await self.engine.stats()
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler did not answer")
        usage = 1.0 - s.num_free_gpu_blocks / s.num_gpu_blocks if s.num_gpu_blocks else 0.0
        return pb.ServerInfo(num_gpu_blocks=s.num_gpu_blocks, num_free_gpu_blocks=s.num_free_gpu_blocks,
                             num_cpu_blocks=s.num_cpu_blocks, num_free_cpu_blocks=s.num_free_cpu_blocks,
                             num_running=s.num_running, num_waiting=s.num_waiting, num_swapped=s.num_swapped,
                             kv_cache_usage=usage, prefix_cache_queries=s.prefix_cache_queries,
                             prefix_cache_hits=s.prefix_cache_hits, device=self.info.model.device,
                             max_num_seqs=self.info.max_num_seqs,
                             max_num_batched_tokens=self.info.max_num_batched_tokens)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        await self._require_ready(context)
        if len(request.request_ids) > 1024:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_ids: at most 1024 per call")
        for rid in request.request_ids:
            try:
                check_request_id(rid)
            except ValidationError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.AbortResponse(num_aborted=await self.engine.abort(list(request.request_ids)))


async def serve(engine: EngineClient, tokenizer: Any, host: str, port: int,
                max_prompt_chars: int, health_servicer: health.aio.HealthServicer) -> grpc.aio.Server:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    pb_grpc.add_GenerationServicer_to_server(
        GenerationServicer(engine, tokenizer, max_prompt_chars), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    return server


def health_status(serving: bool) -> Any:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
