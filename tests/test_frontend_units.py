"""Frontend units without processes: stop strings with hold-back (hypothesis),
token hold-back against a real tokenizer, the delta -> chunk mapping for
logprobs / n > 1 / beam replace, admission bounds and API keys, driven
through GenerationService with a scripted engine."""
from __future__ import annotations

from pagedserve.frontend.core.error_table import RejectReason

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models import make_tiny_model
from pagedserve.common.messages import frontend as fe
from pagedserve.common.messages.types import ModelInfo
from pagedserve.frontend.core.auth import ApiKeys, load_keys
from pagedserve.frontend.core.generation import FrontendConfig, GenerationService, Rejected
from pagedserve.frontend.core.outputs import OutputState, StopChecker
from pagedserve.frontend.core.validation import ValidationError
from pagedserve.v1 import generation_pb2 as pb


# ---------------------------------------------------------------- stop strings
def _expected(text: str, stops: list[str]) -> tuple[str, str | None]:
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text, None
    i = min(h[0] for h in hits)
    return text[:i], "match"


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet="ab\nc", max_size=40),
       stops=st.lists(st.text(alphabet="ab\nc", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=12))
def test_stop_checker_never_releases_a_stop_string_prefix(text: str, stops: list[str], cuts: list[int]) -> None:
    """Any text, any stop strings, any chunking: what is released is always a
    prefix of the text before the earliest stop string, and at the end it is
    exactly that text."""
    want, match = _expected(text, stops)
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    chk = StopChecker(tuple(stops))
    out = ""
    matched = None
    for a, b in zip(bounds, bounds[1:]):
        emit, matched = chk.feed(text[a:b])
        out += emit
        assert want.startswith(out), (out, want)
        if matched is not None:
            break
    if matched is None:
        tail, matched = chk.flush()
        out += tail
        assert (matched is None) == (match is None)
        if matched is not None:
            assert text[len(out):].startswith(matched)
    else:
        assert match is not None and text[len(out):].startswith(matched)
    assert out == want


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("m"), "llama"))


TEXT = "The quick brown fox: café, naïve, 東京 and 🙂 are split into bytes when needed."


def _feed(state: OutputState, ids: list[int]) -> list[Any]:
    chunks = []
    for i, t in enumerate(ids):
        c = state.on_delta(fe.TokenDelta("r", 0, [t], "length" if i == len(ids) - 1 else None))
        if c is not None:
            chunks.append(c)
    return chunks


@pytest.mark.parametrize("stop", ["東京", "k brown f", "fox: caf", ", naï", "🙂 are", "needed."])
def test_output_stop_string_across_tokens_is_trimmed_and_never_streamed(tok: Any, stop: str) -> None:
    ids = tok(TEXT, add_special_tokens=False).input_ids
    prompt = tok("Say:", add_special_tokens=False).input_ids
    full = tok.decode(ids, skip_special_tokens=True)
    i = full.index(stop)
    # The stop string spans several tokens (that is the point of the test).
    # (Text ending in an incomplete character is decided with the token that completes it.)
    spans = [t for t in range(1, len(ids) + 1)
             if stop in (d := tok.decode(ids[:t])) and not d.endswith("\ufffd")]
    first_complete = spans[0]
    assert not any(stop in tok.decode(ids[k:first_complete]) for k in range(first_complete - 1, first_complete)), \
        "the stop string must need more than one token"
    state = OutputState(0, tok, prompt, (stop, "never-there"), False, False)
    chunks = _feed(state, ids)
    sent = ""
    sent_ids: list[int] = []
    for c in chunks:
        sent += c.text
        sent_ids += c.token_ids
        assert full[:i].startswith(sent), "text past the stop string reached the client"
        if c.finish_reason is None:
            # Held ids spell no more than the released text.
            assert sent.startswith(tok.decode(sent_ids).rstrip("\ufffd"))
    assert sent == full[:i]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == stop
    assert sent_ids == ids[:first_complete]  # up to the token that completed the stop string
    assert state.num_tokens == first_complete


