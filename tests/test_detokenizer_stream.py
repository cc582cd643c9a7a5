"""The frontend's incremental text (issue 23, acceptance 3) against real
references, on multi-byte text (CJK, Cyrillic, accents, emoji with ZWJ and
flags, byte-fallback tokens) and stop strings, streamed and not:

* ``tokenizer.decode`` of the ids so far (after the prompt's context): the
  text sent after each token is the decoded text up to the last token that
  completes a character; at a length cut inside a character the text is the
  decoded ids, its end U+FFFD (as before), or, with vLLM's rule
  (``incomplete_end_as_fffd=False``), without that character;
* today's path, the Python loop over ``tokenizer.decode`` (forced through a
  tokenizer without ``backend_tokenizer``), also on random ids (invalid UTF-8,
  special and unknown ids), chunk by chunk through ``OutputState``;
* vLLM 0.32's own detokenizer (``FastIncrementalDetokenizer``, stop strings
  included) in the peer venv, where it is installed.

Tokenizers: the embedded SmolLM2 (byte-level BPE; frontend/core/tokenizer.py's and
transformers'), the tests' tiny byte-level tokenizer, and a SentencePiece-style
one built here whose CJK and emoji are byte-fallback tokens (<0xE6>...).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
from tokenizers import decoders

from models import train_tokenizer
from pagedserve.common.messages import frontend as fe
from pagedserve.frontend.core.detokenizer import IncrementalDetokenizer, decode_whole
from pagedserve.frontend.core.outputs import Chunk, OutputState, merge_into

PEERS = Path(__file__).resolve().parents[1] / ".venv-peers"
TEXTS = [
    "東京タワーは高いです。北京欢迎你！한국어 문장도 있습니다.",
    "Emoji: 🙂🎉 👩‍💻 and a flag 🇫🇷, then ∑ ± → €.",
    "Москва — столица; café, naïve, jalapeño, Ærøskøbing.",
    "mixed 日本語 text 🙂 with <|im_end|> a special token and ascii",
]
STOPS = ["タワー", "欢迎", "🎉", "👩‍💻", "— с", "naïve", "語 te", ", then"]


def _byte_fallback_tokenizer() -> Any:
    """Llama-style: Metaspace pieces, BPE with byte_fallback, no CJK or emoji in
    the vocabulary (so they decode from <0xNN> tokens)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    chars = ["▁"] + [chr(c) for c in range(33, 127)] + list("éïñøÆ—Москвалиц")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("a", "n"), ("▁", "c")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   additional_special_tokens=["<|im_end|>"])


def _smollm2(hf: bool) -> Any:
    from pagedserve.common.default_model import ModelNotFound, resolve_model

    try:
        folder = resolve_model(None)
    except ModelNotFound as e:
        pytest.skip(str(e))
    if hf:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    from pagedserve.frontend.core.tokenizer import load

    return load(folder)


@pytest.fixture(scope="module", params=["smollm2", "smollm2-transformers", "tiny", "byte-fallback"])
def tok(request: pytest.FixtureRequest) -> Any:
    if request.param.startswith("smollm2"):
        return _smollm2(request.param != "smollm2")
    return train_tokenizer(500) if request.param == "tiny" else _byte_fallback_tokenizer()


class SlowPath:
    """The same tokenizer without ``backend_tokenizer``: the detokenizer's Python
    loop over ``tokenizer.decode``, which is the path of every earlier release."""

    def __init__(self, tok: Any) -> None:
        self.decode = tok.decode


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False).input_ids)


def _reference(tok: Any, ctx: list[int], ids: list[int], skip: bool = True) -> list[str]:
    """The text owed after each token: the decoded text after the context, up to
    the last token at which it does not end inside a character."""
    def dec(x: list[int]) -> str:
        return str(tok.decode(x, skip_special_tokens=skip, clean_up_tokenization_spaces=False))

    base = dec(ctx)
    out, last = [], ""
    for k in range(1, len(ids) + 1):
        full = dec(ctx + ids[:k])
        if not full.endswith("\ufffd"):
            assert full.startswith(base)
            last = full[len(base):]
        out.append(last)
    return out


