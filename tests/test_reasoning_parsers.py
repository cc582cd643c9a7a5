"""Reasoning parsers (frontend/openai_api/reasoning): hard-coded answers, and with the
peer venv (vLLM 0.32) a differential test: the same texts through vLLM's
parsers of the same name (with the tool parser after them), whole and
streamed in chunks of every size from 1 to 8 characters, give the same
``reasoning``, ``content`` and ``tool_calls``.

Streams go through the chat answer builder the server uses (``chat.formatter``)
on fixed token texts. Token ids come from a real tokenizer (the tiny test
tokenizer with Qwen3's ``<think>``/``<tool_call>`` tokens added; gpt-oss:
harmony's own encoding, in the peer): a marker is one token, so no chunk
splits it."""
from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from e2e_util import serve
from models import make_tiny_model
from pagedserve.frontend.core.outputs import Chunk
from pagedserve.frontend.openai_api.reasoning import check
from pagedserve.frontend.openai_api.reasoning.chat import formatter
from pagedserve.frontend.openai_api.reasoning.harmony import SPECIALS as HARMONY_SPECIALS

PEER_PY = Path(__file__).resolve().parents[1] / ".venv-peers" / "bin" / "python"
PEER_STAMP = PEER_PY.parents[1] / ".peers-stamp"
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
XML_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
THINK_TEXTS = [
    "<think>\nLet me think about Paris.\n</think>\n\nParis is the capital of France.",
    "Let me think.\n</think>\n\nThe answer is 42.",  # the start marker was in the prompt
    "<think>\nStill thinking about the answer",  # reasoning only (cut)
    "No thinking markers at all, just an answer.",
    "<think></think>Direct answer.",
    "<think>\nUnicode: café 東京 🙂\n</think>\n\nMoscow: Москва → ±",
    "<think>\nnested <think> marker</think>after</think> tail",
    "<think>\nI should call a tool.\n</think>\n\n" + CALL,
    "<think>\nhmm, a < sign\n</think>\n\nSure. " + CALL,
    "<think>\nthinking, then straight to the call" + CALL,  # qwen3: a call ends the reasoning
    "<think>\nok</think>\n\n",  # reasoning, then whitespace only
    "<think>\nXML call next\n</think>\n\n" + XML_CALL,  # Qwen3-Coder / Qwen3.5's call form
    "<think>\nthinking straight into an XML call" + XML_CALL + "\nafter",
]
H_CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
          '{"city": "Paris"}<|call|>')
HARMONY_TEXTS = [
    "<|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final<|message|>Paris.<|return|>",
    "<|channel|>final<|message|>Just the answer.<|return|>",
    "<|channel|>analysis<|message|>Cut in the middle of thinking",
    "Plain text, no harmony at all.",
    "<|channel|>analysis<|message|>I need the weather.<|end|>" + H_CALL,
    "<|channel|>commentary<|message|>A preamble.<|end|><|start|>assistant<|channel|>final<|message|>"
    "Done: 東京 🙂<|return|>",
    "<|channel|>analysis<|message|>two calls<|end|>" + H_CALL + H_CALL.replace("get_weather", "get_time"),
    "<|channel|>analysis<|message|>a<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json"
    '<|message|>{"city":"Oslo"}<|call|>',
    "<|channel|>final<|message|>Hi<|end|>stray text",
]
JOBS = [("deepseek_r1", None), ("deepseek_r1", "hermes"), ("qwen3", None), ("qwen3", "hermes"),
        ("qwen3", "qwen3_coder"), ("deepseek_r1", "qwen3_xml"),
        ("openai_gptoss", None), ("openai_gptoss", "openai"), (None, "openai")]
# Prompts whose end says where the output starts (streams read it): R1's template opens the reasoning,
# Qwen3's with enable_thinking false closes it (the whole output, read without the prompt, is the same).
PROMPTS = {"": PROMPT, "open": PROMPT + "<think>\n", "closed": PROMPT + "<think>\n\n</think>\n\n"}
PROMPT_JOBS = [("deepseek_r1", None, "open"), ("qwen3", None, "open"), ("qwen3", "hermes", "closed"),
               ("deepseek_r1", None, "closed")]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from models import train_tokenizer  # noqa: E402 (the tiny models' tokenizer)

    tok = train_tokenizer(500)
    tok.add_tokens(MARKERS)  # Qwen3's: added, not special (they stay in decoded text)
    folder = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(folder)
    tok.folder = str(folder)
    return tok


