"""The public gRPC API: pagedserve.v1.Generation, with standard health and
reflection on the same port, optional TLS and bearer-token auth."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.frontend.core.error_table import ENGINE_ERRORS, REJECTIONS, retry_trailers
from pagedserve.frontend.core.auth import ApiKeys, AuthInterceptor, metadata_value
from pagedserve.frontend.core.engine_client import DuplicateRequestId, EngineUnavailable
from pagedserve.frontend.grpc_api.grpc_decode import add_servicer
from pagedserve.frontend.core.generation import EngineError, GenerationService, Rejected, RequestStream
from pagedserve.frontend.core.outputs import Chunk, Logprob
from pagedserve.frontend.core.validation import (
    MAX_ABORT_IDS,
    MAX_REQUEST_BYTES,
    ValidationError,
    check_request_id,
    check_text,
    check_token_ids,
)
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("pagedserve.frontend")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# gRPC's own hard limit sits above ours so an oversized request gets our
# INVALID_ARGUMENT naming the bound; beyond this gRPC answers RESOURCE_EXHAUSTED.
GRPC_MAX_MESSAGE_BYTES = 2 * MAX_REQUEST_BYTES
# grpc core holds calls the Python server has not picked up yet; past 1,000
# (soft) / 3,000 (hard) such pending calls it cancels new ones with a bare
# CANCELLED that never reaches a handler (16-24 % of a 3,000-request burst).
# Raised so every call reaches admission control, which refuses the excess
# with RESOURCE_EXHAUSTED and counts it; beyond this many grpc still cancels.
MAX_PENDING_CALLS = 100_000
MAX_DETOKENIZE_IDS = 1_000_000




def logprob_pb(token_id: int, entry: Logprob) -> pb.TokenLogprob:
    lp, top = entry
    return pb.TokenLogprob(token_id=token_id, logprob=lp,
                           top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


def chunk_pb(c: Chunk) -> pb.CompletionOutput:
    out = pb.CompletionOutput(index=c.index, token_ids=c.token_ids, text=c.text,
                              finish_reason=c.finish_reason or "", replace=c.replace,
                              stop_reason=c.stop_reason or "",
                              logprobs=[logprob_pb(t, e) for t, e in c.logprobs])
    if c.cumulative_logprob is not None:
        out.cumulative_logprob = c.cumulative_logprob
    return out


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, svc: GenerationService, keys: ApiKeys | None = None) -> None:
        self.svc = svc
        self.keys = keys or ApiKeys([])

    async def _require_ready(self, context: grpc.aio.ServicerContext) -> None:
        if not self.svc.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still starting",
                                retry_trailers(grpc.StatusCode.UNAVAILABLE))

    def _key_id(self, context: grpc.aio.ServicerContext) -> str | None:
        if not self.keys.enabled:
            return None
        return self.keys.identify(metadata_value(context.invocation_metadata(), "authorization"))

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        await self._require_ready(context)
        try:
            req = await self.svc.prepare_async(request)
        except ValidationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            stream = await self.svc.open(req, self._key_id(context))
        except Rejected as e:
            await context.abort(REJECTIONS[e.reason].grpc_code, str(e), retry_trailers(REJECTIONS[e.reason].grpc_code))
        except DuplicateRequestId:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {req.request_id!r} is already running")
        try:
            async for resp in self._responses(stream):
                yield resp
        except EngineError as e:
            await context.abort(ENGINE_ERRORS[e.kind].grpc_code, str(e))
        finally:
            # Cancelled, timed-out or disconnected clients land here unfinished: free everything.
            stream.close()

    async def _responses(self, stream: RequestStream) -> AsyncIterator[pb.GenerateResponse]:
        first = True
        while (chunks := await stream.next()) is not None:
            resp = pb.GenerateResponse(request_id=stream.request_id, outputs=[chunk_pb(c) for c in chunks])
            if first and stream.prompt_logprobs:
                ids = stream.req.prompt_ids[1:]
                resp.prompt_logprobs.extend(logprob_pb(t, e) for t, e in zip(ids, stream.prompt_logprobs))
                first = False
            if stream.done:
                resp.usage.prompt_tokens = len(stream.req.prompt_ids)
                resp.usage.completion_tokens = stream.num_completion_tokens
            if resp.outputs or stream.done:
                yield resp

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        await self._require_ready(context)
        try:
            check_text(request.text, self.svc.limits, "text")
        except ValidationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = await self.svc.off_loop(len(request.text), self.svc.tokenize, request.text, add)
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        await self._require_ready(context)
        try:
            if len(request.token_ids) > MAX_DETOKENIZE_IDS:
                raise ValidationError("token_ids", f"at most {MAX_DETOKENIZE_IDS} ids")
            check_token_ids(request.token_ids, self.svc.limits, "token_ids")
        except ValidationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        ids = list(request.token_ids)
        return pb.DetokenizeResponse(text=await self.svc.off_loop(len(ids), self.svc.detokenize, ids, skip))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._require_ready(context)
        info = self.svc.info
        m = info.model
        return pb.ModelInfo(model_name=m.model_name, max_model_len=m.max_model_len,
                            block_size=info.block_size, vocab_size=m.vocab_size, eos_token_ids=m.eos_token_ids)

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.ServerInfo:
        await self._require_ready(context)
        try:
            s = await self.svc.engine.stats()
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler did not answer")
        except EngineUnavailable as e:  # at once, while unhealthy or recovering
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        info, cfg = self.svc.info, self.svc.cfg
        usage = s.kv_usage
        return pb.ServerInfo(num_gpu_blocks=s.num_gpu_blocks, num_free_gpu_blocks=s.num_free_gpu_blocks,
                             num_cpu_blocks=s.num_cpu_blocks, num_free_cpu_blocks=s.num_free_cpu_blocks,
                             num_running=s.num_running, num_waiting=s.num_waiting, num_swapped=s.num_swapped,
                             kv_cache_usage=usage, prefix_cache_queries=s.prefix_cache_queries,
                             prefix_cache_hits=s.prefix_cache_hits, device=info.model.device,
                             max_num_seqs=info.max_num_seqs, max_num_batched_tokens=info.max_num_batched_tokens,
                             model_name=info.model.model_name, max_model_len=info.model.max_model_len,
                             block_size=info.block_size, num_preemptions=s.num_preemptions,
                             max_queued_requests=cfg.max_queued_requests, max_n=cfg.max_n,
                             max_beam_width=cfg.max_beam_width, num_requests_in_flight=self.svc.engine.num_streams,
                             auth_enabled=cfg.auth_enabled, tls_enabled=cfg.tls_enabled,
                             num_queued_requests=self.svc.num_queued, degraded=self.svc.engine.degraded,
                             step_running_seconds=s.step_running_s)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        await self._require_ready(context)
        try:
            if len(request.request_ids) > MAX_ABORT_IDS:
                raise ValidationError("request_ids", f"at most {MAX_ABORT_IDS} per call")
            for rid in request.request_ids:
                check_request_id(rid, "request_ids")
        except ValidationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.AbortResponse(num_aborted=await self.svc.engine.abort(list(request.request_ids)))


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    with open(cert_file, "rb") as c, open(key_file, "rb") as k:
        return grpc.ssl_server_credentials([(k.read(), c.read())])


async def serve(svc: GenerationService, host: str, port: int, health_servicer: health.aio.HealthServicer,
                keys: ApiKeys | None = None, credentials: grpc.ServerCredentials | None = None) -> grpc.aio.Server:
    interceptors = [AuthInterceptor(keys)] if keys is not None and keys.enabled else []
    server = grpc.aio.server(interceptors=interceptors,
                             options=[("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
                                      ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                                      ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
                                      # Not gRPC's default SO_REUSEPORT: a second server on a taken port
                                      # must fail to bind, not share the port with the first.
                                      ("grpc.so_reuseport", 0)])
    add_servicer(GenerationServicer(svc, keys), server)  # parses requests itself: INVALID_ARGUMENT
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    addr = f"{host}:{port}"
    bound = server.add_secure_port(addr, credentials) if credentials else server.add_insecure_port(addr)
    if bound == 0:
        raise OSError(f"cannot bind {addr}")
    await server.start()
    return server


def health_status(serving: bool) -> Any:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