def _stream(tok: Any, prompt: list[int], ids: list[int], skip: bool = True) -> tuple[list[str], bool]:
    d = IncrementalDetokenizer(tok, prompt, skip)
    sent, out = "", []
    for t in ids:
        sent += d.add([t])
        out.append(sent)
    return out, d.fast


@pytest.mark.parametrize("skip", [True, False])
def test_streamed_text_is_decode_of_the_ids_so_far(tok: Any, skip: bool) -> None:
    for text in TEXTS:
        for prompt_text in ("", "Say:", "前置き "):
            prompt = _ids(tok, prompt_text)
            ids = _ids(tok, text)
            got, fast = _stream(tok, prompt, ids, skip)
            assert fast, "a tokenizer with a Rust backend streams through DecodeStream"
            assert got == _reference(tok, prompt[-6:], ids, skip), (text, prompt_text)
            # Cut mid-way at every length: an incomplete last character is dropped, never U+FFFD.
            assert not any(g.endswith("\ufffd") for g in got)


def test_same_text_as_todays_path_on_random_ids(tok: Any) -> None:
    rng = random.Random(23)
    vocab = len(tok)
    real = [t for text in TEXTS for t in _ids(tok, text)]
    for trial in range(150):
        kind = trial % 3
        if kind == 0:  # anything: invalid UTF-8, special tokens, ids past the vocabulary
            ids = [rng.randrange(vocab + 50) for _ in range(rng.randrange(1, 30))]
        elif kind == 1:  # real text with random ids in it
            ids = [rng.choice(real) if rng.random() < 0.7 else rng.randrange(vocab) for _ in range(40)]
        else:  # real text from any token on (it may start inside a character)
            ids = real[rng.randrange(len(real)):][:60]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
        for skip in (True, False):
            fast, slow = IncrementalDetokenizer(tok, prompt, skip), IncrementalDetokenizer(SlowPath(tok), prompt, skip)
            assert not slow.fast
            assert [fast.add([t]) for t in ids] == [slow.add([t]) for t in ids], (prompt, ids, skip)
            assert decode_whole(tok, prompt, ids, skip) == decode_whole(SlowPath(tok), prompt, ids, skip)


def _run(tok: Any, prompt: list[int], ids: list[int], stops: tuple[str, ...], include: bool,
         per_token: bool, fffd_end: bool = True) -> list[Chunk]:
    st = OutputState(0, tok, prompt, stops, include, True, incomplete_end_as_fffd=fffd_end)
    groups = [[t] for t in ids] if per_token else [ids]
    chunks = []
    for i, g in enumerate(groups):
        lps = [(-0.25, [(t, -0.25)]) for t in g]
        c = st.on_delta(fe.TokenDelta("r", 0, g, fe.FinishReason.LENGTH if i == len(groups) - 1 else None,
                                      logprobs=lps))
        if c is not None:
            chunks.append(c)
    return chunks


def _merged(chunks: list[Chunk]) -> Chunk:
    m: dict[int, Chunk] = {}
    for c in chunks:
        merge_into(m, c)
    return m[0]


@pytest.mark.parametrize("fffd_end", [True, False])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_streamed_and_not(tok: Any, include: bool, fffd_end: bool) -> None:
    prompt = _ids(tok, "Say:")
    for text in TEXTS:
        ids = _ids(tok, text)
        full = _reference(tok, prompt[-6:], ids)[-1]
        for stop in [s for s in STOPS if s in full] + ["never-there"]:
            stops = (stop, "zzz-never")
            streamed = _run(tok, prompt, ids, stops, include, True, fffd_end)
            # Today's path, chunk by chunk: the same text, ids, logprobs and reasons.
            assert streamed == _run(SlowPath(tok), prompt, ids, stops, include, True, fffd_end), (text, stop)
            whole = _merged(_run(tok, prompt, ids, stops, include, False, fffd_end))
            m = _merged(streamed)
            assert (m.text, m.token_ids, m.finish_reason, m.stop_reason) == \
                (whole.text, whole.token_ids, whole.finish_reason, whole.stop_reason)
            if stop not in full:
                assert m.text == full and m.token_ids == ids and m.finish_reason == "length"
                continue
            i = full.index(stop)
            assert m.text == full[:i + (len(stop) if include else 0)], (text, stop)
            assert (m.finish_reason, m.stop_reason) == ("stop", stop)
            # Tokens up to the one whose text completes the stop string.
            owed = _reference(tok, prompt[-6:], ids)
            assert m.token_ids == ids[:next(k for k, t in enumerate(owed, 1) if stop in t)]


