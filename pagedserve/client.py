"""Python clients for pagedserve's gRPC API, and ``pagedserve generate``.

``GenerationClient`` is blocking, ``AsyncGenerationClient`` uses grpc.aio;
both take the same options: ``api_key`` (sent as ``authorization: Bearer``),
``tls`` (True for the system roots, or a PEM bytes/path of a CA to trust).

    with GenerationClient("127.0.0.1:50051") as c:
        ids, text, reason = c.generate("Hello", max_tokens=16, temperature=0.0)
        for resp in c.stream("Hello", max_tokens=16, stop=["\\n"]):
            print(resp.outputs[0].text, end="")
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Iterator

import grpc

from pagedserve.common.env import env
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

Result = tuple[list[int], str, str]  # token ids, text, finish reason
# Text, token ids, or a conversation ({"role": ..., "content": ...} dicts) that
# the server renders with the model's chat template.
Prompt = str | list[int] | list[dict[str, str]]


def build_request(prompt: Prompt, request_id: str = "", cache_salt: str = "",
                  **sampling: Any) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id, cache_salt=cache_salt,
                             sampling_params=pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        req.prompt = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"])
                                     for m in prompt)  # type: ignore[index]
    else:
        req.prompt_token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    return req


def _channel_args(tls: bool | bytes | str | None) -> grpc.ChannelCredentials | None:
    if not tls:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    if isinstance(tls, str):
        with open(tls, "rb") as f:
            tls = f.read()
    return grpc.ssl_channel_credentials(root_certificates=tls)


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


class Collector:
    """Folds streamed responses into per-output (ids, text, finish reason)."""

    def __init__(self) -> None:
        self.outputs: dict[int, list[Any]] = {}
        self.usage: pb.Usage | None = None

    def add(self, resp: pb.GenerateResponse) -> None:
        for out in resp.outputs:
            acc = self.outputs.setdefault(out.index, [[], [], ""])
            if out.replace:
                acc[0], acc[1] = [], []
            acc[0] += out.token_ids
            acc[1].append(out.text)
            acc[2] = out.finish_reason or acc[2]
        if resp.HasField("usage"):
            self.usage = resp.usage

    def result(self, index: int = 0) -> Result:
        ids, text, reason = self.outputs.get(index, [[], [], ""])
        return list(ids), "".join(text), reason

    def results(self) -> list[Result]:
        return [self.result(i) for i in sorted(self.outputs)]


class GenerationClient:
    def __init__(self, addr: str = "127.0.0.1:50051", api_key: str | None = None,
                 tls: bool | bytes | str | None = None, options: list[tuple[str, Any]] | None = None) -> None:
        creds = _channel_args(tls)
        self.channel = grpc.secure_channel(addr, creds, options) if creds else grpc.insecure_channel(addr, options)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = _metadata(api_key)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "GenerationClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(self, prompt: Prompt, timeout: float | None = None, request_id: str = "",
               cache_salt: str = "", **sampling: Any) -> Iterator[pb.GenerateResponse]:
        """The response stream (call ``.cancel()`` on it to stop early)."""
        return self.stub.Generate(build_request(prompt, request_id, cache_salt, **sampling), timeout=timeout,
                                  metadata=self.metadata)

    def generate_all(self, prompt: Prompt, timeout: float | None = None, **sampling: Any) -> Collector:
        col = Collector()
        for resp in self.stream(prompt, timeout, **sampling):
            col.add(resp)
        return col

    def generate(self, prompt: Prompt, timeout: float | None = None, **sampling: Any) -> Result:
        """Token ids, text and finish reason of output 0."""
        return self.generate_all(prompt, timeout, **sampling).result(0)

    def abort(self, *request_ids: str) -> int:
        return self.stub.Abort(pb.AbortRequest(request_ids=request_ids), metadata=self.metadata).num_aborted

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        req = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self.stub.Tokenize(req, metadata=self.metadata).token_ids)

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        req = pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip_special_tokens)
        return self.stub.Detokenize(req, metadata=self.metadata).text

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)

    def server_info(self) -> pb.ServerInfo:
        return self.stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=self.metadata)


class AsyncGenerationClient:
    """The same surface on grpc.aio; use inside a running event loop."""

    def __init__(self, addr: str = "127.0.0.1:50051", api_key: str | None = None,
                 tls: bool | bytes | str | None = None, options: list[tuple[str, Any]] | None = None) -> None:
        creds = _channel_args(tls)
        self.channel = grpc.aio.secure_channel(addr, creds, options) if creds else \
            grpc.aio.insecure_channel(addr, options)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = _metadata(api_key)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncGenerationClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def stream(self, prompt: Prompt, timeout: float | None = None, request_id: str = "",
               cache_salt: str = "", **sampling: Any) -> Any:
        """An async iterator of responses (a grpc.aio call: ``.cancel()`` stops it)."""
        return self.stub.Generate(build_request(prompt, request_id, cache_salt, **sampling), timeout=timeout,
                                  metadata=self.metadata)

    async def generate_all(self, prompt: Prompt, timeout: float | None = None,
                           **sampling: Any) -> Collector:
        col = Collector()
        async for resp in self.stream(prompt, timeout, **sampling):
            col.add(resp)
        return col

    async def generate(self, prompt: Prompt, timeout: float | None = None, **sampling: Any) -> Result:
        return (await self.generate_all(prompt, timeout, **sampling)).result(0)

    async def abort(self, *request_ids: str) -> int:
        return (await self.stub.Abort(pb.AbortRequest(request_ids=request_ids), metadata=self.metadata)).num_aborted

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        req = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list((await self.stub.Tokenize(req, metadata=self.metadata)).token_ids)

    async def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        req = pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip_special_tokens)
        return (await self.stub.Detokenize(req, metadata=self.metadata)).text

    async def model_info(self) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)

    async def server_info(self) -> pb.ServerInfo:
        return await self.stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=self.metadata)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pagedserve generate")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="send PROMPT as a user message (the model's chat template)")
    p.add_argument("--system", default=None, help="with --chat: a system message first")
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--api-key", default=env("API_KEY"))
    p.add_argument("--tls-ca", default=None, help="PEM of a CA to trust: connect over TLS")
    args = p.parse_args(argv)
    sampling: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    for k in ("seed", "top_p", "top_k"):
        if getattr(args, k) is not None:
            sampling[k] = getattr(args, k)
    if args.stop:
        sampling["stop"] = args.stop
    with GenerationClient(args.addr, api_key=args.api_key, tls=args.tls_ca) as client:
        try:
            prompt: Prompt = args.prompt
            if args.chat:
                prompt = ([{"role": "system", "content": args.system}] if args.system else []) + \
                    [{"role": "user", "content": args.prompt}]
            for resp in client.stream(prompt, **sampling):
                for out in resp.outputs:
                    sys.stdout.write(out.text)
                    sys.stdout.flush()
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    return 0

