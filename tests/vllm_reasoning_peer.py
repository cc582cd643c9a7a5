"""Run by the peer venv's Python (vLLM 0.32): vLLM's own reasoning parsers
(with a tool parser after them) over a corpus read as JSON on stdin; prints
what they answer as JSON (tests/test_reasoning_parsers.py).

stdin: [{"reasoning": NAME or null, "tools": NAME or null, "tokenizer": folder or null (harmony: its own encoding),
         "prompt": [ids], "cases": [{"text": ..., "streams": [[chunk text, ...], ...]}]}, ...]
stdout: one list per job: [{"whole": [reasoning, content, [[name, arguments], ...]],
                            "streams": [[reasoning, content, [[name, arguments], ...]], ...]}, ...]
A stream's values are its deltas joined. Token ids: the tokenizer's encoding of each chunk."""
from __future__ import annotations

import json
import logging
import sys
from typing import Any

logging.disable(logging.CRITICAL)


class HarmonyTok:
    """What HarmonyParser reads of a tokenizer: decode (its recovery of unfinished output)."""

    def __init__(self, enc: Any) -> None:
        self.enc = enc

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def get_vocab(self) -> dict[str, int]:
        return {}


def main() -> None:
    json.dump([run(job) for job in json.load(sys.stdin)], sys.stdout)


def run(job: dict) -> list:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    harmony = job["reasoning"] == "openai_gptoss" or job["tools"] == "openai"
    if harmony:
        from vllm.entrypoints.openai.parser.harmony_utils import get_encoding
        tok: Any = HarmonyTok(get_encoding())
        encode = tok.encode
    else:
        from transformers import PreTrainedTokenizerFast
        tok = PreTrainedTokenizerFast.from_pretrained(job["tokenizer"])

        def encode(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    fields: dict[str, Any] = {"tools": tools, "tool_choice": "auto"} if job["tools"] else {}
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)
    cls = ParserManager.get_parser(tool_parser_name=job["tools"], reasoning_parser_name=job["reasoning"],
                                   enable_auto_tools=True, is_harmony=harmony)
    kwargs = {} if harmony else {"chat_template_kwargs": {"enable_thinking": True}}

    def make() -> Any:
        return cls(tok, req.tools, **kwargs)

    out = []
    for case in job["cases"]:
        reasoning, content, calls = make().parse(case["text"], req, enable_auto_tools=True,
                                                 model_output_token_ids=encode(case["text"]))
        streams = []
        for chunks in case["streams"]:
            p = make()
            acc: dict[str, Any] = {"reasoning": "", "content": "", "names": {}, "args": {}}
            for i, ch in enumerate(chunks):
                m = p.parse_delta(ch, encode(ch), req, prompt_token_ids=job["prompt"],
                                  finished=i == len(chunks) - 1)
                if m is None:
                    continue
                acc["reasoning"] += m.reasoning or ""
                acc["content"] += m.content or ""
                for tc in m.tool_calls or []:
                    if tc.function and tc.function.name:
                        acc["names"][tc.index] = tc.function.name
                    if tc.function and tc.function.arguments:
                        acc["args"][tc.index] = acc["args"].get(tc.index, "") + tc.function.arguments
            streams.append([acc["reasoning"], acc["content"],
                            [[acc["names"][i], acc["args"].get(i, "")] for i in sorted(acc["names"])]])
        out.append({"whole": [reasoning, content, [[c.name, c.arguments] for c in calls or []]],
                    "streams": streams})
    return out


if __name__ == "__main__":
    main()