def test_length_cut_inside_a_character(tok: Any) -> None:
    ids = _ids(tok, "東京🙂")
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    if not cuts:
        pytest.skip("this tokenizer has whole-character tokens for this text")
    for k in cuts:
        for per_token in (True, False):
            # As before (the Python path): the incomplete end as U+FFFD; for a byte-level
            # tokenizer that is the decoded ids (ByteFallback turns a whole run of byte
            # tokens that does not decode into U+FFFDs, the complete 東 too).
            m = _merged(_run(tok, [], ids[:k], (), False, per_token))
            assert m == _merged(_run(SlowPath(tok), [], ids[:k], (), False, per_token))
            assert m.text.endswith("\ufffd")
            if isinstance(tok.backend_tokenizer.decoder, decoders.ByteLevel):
                assert m.text == tok.decode(ids[:k], skip_special_tokens=True)
            # vLLM's rule: the incomplete character is dropped.
            v = _merged(_run(tok, [], ids[:k], (), False, per_token, fffd_end=False))
            assert v.text == _reference(tok, [], ids[:k])[-1] and not v.text.endswith("\ufffd")
            for c in (m, v):
                assert c.token_ids == ids[:k] and c.finish_reason == "length"  # every token still counts


def test_whole_beam_keeps_todays_text(tok: Any) -> None:
    # A beam replaces the output at once: decoded whole, as before (an incomplete end stays U+FFFD).
    for text in TEXTS:
        ids = _ids(tok, text)[:-1]
        assert decode_whole(tok, [], ids) == tok.decode(ids, skip_special_tokens=True)


_PEER_SCRIPT = r"""
import json, sys
from types import SimpleNamespace as NS
from transformers import AutoTokenizer
from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer, IncrementalDetokenizer
out = []
tokenizers = {}
for folder, prompt, ids, stops, include in json.loads(sys.stdin.read()):
    tok = tokenizers.get(folder) or tokenizers.setdefault(folder, AutoTokenizer.from_pretrained(folder))
    sp = NS(stop=stops, min_tokens=0, include_stop_str_in_output=include, skip_special_tokens=True,
            spaces_between_special_tokens=True)
    d = IncrementalDetokenizer.from_new_request(tok, NS(request_id="r", prompt_token_ids=prompt,
                                                        prompt_embeds=None, sampling_params=sp))
    assert isinstance(d, FastIncrementalDetokenizer)
    text, stop = "", None
    for k, t in enumerate(ids):
        stop = d.update([t], False)
        text += d.get_next_output_text(stop is not None or k == len(ids) - 1, True)
        if stop is not None:
            break
    out.append([text, stop, len(d.output_token_ids)])
print(json.dumps(out))
"""


@pytest.mark.skipif(not (PEERS / ".peers-stamp").exists(), reason="no peer venv (.venv-peers: scripts/setup-peers.sh)")
def test_same_text_and_stops_as_vllm(tok: Any, tmp_path: Path) -> None:
    if hasattr(tok, "save_pretrained"):
        folder = str(tmp_path / "tok")
        tok.save_pretrained(folder)
    else:  # frontend/core/tokenizer.py's: the folder it read
        from pagedserve.common.default_model import resolve_model

        folder = resolve_model(None)
    prompt = _ids(tok, "Say:")
    cases = [[folder, prompt, _ids(tok, text)[:cut], stops, include]
             for text in TEXTS for cut in (None, -1, -2) for include in (False, True)
             for stops in ([], [s for s in STOPS if s in text][:2])]
    run = subprocess.run([str(PEERS / "bin" / "python"), "-c", _PEER_SCRIPT], input=json.dumps(cases),
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    for (_, prompt, ids, stops, include), (text, stop, num_ids) in zip(cases, theirs):
        m = _merged(_run(tok, prompt, ids, tuple(stops), include, True, fffd_end=False))
        assert (m.text, m.stop_reason, len(m.token_ids)) == (text, stop, num_ids), (ids, stops, include)
