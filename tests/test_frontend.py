"""The public gRPC API against the real four processes (one tiny-Llama server
for the module): every field's bound, stop strings over the wire, Abort,
deadlines, 200 cancelled streams, Tokenize/Detokenize, logprobs, n and beam
search vs transformers, health and reflection, the async client and CLI."""
from __future__ import annotations

import asyncio
import io
import random
import time
from collections.abc import Iterator
from contextlib import redirect_stdout
from typing import Any

import grpc
import pytest
import torch

from e2e_util import Server, serve, wait_all_free
from models import make_tiny_model
from pagedserve.client import AsyncGenerationClient, Collector, GenerationClient
from pagedserve.v1 import generation_pb2 as pb

PROMPT = "Once upon a time, a small model learned to count"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[Server]:
    with serve("--model", model_dir, "--num-gpu-blocks", "128", "--max-num-seqs", "16",
               env={"PAGEDSERVE_MAX_N": "4", "PAGEDSERVE_MAX_BEAM_WIDTH": "4"}) as s:
        yield s


@pytest.fixture(scope="module")
def tok(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()



# ---------------------------------------------------------------- bounds
# (request fields, sampling fields, text the error must contain: field name and bound)
BAD = [
    ({"prompt": ""}, {}, "prompt: must not be empty"),
    ({"no_prompt": True}, {}, "prompt: one of prompt, prompt_token_ids or messages is required"),
    ({"prompt": "x" * 1_000_001}, {}, "prompt: longer than 1000000 characters"),
    ({"prompt": "word " * 600}, {}, "max_model_len=512"),
    ({"prompt_token_ids": [1, 2, 509]}, {}, "prompt_token_ids: token id 509 is outside the vocabulary (vocab_size=509)"),
    ({"prompt_token_ids": [1] * 512}, {}, "prompt_token_ids: 512 tokens leaves no room"),
    ({"request_id": "x" * 129}, {}, "request_id: longer than 128"),
    ({"request_id": "a b"}, {}, "request_id: only letters"),
    ({"cache_salt": "s" * 129}, {}, "cache_salt: must have 1 to 128 characters, got 129"),
    ({}, {"max_tokens": 0}, "sampling_params.max_tokens: must be in [1, max_model_len=512], got 0"),
    ({}, {"max_tokens": 600}, "sampling_params.max_tokens: must be in [1, max_model_len=512], got 600"),
    ({}, {"temperature": -1.0}, "sampling_params.temperature: must be in [0.0, 2.0]"),
    ({}, {"temperature": float("nan")}, "sampling_params.temperature"),
    ({}, {"temperature": 2.5}, "sampling_params.temperature: must be in [0.0, 2.0], got 2.5"),
    ({}, {"top_p": 0.0}, "sampling_params.top_p: must be in [9.313225746154785e-10, 1.0]"),
    ({}, {"top_p": 1.5}, "sampling_params.top_p"),
    ({}, {"top_k": -2}, "sampling_params.top_k: must be in [-1, 2147483647], got -2"),
    ({}, {"min_p": 1.5}, "sampling_params.min_p: must be in [0.0, 1.0]"),
    ({}, {"seed": 2**63}, "sampling_params.seed: must be in [0, 9223372036854775807]"),
    ({}, {"n": 0}, "sampling_params.n: must be in [1, max_n=4]"),
    ({}, {"n": 5}, "sampling_params.n: must be in [1, max_n=4]"),
    ({}, {"beam_width": 5}, "sampling_params.beam_width: must be in [0, max_beam_width=4], got 5"),
    ({}, {"beam_width": 2, "n": 3}, "sampling_params.n: 3 exceeds beam_width=2"),
    ({}, {"length_penalty": 11.0}, "sampling_params.length_penalty: must be in [-10.0, 10.0]"),
    ({}, {"stop": ["s"] * 17}, "sampling_params.stop: at most 16 entries, got 17"),
    ({}, {"stop": [""]}, "sampling_params.stop: each entry must have 1 to 256 characters"),
    ({}, {"stop": ["x" * 257]}, "sampling_params.stop: each entry must have 1 to 256 characters"),
    ({}, {"max_tokens": 4, "min_tokens": 5}, "sampling_params.min_tokens: must be in [0, max_tokens=4], got 5"),
    ({}, {"stop_token_ids": list(range(65))}, "sampling_params.stop_token_ids: at most max_stop_ids=64 entries"),
    ({}, {"stop_token_ids": [100000]}, "sampling_params.stop_token_ids: token id 100000 is outside"),
    ({}, {"repetition_penalty": 0.0}, "sampling_params.repetition_penalty: must be in [9.313225746154785e-10, 10.0]"),
    ({}, {"presence_penalty": 2.5}, "sampling_params.presence_penalty: must be in [-2.0, 2.0]"),
    ({}, {"frequency_penalty": -2.5}, "sampling_params.frequency_penalty: must be in [-2.0, 2.0]"),
    ({}, {"logit_bias": {i: 1.0 for i in range(301)}}, "sampling_params.logit_bias: at most 300 entries"),
    ({}, {"logit_bias": {600: 1.0}}, "sampling_params.logit_bias: token id 600 is outside"),
    ({}, {"logit_bias": {5: 101.0}}, "sampling_params.logit_bias: each entry must be in [-100.0, 100.0]"),
    ({}, {"logprobs": 21}, "sampling_params.logprobs: must be in [0, 20], got 21"),
    ({}, {"prompt_logprobs": 21}, "sampling_params.prompt_logprobs: must be in [0, 20], got 21"),
    ({"prompt_token_ids": [300] * 2_200_000}, {}, "request: 4400"),
]


@pytest.mark.parametrize("fields,sampling,message", BAD, ids=[m[:48] for _, _, m in BAD])
def test_every_bound_is_invalid_argument_and_server_keeps_serving(
        server: Server, fields: dict[str, Any], sampling: dict[str, Any], message: str) -> None:
    req = pb.GenerateRequest(request_id=fields.get("request_id", ""), cache_salt=fields.get("cache_salt", ""),
                             sampling_params=pb.SamplingParams(**sampling))
    if "prompt_token_ids" in fields:
        req.prompt_token_ids.ids.extend(fields["prompt_token_ids"])
    elif not fields.get("no_prompt"):
        req.prompt = fields.get("prompt", "Hello")
    with server.client() as c:
        with pytest.raises(grpc.RpcError) as err:
            list(c.stub.Generate(req, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert message in err.value.details()
        ids, _, reason = c.generate("Hello", max_tokens=2, temperature=0.0)
        assert len(ids) >= 1 and reason in ("stop", "length")


def test_other_rpcs_bounds(server: Server) -> None:
    with server.client() as c:
        for call, req, msg in [
            (c.stub.Tokenize, pb.TokenizeRequest(text=""), "text: must not be empty"),
            (c.stub.Detokenize, pb.DetokenizeRequest(token_ids=[509]), "token_ids: token id 509 is outside"),
            (c.stub.Abort, pb.AbortRequest(request_ids=["x"] * 1025), "request_ids: at most 1024"),
            (c.stub.Abort, pb.AbortRequest(request_ids=["bad id"]), "request_ids: only letters"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                call(req, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and msg in err.value.details()


# ---------------------------------------------------------------- stop strings over the wire
def test_stop_strings_split_across_tokens_and_chunks_never_reach_the_client(server: Server, tok: Any) -> None:
    with server.client() as c:
        ids, full, _ = c.generate(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True)
        assert len(ids) == 40
        # Stop strings that start inside one token and end in a later one, at several places.
        offsets = []
        pos = 0
        for t in ids:
            pos += len(c.detokenize([t]))
            offsets.append(pos)
        picked = []
        for end_tok in (5, 12, 20, 30):
            start = offsets[end_tok - 2] - 1  # last char of the token before ...
            stop = full[start:offsets[end_tok - 1] + 1]  # ... through the first char after this one
            if len(stop) >= 3 and full.find(stop) == start:
                picked.append(stop)
        assert len(picked) >= 2, (full, offsets)
        chunked = 0
        for stop in picked:
            i = full.index(stop)
            sent = ""
            messages = 0
            reason = stop_reason = ""
            for resp in c.stream(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop]):
                for out in resp.outputs:
                    sent += out.text
                    messages += 1
                    assert full[:i].startswith(sent), f"text past the stop string {stop!r} reached the client"
                    reason, stop_reason = out.finish_reason or reason, out.stop_reason or stop_reason
            assert sent == full[:i] and reason == "stop" and stop_reason == stop
            chunked += messages > 1
            # A stop string that never completes: the held text is released at the end.
            never = stop + "\u2603"
            _, text, reason2 = c.generate(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True, stop=[never])
            assert text == full and reason2 == "length"
        # The frontend merges whatever is queued into one message, so on a loaded machine a short stream
        # can arrive whole; the held-back path across messages must still have run for some stop.
        assert chunked >= 1, "every stream arrived as one message: the split across chunks was not exercised"
    wait_all_free(server)



def test_detokenize_false_streams_the_same_ids_without_text(server: Server) -> None:
    # vLLM's SamplingParams.detokenize: ids only (what bench peers asks of every engine).
    with server.client() as c:
        ids, text, _ = c.generate(PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True)
        assert text
        got, texts = [], []
        for resp in c.stream(PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True, detokenize=False):
            for out in resp.outputs:
                got += out.token_ids
                texts.append(out.text)
        assert got == ids and not any(texts)
        beams = c.generate_all(PROMPT, max_tokens=8, beam_width=2, n=2, detokenize=False)
        assert all(not r[1] and len(r[0]) == 8 for r in (beams.result(0), beams.result(1)))
        with pytest.raises(grpc.RpcError) as err:
            c.generate(PROMPT, max_tokens=4, detokenize=False, stop=["x"])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "detokenize" in err.value.details()
    wait_all_free(server)

# ---------------------------------------------------------------- abort, deadlines, cancellation
def test_abort_rpc_ends_the_stream_with_abort(server: Server) -> None:
    with server.client() as c, server.client() as c2:
        stream = c.stream(PROMPT, max_tokens=400, temperature=0.0, ignore_eos=True, request_id="to-abort-1")
        first = next(stream)
        assert first.request_id == "to-abort-1"
        assert c2.abort("to-abort-1", "unknown-id") == 1
        reasons = [o.finish_reason for r in stream for o in r.outputs]
        assert reasons[-1] == "abort"
    wait_all_free(server)


def test_deadline_is_honoured_and_frees_blocks(server: Server) -> None:
    args = dict(max_tokens=480, temperature=0.0, ignore_eos=True)
    with server.client() as c:
        # The deadline is a quarter of what the same request takes here, so it ends mid-stream
        # on a fast machine too (a fixed 0.5 s was longer than all 480 tokens once steps sped up).
        t0 = time.monotonic()
        for _ in c.stream(PROMPT, **args):
            pass
        whole = time.monotonic() - t0
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for _ in c.stream(PROMPT, timeout=max(0.02, whole / 4), **args):
                pass
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 5
    wait_all_free(server)


def test_200_streams_cancelled_at_random_points_free_everything(server: Server) -> None:
    rng = random.Random(7)
    plans = [rng.choice([0, 0, 1, 2, 3, 5, 8, 13]) for _ in range(200)]

    async def one(client: AsyncGenerationClient, i: int, after: int) -> int:
        call = client.stream(f"{PROMPT} {i}", max_tokens=200, temperature=1.0, seed=i, ignore_eos=True)
        seen = 0
        if after == 0:
            await asyncio.sleep(rng.random() * 0.05)  # sometimes before the engine saw it
            call.cancel()
            return 0
        async for resp in call:
            seen += sum(len(o.token_ids) for o in resp.outputs)
            if seen >= after:
                call.cancel()
                break
        return seen

    async def go() -> list[int]:
        async with AsyncGenerationClient(server.addr) as client:
            sem = asyncio.Semaphore(40)

            async def limited(i: int, after: int) -> int:
                async with sem:
                    return await one(client, i, after)

            return await asyncio.gather(*(limited(i, a) for i, a in enumerate(plans)))

    seen = asyncio.run(go())
    assert sum(s > 0 for s in seen) > 100
    info = wait_all_free(server, timeout_s=60)
    assert info.num_requests_in_flight == 0


# ---------------------------------------------------------------- other RPCs
def test_tokenize_detokenize_match_the_tokenizer(server: Server, tok: Any) -> None:
    text = "Unicode too: café, naïve, 東京"
    with server.client() as c:
        ids = c.tokenize(text)
        assert ids == tok(text).input_ids
        assert c.tokenize("<|im_start|>hi", add_special_tokens=False) == tok("<|im_start|>hi",
                                                                              add_special_tokens=False).input_ids
        assert c.detokenize(ids) == tok.decode(ids, skip_special_tokens=True)
        assert c.detokenize([1] + ids, skip_special_tokens=False) == tok.decode([1] + ids)


def test_model_and_server_info(server: Server) -> None:
    with server.client() as c:
        m = c.model_info()
        s = c.server_info()
    assert (m.vocab_size, m.max_model_len, m.block_size) == (509, 512, 16)
    assert s.num_gpu_blocks == 127 and s.max_num_seqs == 16 and s.model_name == m.model_name
    assert (s.max_n, s.max_beam_width, s.max_queued_requests) == (4, 4, 1024)
    assert not s.auth_enabled and not s.tls_enabled and s.device == "cpu"


def test_health_and_reflection(server: Server) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server.addr) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for name in ("", "pagedserve.v1.Generation"):
            assert h.Check(health_pb2.HealthCheckRequest(service=name)).status == \
                health_pb2.HealthCheckResponse.SERVING
        r = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
        assert {"pagedserve.v1.Generation", "grpc.health.v1.Health"} <= names


# ---------------------------------------------------------------- logprobs, n, beam vs transformers
def test_logprobs_and_prompt_logprobs_equal_transformers(server: Server, tok: Any, hf: Any) -> None:
    prompt_ids = tok(PROMPT).input_ids
    with server.client() as c:
        col = Collector()
        responses = list(c.stream(prompt_ids, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3,
                                  prompt_logprobs=2))
        for r in responses:
            col.add(r)
    ids, _, _ = col.result(0)
    lps = [lp for r in responses for o in r.outputs for lp in o.logprobs]
    assert [lp.token_id for lp in lps] == ids and len(ids) == 6
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + ids])).logits[0].double()
    ref = torch.log_softmax(logits, -1)
    for j, lp in enumerate(lps):
        row = ref[len(prompt_ids) - 1 + j]
        assert lp.logprob == pytest.approx(row[ids[j]].item(), abs=1e-3)
        assert len(lp.top_logprobs) == 3 and lp.top_logprobs[0].token_id == ids[j]  # greedy: the top one
        assert [t.token_id for t in lp.top_logprobs] == row.topk(3).indices.tolist()
    plp = responses[0].prompt_logprobs
    assert [p.token_id for p in plp] == prompt_ids[1:]
    for j, p in enumerate(plp):
        assert p.logprob == pytest.approx(ref[j, prompt_ids[j + 1]].item(), abs=1e-3)
        assert len(p.top_logprobs) == 2
    final = [o for r in responses for o in r.outputs if o.finish_reason][-1]
    assert final.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in lps), abs=1e-3)