def test_include_stop_str_and_false_start_release(tok: Any) -> None:
    ids = tok(TEXT, add_special_tokens=False).input_ids
    full = tok.decode(ids)
    st_ = OutputState(0, tok, [], ("brown fox",), True, False)
    assert "".join(c.text for c in _feed(st_, ids)) == full[:full.index("brown fox") + len("brown fox")]
    # A stop string whose prefix appears ("qui") but never completes: everything is released in the end.
    st2 = OutputState(0, tok, [], ("quiz", "東京X"), False, False)
    chunks = _feed(st2, ids)
    assert "".join(c.text for c in chunks) == full
    assert [t for c in chunks for t in c.token_ids] == ids and chunks[-1].finish_reason == "length"


def test_whole_output_replace_with_stop(tok: Any) -> None:
    ids = tok(TEXT, add_special_tokens=False).input_ids
    full = tok.decode(ids)
    st_ = OutputState(1, tok, [], ("fox",), False, True)
    lps = [(-0.5, [(t, -0.5)]) for t in ids]
    c = st_.on_delta(fe.TokenDelta("r", 1, ids, "length", 0, None, lps, [], True, -3.0))
    assert c is not None and c.replace and c.text == full[:full.index("fox")]
    assert c.finish_reason == "stop" and c.stop_reason == "fox" and c.cumulative_logprob == -3.0
    assert tok.decode(c.token_ids).startswith(full[:full.index("fox") + 3])
    assert [t for t, _ in c.logprobs] == c.token_ids


# ---------------------------------------------------------------- engine path with a scripted engine
class ScriptedEngine:
    """Stands in for EngineClient: records requests; the test pushes deltas."""

    def __init__(self, vocab: int = 509) -> None:
        model = ModelInfo("fake", vocab, 512, (0,), 1, 1, 1, "float32", "cpu")
        self.info = fe.EngineInfo(0, model, 16, 65, 0, 8, 256)
        self.healthy = True
        self.accepting = True  # EngineClient.accepting: healthy, resuming or only slow to answer
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self.requests: list[fe.AddRequest] = []
        self.released: list[tuple[str, bool]] = []

    async def add_request(self, req: fe.AddRequest) -> asyncio.Queue[Any]:
        self.requests.append(req)
        q: asyncio.Queue[Any] = asyncio.Queue()
        self.queues[req.request_id] = q
        return q

    def push(self, d: fe.TokenDelta) -> None:
        self.queues[d.request_id].put_nowait((time.monotonic(), d))

    def release(self, rid: str, abort: bool) -> None:
        self.released.append((rid, abort))

    @property
    def num_streams(self) -> int:
        return len(self.queues)


def _svc(tok: Any, **cfg: Any) -> tuple[GenerationService, ScriptedEngine]:
    eng = ScriptedEngine()
    return GenerationService(eng, tok, FrontendConfig(**cfg)), eng  # type: ignore[arg-type]


def _req(svc: GenerationService, rid: str, **sampling: Any) -> Any:
    return svc.prepare(pb.GenerateRequest(request_id=rid, prompt="Hello there",
                                          sampling_params=pb.SamplingParams(**sampling)))


