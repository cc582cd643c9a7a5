"""The picker's HTTP front (pagedserve/kvpicker.py): every request goes unchanged (method,
path, query, headers with Authorization, body) to the chosen pod's own OpenAI server, and its
response comes back byte for byte (status, headers less the hop-by-hop ones, body; a stream
chunk by chunk as the pod flushes it; no decompression). The picker reads only what routing
needs: the prompt of /v1/completions, or the messages of /v1/chat/completions through the
model's chat template (with the request's tools), tokenized with the model's tokenizer. A body
it cannot read is routed by load and the pod answers it. A pod that refuses the connection
before answering is replaced by another. Its own route: GET /picker/state (JSON).

    python -m pagedserve.kvpicker_proxy --port 8080 --policy kv \\
        --pod pagedserve-0=http://10.89.0.2:8000,tcp://10.89.0.2:5560,tcp://10.89.0.2:5561 --pod ...
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

import aiohttp
from aiohttp import web

from pagedserve.common.routing_prompt import routing_token_ids
from pagedserve.kvpicker import EventReader, Picker, Pod, block_hashes

log = logging.getLogger("pagedserve.kvpicker")
MAX_BODY_BYTES = 32 << 20  # the engine's own bound on a body
MAX_PODS = 64
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
STATE_PATH = "/picker/state"
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
                        "transfer-encoding", "upgrade", "host", "proxy-connection"})


class PromptHasher:
    """A request body -> its prompt's block hashes, as the pods' blockmgrs publish them."""

    def __init__(self, tokenizer: Any, block_size: int, seed: str) -> None:
        self.tok, self.block_size, self.seed = tokenizer, block_size, seed

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        return routing_token_ids(self.tok, path, body)

    def hashes(self, path: str, raw: bytes) -> list[int]:
        if path not in ROUTED_PATHS or not raw:
            return []
        try:
            body = json.loads(raw)
            ids = self.token_ids(path, body) if isinstance(body, dict) else None
        except Exception:  # noqa: BLE001 - a body or template the pod will judge; route it by load
            return []
        return block_hashes(ids, self.block_size, self.seed) if ids else []


def parse_pod(spec: str) -> Pod:
    """NAME=HTTP_URL[,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]]"""
    name, sep, rest = spec.partition("=")
    parts = rest.split(",")
    if not sep or not name or not 1 <= len(parts) <= 3 or not parts[0].startswith(("http://", "https://")) \
            or any(not p.startswith("tcp://") for p in parts[1:]):
        raise argparse.ArgumentTypeError(f"--pod {spec!r}: NAME=http://HOST:PORT[,tcp://HOST:PORT[,tcp://HOST:PORT]]")
    return Pod(name, parts[0].rstrip("/"), *(parts[1:] + [None, None])[:2])  # type: ignore[arg-type]


def make_app(picker: Picker, hasher: PromptHasher | None) -> web.Application:
    session: dict[str, aiohttp.ClientSession] = {}

    async def start(app: web.Application) -> None:
        session["s"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                             connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def stop(app: web.Application) -> None:
        await session["s"].close()

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.method == "GET" and request.path == STATE_PATH:
            return web.json_response(picker.state())
        raw = await request.read()
        hashes = await asyncio.to_thread(hasher.hashes, request.path, raw) if hasher and request.method == "POST" \
            else []
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP | {"content-length"}}
        refused: set[str] = set()
        while True:
            choice = picker.choose(hashes, frozenset(refused))
            pod = choice.pod
            pod.in_flight += 1
            try:
                async with session["s"].request(request.method, pod.http + request.path_qs, headers=headers,
                                                data=raw, allow_redirects=False) as up:
                    resp = web.StreamResponse(status=up.status, reason=up.reason)
                    for k, v in up.headers.items():
                        if k.lower() not in HOP_BY_HOP:
                            resp.headers.add(k, v)
                    resp.headers["x-picker-pod"] = pod.name  # which pod answered (the benchmark counts them)
                    await resp.prepare(request)
                    async for chunk in up.content.iter_any():
                        await resp.write(chunk)
                    await resp.write_eof()
                    return resp
            except aiohttp.ClientConnectorError as e:  # the pod refused before answering: another one
                log.warning("pod %s refused the connection: %s", pod.name, e)
                refused.add(pod.name)
                if len(refused) >= len(picker.pods):
                    body = {"error": {"message": "no pod accepted the request", "type": "service_unavailable",
                                      "param": None, "code": None}}
                    return web.json_response(body, status=503)
            finally:
                pod.in_flight -= 1

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedserve.kvpicker_proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pod", type=parse_pod, action="append", required=True,
                    help="NAME=http://HOST:8000[,tcp://HOST:5560[,tcp://HOST:5561]] (repeat per pod)")
    ap.add_argument("--policy", choices=["kv", "round-robin"], default="kv")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--model", default=None, help="the pods' model folder (its tokenizer; default: the embedded)")
    ap.add_argument("--block-size", type=int, default=16, help="the pods' PAGEDSERVE_BLOCK_SIZE")
    ap.add_argument("--hash-seed", default="42", help="the pods' PYTHONHASHSEED (vLLM's default: vllm-none-hash)")
    ap.add_argument("--imbalance", type=int, default=8, help="in-flight requests over the least loaded pod past "
                    "which a prefix hit goes to the least loaded instead")
    args = ap.parse_args(argv)
    if not 1 <= len(args.pod) <= MAX_PODS or len({p.name for p in args.pod}) != len(args.pod):
        ap.error(f"--pod: 1 to {MAX_PODS} pods with distinct names")
    if not 1 <= args.block_size <= 1024 or not 0 <= args.imbalance <= 1_000_000 or not 0 < args.port < 65536:
        ap.error("--block-size 1-1024, --imbalance 0-1000000, --port 1-65535")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kvpicker %(levelname)s %(message)s")
    from transformers import AutoTokenizer

    from pagedserve.common.default_model import resolve_model

    hasher = PromptHasher(AutoTokenizer.from_pretrained(resolve_model(args.model)), args.block_size, args.hash_seed)
    picker = Picker(args.pod, args.policy, args.imbalance)
    reader = EventReader(args.pod)
    log.info("picking among %s (%s) on http://%s:%d", ", ".join(p.name for p in args.pod), args.policy, args.host,
             args.port)
    try:
        web.run_app(make_app(picker, hasher), host=args.host, port=args.port, print=None, access_log=None)
    finally:
        reader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