def chunkings(text: str, markers: list[str]) -> list[list[str]]:
    """The whole text, then chunks of k = 1..8 characters, each cut moved past a marker it would split."""
    spans = [(i, i + len(m)) for m in markers for i in range(len(text)) if text.startswith(m, i)]
    out = [[text]]
    for k in range(1, 9):
        chunks, pos = [], 0
        while pos < len(text):
            end = min(pos + k, len(text))
            for s, e in spans:
                if s < end < e:
                    end = e
            chunks.append(text[pos:end])
            pos = end
        out.append(chunks)
    return out


def ours(name: str | None, tools: str | None, tok: Any, text: str, streams: list[list[str]],
         prompt_text: str = PROMPT) -> dict[str, Any]:
    harmony = name == "openai_gptoss" or tools == "openai"
    vocab = {} if harmony else tok.get_vocab()
    specials = () if harmony else tuple(tok.all_special_tokens)
    prompt = [] if harmony else tok.encode(prompt_text, add_special_tokens=False)

    def ids(t: str) -> list[int]:
        return [] if harmony else tok.encode(t, add_special_tokens=False)

    def build() -> Any:
        return formatter(name, tools, None, vocab, specials, True, prompt, lambda *a: None)

    msg = build()(Chunk(0, ids(text), text, finish_reason="stop"), None)["message"]
    assert msg.get("reasoning_content") == msg.get("reasoning")
    whole = [msg.get("reasoning"), msg["content"],
             [[c["function"]["name"], c["function"]["arguments"]] for c in msg.get("tool_calls", [])]]
    out = []
    for chunks in streams:
        b, acc = build(), {}
        r, c, names, args = "", "", {}, {}
        for i, ch in enumerate(chunks):
            choice = b(Chunk(0, ids(ch), ch, finish_reason="stop" if i == len(chunks) - 1 else None), acc)
            d = (choice or {}).get("delta", {})
            assert d.get("reasoning_content") == d.get("reasoning")
            r += d.get("reasoning") or ""
            c += d.get("content") or ""
            for tc in d.get("tool_calls", []):
                if tc.get("function", {}).get("name"):
                    names[tc["index"]] = tc["function"]["name"]
                args[tc["index"]] = args.get(tc["index"], "") + (tc.get("function", {}).get("arguments") or "")
        out.append([r, c, [[names[i], args.get(i, "")] for i in sorted(names)]])
    return {"whole": whole, "streams": out}


# ------------------------------------------------------------ hard-coded answers
def test_answers(tokenizer: Any) -> None:
    def whole(name: str, tools: str | None, text: str) -> list[Any]:
        return ours(name, tools, tokenizer, text, [])["whole"]

    assert whole("qwen3", None, THINK_TEXTS[0]) == ["\nLet me think about Paris.\n",
                                                   "\n\nParis is the capital of France.", []]
    assert whole("deepseek_r1", None, THINK_TEXTS[2]) == ["\nStill thinking about the answer", None, []]
    assert whole("qwen3", None, THINK_TEXTS[6]) == ["\nnested  marker", "after tail", []]  # qwen3 drops repeats
    assert whole("deepseek_r1", None, THINK_TEXTS[6]) == ["\nnested <think> marker", "after</think> tail", []]
    assert whole("qwen3", "hermes", THINK_TEXTS[9]) == ["\nthinking, then straight to the call", None,
                                                        [["get_weather", '{"city": "Paris"}']]]
    assert whole("openai_gptoss", "openai", HARMONY_TEXTS[4]) == ["I need the weather.", None,
                                                                 [["get_weather", '{"city": "Paris"}']]]
    assert whole("openai_gptoss", None, HARMONY_TEXTS[3]) == [None, "Plain text, no harmony at all.", []]
    streamed = ours("qwen3", None, tokenizer, THINK_TEXTS[0], [chunkings(THINK_TEXTS[0], MARKERS)[3]])
    assert streamed["streams"] == [["\nLet me think about Paris.\n", "\n\nParis is the capital of France.", []]]


