"""``bench vllm-diff``'s invalid requests: both engines must answer each with
the same HTTP status (the message text is theirs)."""
from __future__ import annotations

from benchmarks.vllm_diff_corpus import CHAT, CMPL, STATUS, Case, g, user
from benchmarks.vllm_diff_tools import TOOLS


def invalid_cases() -> list[Case]:
    p, m = "Hello", user("Hi")

    def bad(name: str, route: str, body: dict[str, object]) -> Case:
        return Case("bad-" + name, "invalid", route, body, STATUS)

    big = "word " * 3000  # over --max-model-len 2048
    return [
        bad("temperature-type", CMPL, {"prompt": p, "max_tokens": 4, "temperature": "hot"}),
        bad("temperature-negative", CHAT, {"messages": m, "max_tokens": 4, "temperature": -1}),
        bad("temperature-over-2", CMPL, {"prompt": p, "max_tokens": 4, "temperature": 2.5}),
        bad("top-p-zero", CMPL, g(prompt=p, max_tokens=4, top_p=0)),
        bad("top-p-over-1", CHAT, g(messages=m, max_tokens=4, top_p=1.5)),
        bad("max-tokens-negative", CMPL, g(prompt=p, max_tokens=-1)),
        bad("max-tokens-string", CHAT, g(messages=m, max_tokens="10")),
        bad("max-tokens-zero", CHAT, g(messages=m, max_tokens=0)),
        bad("n-greedy", CMPL, g(prompt=p, max_tokens=4, n=2)),
        bad("logprobs-21", CMPL, g(prompt=p, max_tokens=4, logprobs=21)),
        bad("top-logprobs-21", CHAT, g(messages=m, max_tokens=4, logprobs=True, top_logprobs=21)),
        bad("prompt-logprobs-21", CMPL, g(prompt=p, max_tokens=4, prompt_logprobs=21)),
        bad("unknown-model", CMPL, g(model="no-such-model", prompt=p, max_tokens=4)),
        bad("empty-messages", CHAT, g(messages=[], max_tokens=4)),
        bad("no-messages", CHAT, g(max_tokens=4)),
        bad("no-prompt", CMPL, g(max_tokens=4)),
        bad("messages-not-list", CHAT, g(messages="hi", max_tokens=4)),
        bad("bad-role", CHAT, g(messages=[{"role": "robot", "content": "hi"}], max_tokens=4)),
        bad("stop-token-ids-type", CMPL, g(prompt=p, max_tokens=4, stop_token_ids=["x"])),
        bad("logit-bias-key", CMPL, g(prompt=p, max_tokens=4, logit_bias={"abc": 1})),
        bad("presence-over-2", CHAT, g(messages=m, max_tokens=4, presence_penalty=3)),
        bad("repetition-zero", CMPL, g(prompt=p, max_tokens=4, repetition_penalty=0)),
        bad("top-k-minus2", CMPL, g(prompt=p, max_tokens=4, top_k=-2)),
        bad("min-tokens-over-max", CMPL, g(prompt=p, max_tokens=4, min_tokens=8)),
        bad("prompt-too-long", CMPL, g(prompt=big, max_tokens=4)),
        bad("response-format-xml", CHAT, g(messages=m, max_tokens=4, response_format={"type": "xml"})),
        bad("tool-choice-unknown", CHAT, g(messages=m, max_tokens=4, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "nope"}})),
        bad("tool-choice-no-tools", CHAT, g(messages=m, max_tokens=4, tool_choice="required")),
        bad("priority-1", CMPL, g(prompt=p, max_tokens=4, priority=1)),
        bad("two-structured", CMPL, g(prompt=p, max_tokens=4, structured_outputs={"regex": "a+", "choice": ["a"]})),
        Case("bad-json", "invalid", CMPL, {}, STATUS, raw=b'{"prompt": "hi", "max_tokens": 4'),
    ]
