"""What `python -m benchmarks vllm-diff` found pagedserve answering differently from vLLM 0.32,
each now as vLLM answers, over the real processes on a tiny random model with
transformers' greedy decoding as the reference:

* ``allowed_token_ids`` and ``bad_words`` (vLLM's logits processors) applied;
* string numbers converted as pydantic's lax mode converts them;
* a stop token's text left out and its id as ``stop_reason``;
* logprobs: the chosen token inside ``top_logprobs`` (``logprobs=0``: it alone),
  and echo's prompt tokens in theirs; chat ``echo`` returns ``prompt_logprobs``;
* a byte token's logprob string "" until its character is complete.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from e2e_util import Server, serve
from models import make_tiny_model
from pagedserve.frontend.openai_api.http_response import decoded_token
from pagedserve.frontend.core.prompt_options import bad_words_token_ids
from pagedserve.gpuworker.sampler import banned_by_bad_words
from test_vllm_extras import post

PROMPT = "The quick brown fox jumps over the lazy dog and the cat"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)


@pytest.fixture(scope="module")
def hf(model_dir: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def srv(model_dir: str) -> Iterator[Server]:
    with serve("--model", model_dir, "--num-gpu-blocks", "64") as s:
        yield s


def greedy(hf: tuple[Any, Any], n: int, allowed: list[int] | None = None,
           bad: tuple[tuple[int, ...], ...] = ()) -> list[int]:
    """transformers' logits, argmax under vLLM's allowed-ids mask and bad-words rule."""
    import torch

    tok, model = hf
    ids = tok(PROMPT, return_tensors="pt").input_ids[0].tolist()
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, -1].clone()
        if allowed is not None:
            mask = torch.full_like(logits, float("-inf"))
            mask[allowed] = 0
            logits += mask
        for word in bad:  # the word's last token, while the output ends with the rest of it
            if len(word) <= len(out) + 1 and (len(word) == 1 or out[-(len(word) - 1):] == list(word[:-1])):
                logits[word[-1]] = float("-inf")
        out.append(int(logits.argmax()))
    return out


def cmpl(srv: Server, **body: Any) -> dict[str, Any]:
    code, r, _ = post(srv.http, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "return_token_ids": True,
                                                    **body})
    assert code == 200, r
    return r  # type: ignore[no-any-return]


def test_allowed_token_ids_and_bad_words(srv: Server, hf: tuple[Any, Any]) -> None:
    free = greedy(hf, 6)
    allowed = sorted(set(free[1:]) | {5, 7, 11})  # the first free token is not allowed
    got = cmpl(srv, max_tokens=6, allowed_token_ids=allowed)["choices"][0]["token_ids"]
    assert got == greedy(hf, 6, allowed=allowed) and set(got) <= set(allowed)
    word = hf[0].decode([free[1]]).strip() or hf[0].decode([free[1]])
    bad = bad_words_token_ids((word,), lambda t: hf[0].encode(t, add_special_tokens=False))
    got = cmpl(srv, max_tokens=6, bad_words=[word])["choices"][0]["token_ids"]
    assert got == greedy(hf, 6, bad=bad) and got != free


def test_bad_word_sequences_as_vllm_applies_them() -> None:
    # vLLM's _apply_bad_words_single_batch: only the output so far counts, not the prompt.
    assert banned_by_bad_words(((5,), (1, 2), (3, 4, 6)), [9, 1]) == [5, 2]
    assert banned_by_bad_words(((3, 4, 6),), [3, 4]) == [6]
    assert banned_by_bad_words(((3, 4, 6),), [4]) == []
    # update_from_tokenizer: the word at the start, and with a space when that is a new token of equal length.
    vocab = {"fox": [7], " fox": [8], "big dog": [1, 2], " big dog": [3, 2], "a b": [1, 2], " a b": [4]}
    assert bad_words_token_ids(("fox", " big dog", "a b"), lambda t: vocab[t]) == ((7,), (8,), (1, 2), (3, 2), (1, 2))


def test_string_numbers_and_stop_token_ids(srv: Server, hf: tuple[Any, Any]) -> None:
    free = greedy(hf, 8)
    r = cmpl(srv, max_tokens="5", temperature="0", echo="false")
    assert r["choices"][0]["token_ids"] == free[:5]
    stop = free[3]
    r = cmpl(srv, max_tokens=8, stop_token_ids=[stop])["choices"][0]
    ids = free[:free.index(stop) + 1]
    assert r["token_ids"] == ids and r["finish_reason"] == "stop" and r["stop_reason"] == stop
    assert r["text"] == hf[0].decode(ids[:-1])  # the stop token's text is left out
    r = cmpl(srv, max_tokens=8, stop_token_ids=[stop], include_stop_str_in_output=True)["choices"][0]
    assert r["text"] == hf[0].decode(ids) and r["stop_reason"] == stop


def test_top_logprobs_hold_the_chosen_token(srv: Server, hf: tuple[Any, Any]) -> None:
    r = cmpl(srv, max_tokens=4, logprobs=0)["choices"][0]["logprobs"]
    assert [list(t) for t in r["top_logprobs"]] == [[s] for s in r["tokens"]]
    r = cmpl(srv, max_tokens=3, logprobs=1, echo=True)["choices"][0]["logprobs"]
    assert r["top_logprobs"][0] is None
    for s, top in zip(r["tokens"][1:], r["top_logprobs"][1:]):
        assert s in top and 1 <= len(top) <= 2
    code, c, _ = post(srv.http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2, "temperature": 0, "echo": True})
    assert code == 200 and len(c["prompt_logprobs"]) == c["usage"]["prompt_tokens"]


def test_a_byte_tokens_string_waits_for_its_character() -> None:
    from pagedserve.common.default_model import resolve_model
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))

    class Gw:  # the two gateway calls decoded_token makes, on the real tokenizer
        class svc:  # noqa: N801
            detokenize = staticmethod(lambda ids, skip_special_tokens=False: tok.decode(ids))

        token_str = staticmethod(lambda t: tok.decode([t]))

    ids = tok.encode("é🙂", add_special_tokens=False)
    strings = [decoded_token(Gw, t, ids[:i]) for i, t in enumerate(ids)]  # type: ignore[arg-type]
    assert "".join(strings) == "é🙂" and all(s in ("", "é", "🙂") for s in strings)
    assert strings[-1] == "🙂" and len(ids) > 2


def test_streamed_logprob_strings_equal_the_whole_answers(srv: Server) -> None:
    # A byte token's string depends on the tokens before it: a stream keeps them per choice.
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    code, whole, _ = post(srv.http, "/v1/chat/completions", body)
    assert code == 200
    code, raw, _ = post(srv.http, "/v1/chat/completions", {**body, "stream": True})
    from test_vllm_extras import events

    streamed = [e for ev in events(raw) for ch in ev["choices"] for e in (ch.get("logprobs") or {}).get("content", [])]
    assert [(e["token"], e["bytes"]) for e in streamed] == \
        [(e["token"], e["bytes"]) for e in whole["choices"][0]["logprobs"]["content"]]