def test_n_outputs_and_beam_search_over_grpc(server: Server, tok: Any, hf: Any) -> None:
    prompt_ids = tok(PROMPT).input_ids
    with server.client() as c:
        col = c.generate_all(prompt_ids, max_tokens=8, temperature=1.0, seed=11, n=3, ignore_eos=True)
        outs = col.results()
        assert len(outs) == 3 and all(len(o[0]) == 8 and o[2] == "length" for o in outs)
        assert len({tuple(o[0]) for o in outs}) > 1  # independent samples
        assert col.usage is not None and col.usage.completion_tokens == 24
        beams = c.generate_all(prompt_ids, max_tokens=6, temperature=0.0, beam_width=3, n=2).results()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=6, num_beams=3, num_return_sequences=2,
                          do_sample=False, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    assert len(beams) == 2
    assert beams[0][0] == ref[0, len(prompt_ids):].tolist()[:len(beams[0][0])]
    assert beams[0][1] == tok.decode(beams[0][0], skip_special_tokens=True)
    wait_all_free(server)


# ---------------------------------------------------------------- clients
def test_async_client_and_cli_match_the_sync_client(server: Server) -> None:
    from pagedserve.client import main as cli_main

    with server.client() as c:
        want = c.generate(PROMPT, max_tokens=10, temperature=0.0)

    async def go() -> Any:
        async with AsyncGenerationClient(server.addr) as ac:
            return await ac.generate(PROMPT, max_tokens=10, temperature=0.0), await ac.tokenize("hi")

    got, ids = asyncio.run(go())
    assert got == want and ids
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli_main([PROMPT, "--addr", server.addr, "--max-tokens", "10"]) == 0
    assert buf.getvalue() == want[1] + "\n"


def test_client_without_server_fails_cleanly() -> None:
    with GenerationClient("127.0.0.1:1") as c:
        with pytest.raises(grpc.RpcError) as err:
            c.model_info()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
