"""The 200 requests ``bench vllm-diff`` sends to vLLM and to pagedserve: the
valid ones by feature (this module) and the invalid ones (vllm_diff_invalid).

Every valid request decodes greedily (temperature 0), so both engines must
produce the same token ids, except the ``sampled`` ones: greedy n > 1 is a 400
in vLLM, and the two engines' seeded sampling is not meant to agree (vLLM
draws exponential noise from a per-request torch.Generator, pagedserve a
Gumbel draw keyed by seed and position), so those compare only status, the
number of choices and the prompt's token count. The harness adds ``model``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
EXACT, SAMPLED, STATUS = "exact", "sampled", "status"  # what a case compares


@dataclass(frozen=True)
class Case:
    name: str
    cat: str
    route: str
    body: dict[str, Any]
    compare: str = EXACT
    # Raw bytes sent instead of the JSON body (the malformed-JSON cases).
    raw: bytes | None = field(default=None)
    # Sent as is, without the harness's return_token_ids: the bodies' default shape (ids from logprobs).
    plain: bool = False


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
           "The quick brown fox", "Water boils at", "import numpy as np\n", "Q: What is 2+2?\nA:",
           "The best way to learn a language is", "In 1492,"]
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three colors.",
             "Say hello in Spanish.", "What is 12 times 12?", "Explain gravity in one sentence.",
             "Name a famous painter.", "What is Python?"]


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def g(**kw: Any) -> dict[str, Any]:
    """A greedy body."""
    return {"temperature": 0, **kw}


def _completions() -> list[Case]:
    out = [Case(f"cmpl-{i}", "completions", CMPL, g(prompt=p, max_tokens=16)) for i, p in enumerate(PROMPTS[:8])]
    out += [Case("cmpl-token-ids", "completions", CMPL, g(prompt=[504, 3575, 282, 4649, 314], max_tokens=12)),
            Case("cmpl-batch", "completions", CMPL, g(prompt=PROMPTS[:2], max_tokens=10)),
            Case("cmpl-max1", "completions", CMPL, g(prompt=PROMPTS[2], max_tokens=1)),
            Case("cmpl-seed-greedy", "completions", CMPL, g(prompt=PROMPTS[3], max_tokens=12, seed=7))]
    return out


def _chat() -> list[Case]:
    out = [Case(f"chat-{i}", "chat", CHAT, g(messages=user(q), max_tokens=16)) for i, q in enumerate(QUESTIONS[:6])]
    sys_msg = [{"role": "system", "content": "You answer in one word."}]
    out += [Case("chat-system", "chat", CHAT, g(messages=sys_msg + user("Capital of Italy?"), max_tokens=8)),
            Case("chat-multiturn", "chat", CHAT, g(messages=[*user("Hi!"), {"role": "assistant", "content": "Hello!"},
                                                             *user("What is your name?")], max_tokens=16)),
            Case("chat-parts", "chat", CHAT, g(messages=[{"role": "user", "content": [
                {"type": "text", "text": "Name a fruit."}]}], max_tokens=12)),
            Case("chat-max-completion-tokens", "chat", CHAT, g(messages=user(QUESTIONS[0]), max_completion_tokens=9)),
            Case("chat-top-p", "chat", CHAT, g(messages=user(QUESTIONS[1]), max_tokens=12, top_p=0.9))]
    return out


def _stream() -> list[Case]:
    out = [Case(f"stream-cmpl-{i}", "stream", CMPL, g(prompt=PROMPTS[i], max_tokens=14, stream=True))
           for i in range(4)]
    out += [Case(f"stream-chat-{i}", "stream", CHAT, g(messages=user(QUESTIONS[i]), max_tokens=14, stream=True))
            for i in range(4)]
    usage = {"include_usage": True}
    cont = {"include_usage": True, "continuous_usage_stats": True}
    out += [Case("stream-cmpl-usage", "stream", CMPL, g(prompt=PROMPTS[4], max_tokens=10, stream=True,
                                                         stream_options=usage)),
            Case("stream-chat-usage", "stream", CHAT, g(messages=user(QUESTIONS[4]), max_tokens=10, stream=True,
                                                         stream_options=usage)),
            Case("stream-cmpl-continuous", "stream", CMPL, g(prompt=PROMPTS[5], max_tokens=10, stream=True,
                                                              stream_options=cont)),
            Case("stream-chat-continuous", "stream", CHAT, g(messages=user(QUESTIONS[5]), max_tokens=10,
                                                              stream=True, stream_options=cont)),
            Case("stream-cmpl-batch", "stream", CMPL, g(prompt=PROMPTS[6:8], max_tokens=8, stream=True)),
            Case("stream-cmpl-logprobs", "stream", CMPL, g(prompt=PROMPTS[8], max_tokens=8, stream=True, logprobs=2)),
            Case("stream-chat-logprobs", "stream", CHAT, g(messages=user(QUESTIONS[6]), max_tokens=8, stream=True,
                                                            logprobs=True, top_logprobs=2))]
    return out


def _n() -> list[Case]:
    s = {"temperature": 0.8, "seed": 11}
    return [Case("n-cmpl-2", "n", CMPL, {**s, "prompt": PROMPTS[0], "n": 2, "max_tokens": 8}, SAMPLED),
            Case("n-cmpl-3", "n", CMPL, {**s, "prompt": PROMPTS[2], "n": 3, "max_tokens": 8}, SAMPLED),
            Case("n-chat-2", "n", CHAT, {**s, "messages": user(QUESTIONS[2]), "n": 2, "max_tokens": 8}, SAMPLED),
            Case("n-chat-3-stream", "n", CHAT, {**s, "messages": user(QUESTIONS[3]), "n": 3, "max_tokens": 6,
                                                 "stream": True}, SAMPLED),
            Case("n-cmpl-sampled-1", "n", CMPL, {**s, "prompt": PROMPTS[1], "max_tokens": 8}, SAMPLED),
            Case("n-cmpl-1-greedy", "n", CMPL, g(prompt=PROMPTS[4], n=1, max_tokens=8)),
            Case("n-chat-1-greedy", "n", CHAT, g(messages=user(QUESTIONS[7]), n=1, max_tokens=8))]


def _logprobs() -> list[Case]:
    out = [Case(f"lp-cmpl-{k}-{i}", "logprobs", CMPL, g(prompt=PROMPTS[i], max_tokens=8, logprobs=k))
           for k, i in ((0, 0), (1, 1), (5, 2), (5, 3), (20, 4))]
    out += [Case("lp-chat-bool", "logprobs", CHAT, g(messages=user(QUESTIONS[0]), max_tokens=8, logprobs=True))]
    out += [Case(f"lp-chat-top{k}", "logprobs", CHAT, g(messages=user(QUESTIONS[k]), max_tokens=8, logprobs=True,
                                                        top_logprobs=k)) for k in (1, 3, 5)]
    out += [Case("lp-cmpl-as-ids", "logprobs", CMPL, g(prompt=PROMPTS[5], max_tokens=8, logprobs=2,
                                                       return_tokens_as_token_ids=True), plain=True),
            Case("lp-cmpl-as-ids-0", "logprobs", CMPL, g(prompt=PROMPTS[6], max_tokens=8, logprobs=0,
                                                         return_tokens_as_token_ids=True), plain=True),
            Case("lp-chat-as-ids", "logprobs", CHAT, g(messages=user(QUESTIONS[4]), max_tokens=8, logprobs=True,
                                                       top_logprobs=2, return_tokens_as_token_ids=True), plain=True),
            Case("lp-chat-as-ids-stream", "logprobs", CHAT, g(messages=user(QUESTIONS[5]), max_tokens=8,
                                                              logprobs=True, return_tokens_as_token_ids=True,
                                                              stream=True), plain=True),
            Case("lp-chat-false", "logprobs", CHAT, g(messages=user(QUESTIONS[6]), max_tokens=8, logprobs=False))]
    return out


def _echo() -> list[Case]:
    return [Case("echo-cmpl", "echo", CMPL, g(prompt=PROMPTS[0], max_tokens=8, echo=True)),
            Case("echo-cmpl-logprobs", "echo", CMPL, g(prompt=PROMPTS[1], max_tokens=6, echo=True, logprobs=1)),
            Case("echo-cmpl-max1", "echo", CMPL, g(prompt=PROMPTS[2], max_tokens=1, echo=True)),
            Case("echo-cmpl-batch", "echo", CMPL, g(prompt=PROMPTS[3:5], max_tokens=4, echo=True)),
            Case("echo-cmpl-stream", "echo", CMPL, g(prompt=PROMPTS[5], max_tokens=6, echo=True, stream=True)),
            Case("echo-chat", "echo", CHAT, g(messages=[*user("Count to five."),
                                                        {"role": "assistant", "content": "1, 2,"}],
                                              max_tokens=8, echo=True, add_generation_prompt=False,
                                              continue_final_message=True)),
            Case("echo-chat-user-last", "echo", CHAT, g(messages=user(QUESTIONS[1]), max_tokens=8, echo=True))]


def _stop() -> list[Case]:
    long = {"max_tokens": 32}
    return [Case("stop-cmpl-str", "stop", CMPL, g(prompt=PROMPTS[3], stop=[","], **long)),
            Case("stop-cmpl-list", "stop", CMPL, g(prompt=PROMPTS[2], stop=[".", "\n"], **long)),
            Case("stop-cmpl-multitoken", "stop", CMPL, g(prompt=PROMPTS[0], stop=" Paris", **long)),
            Case("stop-chat-str", "stop", CHAT, g(messages=user(QUESTIONS[2]), stop=[","], **long)),
            Case("stop-chat-newline", "stop", CHAT, g(messages=user(QUESTIONS[1]), stop="\n", **long)),
            Case("stop-cmpl-include", "stop", CMPL, g(prompt=PROMPTS[3], stop=[","], include_stop_str_in_output=True,
                                                      **long)),
            Case("stop-chat-include", "stop", CHAT, g(messages=user(QUESTIONS[2]), stop=[","],
                                                      include_stop_str_in_output=True, **long)),
            Case("stop-cmpl-ids", "stop", CMPL, g(prompt=PROMPTS[3], stop_token_ids=[28], **long)),
            Case("stop-cmpl-ids-period", "stop", CMPL, g(prompt=PROMPTS[2], stop_token_ids=[30, 198], **long)),
            Case("stop-chat-ids", "stop", CHAT, g(messages=user(QUESTIONS[5]), stop_token_ids=[30], **long)),
            Case("stop-cmpl-max5", "stop", CMPL, g(prompt=PROMPTS[7], max_tokens=5)),
            Case("stop-cmpl-max40", "stop", CMPL, g(prompt=PROMPTS[7], max_tokens=40)),
            Case("stop-chat-eos", "stop", CHAT, g(messages=user("Say only: yes"), max_tokens=40)),
            Case("stop-chat-min-tokens", "stop", CHAT, g(messages=user("Say only: yes"), min_tokens=12,
                                                         max_tokens=20)),
            Case("stop-cmpl-min-tokens", "stop", CMPL, g(prompt=PROMPTS[3], min_tokens=6, stop_token_ids=[28],
                                                         max_tokens=12)),
            Case("stop-chat-ignore-eos", "stop", CHAT, g(messages=user("Say only: yes"), ignore_eos=True,
                                                         max_tokens=20)),
            Case("stop-cmpl-ignore-eos", "stop", CMPL, g(prompt=PROMPTS[7], ignore_eos=True, max_tokens=24)),
            Case("stop-cmpl-stream", "stop", CMPL, g(prompt=PROMPTS[3], stop=[","], stream=True, **long)),
            Case("stop-chat-stream", "stop", CHAT, g(messages=user(QUESTIONS[2]), stop=[","], stream=True, **long)),
            Case("stop-cmpl-stream-multitoken", "stop", CMPL, g(prompt=PROMPTS[0], stop=" Paris", stream=True,
                                                                **long))]


def _extras() -> list[Case]:
    c, q = PROMPTS, QUESTIONS
    asst = [*user("Write a list of fruits."), {"role": "assistant", "content": "Sure! 1. Apple 2."}]
    out = [
        Case("x-skip-special-false", "extras", CHAT, g(messages=user("Say only: yes"), ignore_eos=True, max_tokens=10,
                                                       skip_special_tokens=False)),
        Case("x-skip-special-true", "extras", CHAT, g(messages=user("Say only: yes"), ignore_eos=True, max_tokens=10,
                                                      skip_special_tokens=True)),
        Case("x-spaces-special-false", "extras", CHAT, g(messages=user("Say only: no"), ignore_eos=True,
                                                         max_tokens=10, skip_special_tokens=False,
                                                         spaces_between_special_tokens=False)),
        Case("x-cmpl-skip-special-false", "extras", CMPL, g(prompt="<|im_start|>user\nHi<|im_end|>\n", max_tokens=12,
                                                            ignore_eos=True, skip_special_tokens=False)),
        Case("x-add-gen-false", "extras", CHAT, g(messages=user(q[0]), add_generation_prompt=False, max_tokens=10)),
        Case("x-continue-final", "extras", CHAT, g(messages=asst, add_generation_prompt=False,
                                                   continue_final_message=True, max_tokens=12)),
        Case("x-template-kwargs", "extras", CHAT, g(messages=user(q[1]), max_tokens=10,
                                                    chat_template_kwargs={"enable_thinking": False})),
        Case("x-truncate-cmpl", "extras", CMPL, g(prompt=c[8], max_tokens=8, truncate_prompt_tokens=4)),
        Case("x-truncate-chat", "extras", CHAT, g(messages=user(q[3]), max_tokens=8, truncate_prompt_tokens=8)),
        Case("x-truncate-minus1", "extras", CMPL, g(prompt=c[9], max_tokens=8, truncate_prompt_tokens=-1)),
        Case("x-top-k-1", "extras", CMPL, g(prompt=c[2], max_tokens=10, top_k=1)),
        Case("x-top-k-5", "extras", CHAT, g(messages=user(q[4]), max_tokens=10, top_k=5)),
        Case("x-min-p", "extras", CMPL, g(prompt=c[4], max_tokens=10, min_p=0.1)),
        Case("x-rep-penalty-1.3", "extras", CMPL, g(prompt=c[3], max_tokens=16, repetition_penalty=1.3)),
        Case("x-rep-penalty-chat", "extras", CHAT, g(messages=user(q[2]), max_tokens=16, repetition_penalty=1.2)),
        Case("x-presence", "extras", CMPL, g(prompt=c[3], max_tokens=16, presence_penalty=1.5)),
        Case("x-frequency", "extras", CHAT, g(messages=user(q[2]), max_tokens=16, frequency_penalty=1.0)),
        Case("x-logit-bias", "extras", CMPL, g(prompt=c[3], max_tokens=10, logit_bias={"28": -100})),
        Case("x-allowed-token-ids", "extras", CMPL, g(prompt=c[3], max_tokens=6, allowed_token_ids=[28, 216, 33, 34])),
        Case("x-bad-words", "extras", CMPL, g(prompt=c[3], max_tokens=8, bad_words=[" 5"])),
        Case("x-priority-0", "extras", CMPL, g(prompt=c[5], max_tokens=6, priority=0)),
        Case("x-cache-salt", "extras", CHAT, g(messages=user(q[5]), max_tokens=6, cache_salt="salt-1")),
        Case("x-user", "extras", CHAT, g(messages=user(q[6]), max_tokens=6, user="someone")),
        Case("x-request-id", "extras", CHAT, g(messages=user(q[7]), max_tokens=6, request_id="diff-req-1")),
        Case("x-unknown-field", "extras", CMPL, g(prompt=c[7], max_tokens=6, not_a_vllm_field=1)),
        Case("x-parallel-tool-calls", "extras", CHAT, g(messages=user(q[0]), max_tokens=6, parallel_tool_calls=False)),
        Case("x-return-token-ids-stream", "extras", CMPL, g(prompt=c[9], max_tokens=6, stream=True,
                                                            return_token_ids=True)),
        Case("x-stream-cmpl-cont-stop", "extras", CMPL, g(prompt=c[3], max_tokens=12, stop=[","], stream=True,
                                                          stream_options={"include_usage": True,
                                                                          "continuous_usage_stats": True})),
        Case("x-top-k-sampled", "extras", CMPL, {"prompt": c[0], "max_tokens": 8, "temperature": 1.0, "top_k": 5,
                                                 "seed": 3}, SAMPLED),
        Case("x-min-p-sampled", "extras", CHAT, {"messages": user(q[0]), "max_tokens": 8, "temperature": 1.0,
                                                 "min_p": 0.2, "seed": 3}, SAMPLED),
    ]
    return out


def _prompt_logprobs() -> list[Case]:
    """Ranks and ids compared exactly (a prompt token outside the top k has its vocabulary rank)."""
    c, q, cat = PROMPTS, QUESTIONS, "prompt_logprobs"
    return [
        Case("x-prompt-lp-0-cmpl", cat, CMPL, g(prompt=c[0], max_tokens=4, prompt_logprobs=0)),
        Case("x-prompt-lp-2-cmpl", cat, CMPL, g(prompt=c[1], max_tokens=4, prompt_logprobs=2)),
        Case("x-prompt-lp-1-chat", cat, CHAT, g(messages=user(q[2]), max_tokens=4, prompt_logprobs=1)),
        Case("plp-cmpl-5", cat, CMPL, g(prompt=c[8], max_tokens=4, prompt_logprobs=5)),
        Case("plp-cmpl-ids-20", cat, CMPL, g(prompt=[504, 3575, 282, 4649, 314, 2114, 30], max_tokens=3,
                                             prompt_logprobs=20)),
        Case("plp-cmpl-echo", cat, CMPL, g(prompt=c[9], max_tokens=4, echo=True, logprobs=2, prompt_logprobs=3)),
        Case("plp-chat-5", cat, CHAT, g(messages=user(q[7]), max_tokens=4, prompt_logprobs=5, logprobs=True,
                                        top_logprobs=2)),
    ]


def basic_cases() -> list[Case]:
    return [*_completions(), *_chat(), *_stream(), *_n(), *_logprobs(), *_echo(), *_stop(), *_extras(),
            *_prompt_logprobs()]