def test_every_sampling_field_reaches_the_engine(tok: Any) -> None:
    svc, eng = _svc(tok)
    req = _req(svc, "a", max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, n=2,
               stop_token_ids=[4], ignore_eos=True, min_tokens=2, repetition_penalty=1.2, presence_penalty=0.5,
               frequency_penalty=-0.5, logit_bias={5: 2.0}, logprobs=3, prompt_logprobs=1, length_penalty=0.5,
               early_stopping=True)
    p = req.prep.params
    assert (p.max_tokens, p.top_k, p.seed, p.n, p.stop_token_ids, p.ignore_eos, p.min_tokens) == (7, 5, 3, 2, (4,), True, 2)
    assert p.temperature == pytest.approx(0.5) and p.top_p == pytest.approx(0.9) and p.min_p == pytest.approx(0.1)
    assert p.repetition_penalty == pytest.approx(1.2) and p.presence_penalty == 0.5 and p.frequency_penalty == -0.5
    assert p.logit_bias == {5: 2.0} and p.logprobs == 3 and p.prompt_logprobs == 1
    assert p.length_penalty == 0.5 and p.early_stopping
    beam = _req(svc, "b", beam_width=4, n=2, temperature=0.0).prep.params
    assert beam.beam_width == 4 and beam.n == 2
    salted = svc.prepare(pb.GenerateRequest(prompt="x", cache_salt="tenant-1"))
    assert salted.cache_salt == "tenant-1"


def test_n_outputs_logprobs_and_beam_replace_are_mapped(tok: Any) -> None:
    from pagedserve.frontend.grpc_api.server import chunk_pb

    async def go() -> None:
        svc, eng = _svc(tok)
        s = await svc.open(_req(svc, "a", n=2, logprobs=1, max_tokens=2))
        eng.push(fe.TokenDelta("a", 0, [300], None, 2, None, [(-0.1, [(300, -0.1)])], [(-1.0, [(5, -0.5)])]))
        eng.push(fe.TokenDelta("a", 1, [301], None, 2, None, [(-0.2, [(7, -0.05)])]))
        chunks = await s.next()
        assert [c.index for c in chunks] == [0, 1] and s.prompt_logprobs == [(-1.0, [(5, -0.5)])]
        out = chunk_pb(chunks[1])
        assert out.token_ids == [301] and out.logprobs[0].logprob == pytest.approx(-0.2)
        assert out.logprobs[0].top_logprobs[0].token_id == 7
        eng.push(fe.TokenDelta("a", 0, [302], "length", 2, None, [(-0.3, [])]))
        eng.push(fe.TokenDelta("a", 1, [303], "length", 2, None, [(-0.4, [])]))
        last = await s.next()
        assert s.done and [c.finish_reason for c in last] == ["length", "length"]
        assert last[0].cumulative_logprob == pytest.approx(-0.4) and s.num_completion_tokens == 4
        s.close()
        assert eng.released[-1] == ("a", False)
        # Beam search: whole beams, replace=True, n of them.
        b = await svc.open(_req(svc, "b", beam_width=3, n=2, temperature=0.0, max_tokens=4))
        eng.push(fe.TokenDelta("b", 0, [300, 301], "length", 2, replace=True, cumulative_logprob=-1.5))
        eng.push(fe.TokenDelta("b", 1, [302, 303, 304], "length", 2, replace=True, cumulative_logprob=-2.5))
        beams = await b.next()
        assert b.done and [c.replace for c in beams] == [True, True]
        assert chunk_pb(beams[1]).cumulative_logprob == pytest.approx(-2.5)
        b.close()

    asyncio.run(go())


def test_queue_bound_and_per_key_cap(tok: Any) -> None:
    async def go() -> None:
        svc, eng = _svc(tok, max_queued_requests=2, max_concurrent_per_key=2)
        a = await svc.open(_req(svc, "a"))
        await svc.open(_req(svc, "b"))
        with pytest.raises(Rejected) as e:
            await svc.open(_req(svc, "c"))
        assert e.value.reason is RejectReason.QUEUE_FULL and "max_queued_requests=2" in str(e.value)
        eng.push(fe.TokenDelta("a", 0, [300]))  # a leaves the queue with its first token
        await a.next()
        await svc.open(_req(svc, "c"))
        a.close()
        assert ("a", True) in eng.released  # unfinished: aborted in the engine
        # Per key: two open streams for key k1 (after clearing the queue), the third refused, k2 still served.
        svc2, eng2 = _svc(tok, max_queued_requests=100, max_concurrent_per_key=2)
        await svc2.open(_req(svc2, "x1"), "k1")
        s2 = await svc2.open(_req(svc2, "x2"), "k1")
        with pytest.raises(Rejected) as e2:
            await svc2.open(_req(svc2, "x3"), "k1")
        assert e2.value.reason is RejectReason.KEY_CONCURRENCY
        await svc2.open(_req(svc2, "y1"), "k2")
        s2.close()
        await svc2.open(_req(svc2, "x3"), "k1")
        eng2.healthy = eng2.accepting = False  # a component recovers
        with pytest.raises(Rejected) as e3:
            await svc2.open(_req(svc2, "z"), "k3")
        assert e3.value.reason is RejectReason.UNAVAILABLE

    asyncio.run(go())