def test_start_up_check(tokenizer: Any) -> None:
    check("qwen3", tokenizer.get_vocab(), "m")
    with pytest.raises(ValueError, match="cannot be used with the tokenizer of 'm'.*<think>"):
        check("deepseek_r1", {"a": 1}, "m")
    with pytest.raises(ValueError, match="not one of"):
        check("nope", {}, "m")
    with pytest.raises(ValueError, match="do not go together"):
        check("qwen3", tokenizer.get_vocab(), "m", tool_parser="openai")


# ------------------------------------------------------------ against vLLM
@pytest.mark.skipif(not PEER_STAMP.exists(), reason="no peer venv (scripts/setup-peers.sh installs vLLM 0.32)")
def test_identical_to_vllm_parsers(tokenizer: Any) -> None:
    jobs = []
    for name, tools, prompt in [(n, t, "") for n, t in JOBS] + PROMPT_JOBS:
        harmony = name == "openai_gptoss" or tools == "openai"
        texts = HARMONY_TEXTS if harmony else THINK_TEXTS
        markers = list(HARMONY_SPECIALS) if harmony else MARKERS + list(tokenizer.all_special_tokens)
        jobs.append({"reasoning": name, "tools": tools, "tokenizer": None if harmony else tokenizer.folder,
                     "prompt": [] if harmony else tokenizer.encode(PROMPTS[prompt], add_special_tokens=False),
                     "prompt_text": PROMPTS[prompt],
                     "cases": [{"text": t, "streams": chunkings(t, markers)} for t in texts]})
    run = subprocess.run([str(PEER_PY), str(Path(__file__).with_name("vllm_reasoning_peer.py"))], cwd="/tmp",
                         input=json.dumps(jobs), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    diffs = []
    for job, answers in zip(jobs, json.loads(run.stdout)):
        for case, ref in zip(job["cases"], answers):
            got = ours(job["reasoning"], job["tools"], tokenizer, case["text"], case["streams"], job["prompt_text"])
            if got["whole"] != ref["whole"]:
                diffs.append((job["reasoning"], job["tools"], "whole", case["text"], got["whole"], ref["whole"]))
            for chunks, g, r in zip(case["streams"], got["streams"], ref["streams"]):
                if g != r:
                    diffs.append((job["reasoning"], job["tools"], len(chunks), case["text"], g, r))
                    break
    assert not diffs, "\n".join(map(repr, diffs[:12]))


# ------------------------------------------------------------ end to end
def _post(base: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        if not body.get("stream"):
            return json.loads(r.read())
        return [json.loads(line[6:]) for line in r.read().decode().splitlines()
                if line.startswith("data: {")]


def test_served_qwen3_answers_carry_the_reasoning(tmp_path: Path) -> None:
    """`serve --reasoning-parser qwen3` on a tiny random Qwen3: its text is noise, but the
    chat template opens no reasoning and the model never writes </think>, so with thinking
    on (the default) the whole output is reasoning, and with enable_thinking false the same
    greedy text is content. Shows the flag reaching the frontend and both answer forms."""
    model = make_tiny_model(tmp_path, "qwen3", seed=0)
    body = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 24}
    with serve("--model", model, "--num-gpu-blocks", "64", "--reasoning-parser", "qwen3") as server:
        plain = _post(server.http, {**body, "chat_template_kwargs": {"enable_thinking": False}})["choices"][0]
        text = plain["message"]["content"]
        assert text and plain["message"]["reasoning"] is None
        dropped = text  # qwen3 drops the tokenizer's special tokens from what it parses
        for s in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
            dropped = dropped.replace(s, "")
        msg = _post(server.http, body)["choices"][0]["message"]
        assert (msg["reasoning"], msg["reasoning_content"], msg["content"]) == (dropped, dropped, None)
        chunks = _post(server.http, {**body, "stream": True})
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("reasoning") or "" for d in deltas) == dropped
        assert all(d.get("reasoning_content") == d.get("reasoning") for d in deltas)
        assert "".join(d.get("content") or "" for d in deltas) == ""
        hidden = _post(server.http, {**body, "include_reasoning": False, "logprobs": True})["choices"][0]
        assert (hidden["message"]["reasoning"], hidden["message"]["content"], hidden["logprobs"]) == (None, None, None)
