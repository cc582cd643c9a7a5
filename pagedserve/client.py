"""``pagedserve generate``: a small gRPC client that streams text to the terminal,
and ``GenerationClient``, the Python client it is built on."""
from __future__ import annotations

import argparse
import sys
from typing import Iterator

import grpc

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc


class GenerationClient:
    def __init__(self, addr: str = "127.0.0.1:50051") -> None:
        self.channel = grpc.insecure_channel(addr)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "GenerationClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(self, prompt: str | list[int], timeout: float | None = None,
               **sampling: object) -> Iterator[pb.GenerateResponse]:
        req = pb.GenerateRequest(sampling_params=pb.SamplingParams(**sampling))  # type: ignore[arg-type]
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_token_ids.ids.extend(prompt)
        return self.stub.Generate(req, timeout=timeout)

    def generate(self, prompt: str | list[int], timeout: float | None = None,
                 **sampling: object) -> tuple[list[int], str, str]:
        """Token ids, text and finish reason of output 0."""
        ids: list[int] = []
        text, reason = [], ""
        for resp in self.stream(prompt, timeout, **sampling):
            for out in resp.outputs:
                ids += out.token_ids
                text.append(out.text)
                reason = out.finish_reason or reason
        return ids, "".join(text), reason

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest())

    def server_info(self) -> pb.ServerInfo:
        return self.stub.GetServerInfo(pb.GetServerInfoRequest())


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pagedserve generate")
    p.add_argument("prompt")
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)
    sampling: dict[str, object] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        sampling["seed"] = args.seed
    with GenerationClient(args.addr) as client:
        try:
            for resp in client.stream(args.prompt, **sampling):
                for out in resp.outputs:
                    sys.stdout.write(out.text)
                    sys.stdout.flush()
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    return 0