def test_api_keys(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# team keys\nkey-one-123\n\nkey-two-456\n")
    keys = load_keys("key-zero-789", str(f))
    ids = {keys.identify(f"Bearer {k}") for k in ("key-zero-789", "key-one-123", "key-two-456")}
    assert len(ids) == 3 and None not in ids
    assert "key-one" not in "".join(i for i in ids if i)  # ids never contain the key
    for bad in (None, "", "key-one-123", "Bearer key-one-12", "Basic key-one-123", "Bearer "):
        assert keys.identify(bad) is None
    assert not ApiKeys([]).enabled
    with pytest.raises(ValueError):
        load_keys("short", None)


def test_validation_errors_name_the_field(tok: Any) -> None:
    svc, _ = _svc(tok)
    with pytest.raises(ValidationError) as e:
        _req(svc, "a", logprobs=21)
    assert e.value.field == "sampling_params.logprobs" and "20" in str(e.value)
    big = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[300] * 2_200_000))
    with pytest.raises(ValidationError) as e2:
        svc.prepare(big)
    assert e2.value.field == "request" and "4194304" in str(e2.value)


def test_big_texts_tokenize_to_the_same_ids(tmp_path: Path) -> None:
    """The fast path for big texts (no offsets) gives the tokenizer's own ids."""
    from transformers import AutoTokenizer

    from pagedserve.frontend.core.generation import BIG_INPUT, GenerationService
    from pagedserve.frontend.core.prompt_bound import max_chars_per_token

    tok = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path, "llama", seed=0))
    svc = GenerationService(None, tok, None)  # type: ignore[arg-type]
    text = ("<|im_start|>user\nThe quick brown fox, café 東京 🙂 42\n<|im_end|> " * (BIG_INPUT // 40))[:BIG_INPUT + 999]
    for add in (True, False):
        assert svc.tokenize(text, add) == list(tok(text, add_special_tokens=add).input_ids)
    # The length bound holds: no text has fewer tokens than characters / the longest entry.
    per = max_chars_per_token(tok)
    assert per is not None and len(svc.tokenize(text)) * per >= len(text)


def test_no_length_bound_for_tokenizers_that_drop_characters() -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pagedserve.frontend.core.prompt_bound import max_chars_per_token

    def fast(t: Tokenizer) -> PreTrainedTokenizerFast:
        return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]")

    words = models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")
    ws = Tokenizer(words)
    ws.pre_tokenizer = pre_tokenizers.Whitespace()  # a million spaces are no tokens at all
    assert max_chars_per_token(fast(ws)) is None
    bpe = Tokenizer(models.BPE({"[UNK]": 0, "a": 1, "b": 2}, [], unk_token="[UNK]", fuse_unk=True))
    assert max_chars_per_token(fast(bpe)) is None  # a run of unknown characters is one token
    bpe2 = Tokenizer(models.BPE({"[UNK]": 0, "a": 1, "bb": 2}, [], unk_token="[UNK]", fuse_unk=False))
    bpe2.normalizer = normalizers.NFKC()
    assert max_chars_per_token(fast(bpe2)) == 5 * 4  # "[UNK]", with the composing margin
    bpe2.normalizer = normalizers.Strip()
    assert max_chars_per_token(fast(bpe2)) is None


