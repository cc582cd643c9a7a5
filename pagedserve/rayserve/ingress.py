"""The OpenAI-compatible ingress: ``/v1/completions`` (a text or token-id
prompt) and ``/v1/chat/completions`` (the model's chat template), streaming
or not. It tokenizes, puts the prompt's block hashes in the request for the
router, and streams the chosen replica's tokens back.

A replica that dies mid-request loses nothing: the request is sent again,
to another replica (the router drops the dead one), with what was already
streamed appended to its prompt and its token budget reduced, so the client
sees one uninterrupted answer.

No ``from __future__ import annotations`` here: FastAPI reads the handlers'
annotations (a string ``Request`` would become a query parameter)."""
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from pagedserve.common.block_hash import prompt_block_hashes

log = logging.getLogger("ray.serve")
app = FastAPI()
MAX_ATTEMPTS = 4
MAX_TOKENS_BOUND = 32768
# Bounds on what the ingress itself tokenizes and hashes (the engine then applies its own, max-model-len)
MAX_PROMPT_TOKENS = 1 << 20
MAX_PROMPT_CHARS = 4_000_000
MAX_MESSAGES = 10_000
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "ignore_eos", "min_tokens")


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_TOKENS_BOUND:
        raise HTTPException(400, f"max_tokens must be an integer in [1, {MAX_TOKENS_BOUND}]")
    out = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
    out["max_tokens"] = max_tokens
    return out


@serve.deployment
@serve.ingress(app)
class Ingress:
    def __init__(self, replicas: DeploymentHandle, model: str | None, served_name: str, block_size: int) -> None:
        from transformers import AutoTokenizer

        from pagedserve.common.default_model import resolve_model

        self._replicas = replicas.options(stream=True)
        self._tok = AutoTokenizer.from_pretrained(resolve_model(model))
        self._name = served_name
        self._bs = block_size

    async def _stream(self, ids: list[int], sampling: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        got: list[int] = []
        budget = sampling["max_tokens"]
        for attempt in range(MAX_ATTEMPTS):
            prompt = ids + got
            req = {"prompt": prompt, "sampling": {**sampling, "max_tokens": budget - len(got)},
                   "block_hashes": prompt_block_hashes(prompt, self._bs)}
            try:
                async for chunk in self._replicas.generate.remote(req):
                    if "error" in chunk:  # refused by the engine (a bound): the client's error
                        raise HTTPException(chunk["status"], chunk["error"])
                    got += chunk["token_ids"]
                    if chunk.get("replica"):
                        chunk["resumed"] = attempt  # times this request moved to another replica
                    yield chunk
                return
            except RayActorError as e:  # the replica died: resume elsewhere with what it streamed
                log.warning("replica lost after %d tokens (attempt %d): %s", len(got), attempt + 1, e)
                if len(got) >= budget:
                    yield {"token_ids": [], "text": "", "finish_reason": "length"}
                    return
        raise HTTPException(503, "no replica could finish the request")

    async def _answer(self, ids: list[int], body: dict[str, Any], chat: bool) -> Any:
        sampling = _sampling(body)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        want_ids = bool(body.get("return_token_ids"))  # vLLM's extra: the output's token ids too

        def choice(text: str, finish: str | None, delta: bool, ids: list[int]) -> dict[str, Any]:
            if not chat:
                out: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            else:
                msg = {"role": "assistant", "content": text}
                out = {"index": 0, ("delta" if delta else "message"): msg, "finish_reason": finish}
            if want_ids:
                out["token_ids"] = ids
            return out

        if body.get("stream"):
            chunks = self._stream(ids, sampling)
            first = await anext(chunks)  # a refusal is an HTTP error here, before any 200 and stream

            async def both() -> AsyncIterator[dict[str, Any]]:
                yield first
                async for c in chunks:
                    yield c

            async def sse() -> AsyncIterator[str]:
                n = 0
                async for c in both():
                    n += len(c["token_ids"])
                    obj = {"id": rid, "object": kind + (".chunk" if chat else ""), "created": created,
                           "model": self._name, "choices": [choice(c["text"], c["finish_reason"], True, c["token_ids"])]}
                    if c.get("replica"):
                        obj["pagedserve"] = {"replica": c["replica"], "prefix_cache": c["prefix_cache"],
                                             "resumed": c["resumed"]}
                        obj["usage"] = {"prompt_tokens": len(ids), "completion_tokens": n,
                                        "total_tokens": len(ids) + n}
                    yield f"data: {json.dumps(obj)}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")
        text: list[str] = []
        out_ids: list[int] = []
        finish, extra = "stop", {}
        async for c in self._stream(ids, sampling):
            text.append(c["text"])
            out_ids += c["token_ids"]
            finish = c["finish_reason"] or finish
            if c.get("replica"):
                extra = {"replica": c["replica"], "prefix_cache": c["prefix_cache"], "resumed": c["resumed"]}
        return JSONResponse({"id": rid, "object": kind, "created": created, "model": self._name,
                             "choices": [choice("".join(text), finish, False, out_ids)], "pagedserve": extra,
                             "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out_ids),
                                       "total_tokens": len(ids) + len(out_ids)}})

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        body = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and 0 < len(prompt) <= MAX_PROMPT_TOKENS and \
                all(isinstance(t, int) and 0 <= t < 2**31 for t in prompt):
            ids = prompt
        elif isinstance(prompt, str) and 0 < len(prompt) <= MAX_PROMPT_CHARS:
            ids = self._tok.encode(prompt)
        else:
            raise HTTPException(400, f"prompt must be a string of 1 to {MAX_PROMPT_CHARS} characters or a list "
                                     f"of 1 to {MAX_PROMPT_TOKENS} token ids")
        return await self._answer(ids, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Any:
        body = await request.json()
        messages = body.get("messages")
        if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES or \
                sum(len(str(m)) for m in messages) > MAX_PROMPT_CHARS:
            raise HTTPException(400, f"messages must be a list of 1 to {MAX_MESSAGES} messages, at most "
                                     f"{MAX_PROMPT_CHARS} characters in all")
        ids = list(self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
        return await self._answer(ids, body, chat=True)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self._name, "object": "model", "owned_by": "pagedserve"}]}
