"""Registers the Generation servicer with request bytes parsed by us.

With the generated ``add_GenerationServicer_to_server`` grpc parses each
request itself, and bytes that are not the protobuf fail as UNKNOWN with
a Python class name in the message. Here every method takes raw bytes
(no ``request_deserializer``) and parses them in the handler, so a request
that does not parse ends with INVALID_ARGUMENT naming the expected message.

``sampling_values`` decodes a request's ``SamplingParams`` into the table's
given values (common/request_fields.py), which ``validation.validate`` checks
exactly as it checks the HTTP gateway's.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from pagedserve.common.request_fields import SAMPLING
from pagedserve.v1 import generation_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"]


def sampling_values(sp: pb.SamplingParams) -> dict[str, Any]:
    """The fields the client set: an optional one when present, a plain proto3
    scalar or list when not its zero value (which is also the table's default)."""
    out: dict[str, Any] = {}
    for name in SAMPLING:
        fd = sp.DESCRIPTOR.fields_by_name.get(name)
        if fd is None:  # an HTTP-only field
            continue
        value = getattr(sp, name)
        if fd.has_presence:  # optional scalars (repeated and map fields have none)
            if sp.HasField(name):
                out[name] = value
        elif value:
            out[name] = dict(value) if hasattr(value, "items") else \
                value if isinstance(value, (bool, int, float, str)) else list(value)
    if sp.HasField("structured_outputs"):
        out["structured_outputs"] = sp.structured_outputs
    return out


async def parse(cls: type[Message], raw: bytes, context: grpc.aio.ServicerContext) -> Any:
    try:
        return cls.FromString(raw)
    except DecodeError:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request: {len(raw)} bytes that do not parse as {cls.DESCRIPTOR.full_name}")


def _unary(impl: Callable[[Any, Any], Awaitable[Any]], cls: type[Message]) -> Any:
    async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await impl(await parse(cls, raw, context), context)
    return handler


def _stream(impl: Callable[[Any, Any], AsyncIterator[Any]], cls: type[Message]) -> Any:
    async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for resp in impl(await parse(cls, raw, context), context):
            yield resp
    return handler


def add_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for m in SERVICE.methods:
        req_cls, resp_cls = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)
        impl = getattr(servicer, m.name)
        if m.client_streaming:
            raise TypeError(f"{m.name}: client streaming is not supported here")
        if m.server_streaming:
            handlers[m.name] = grpc.unary_stream_rpc_method_handler(
                _stream(impl, req_cls), response_serializer=resp_cls.SerializeToString)
        else:
            handlers[m.name] = grpc.unary_unary_rpc_method_handler(
                _unary(impl, req_cls), response_serializer=resp_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
