"""prompt_logprobs ranks as vLLM 0.32 gives them, over the real four processes:
the prompt token's vocabulary rank (how many logprobs are >= its own, vLLM's
``batched_count_greater_than``) even when it is outside the top k, checked
against a float64 forward of transformers' own model; and the messages still
decode from a peer that sends no ranks."""
from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator

import msgspec
import pytest
import torch

from e2e_util import Server, serve
from models import make_tiny_model
from pagedserve.common.messages.frontend import TokenDelta
from pagedserve.common.messages.worker import PromptLogprobs

TOL = 1e-4  # float32 (ours) against float64 (the reference): closer logprobs are a tie either way


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)


@pytest.fixture(scope="module")
def srv(model_dir: str) -> Iterator[Server]:
    with serve("--model", model_dir, "--num-gpu-blocks", "64") as s:
        yield s


def reference_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    """float64 log_softmax of transformers' logits: row i scores ids[i + 1]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)[:-1]


def test_prompt_token_rank_is_its_vocabulary_rank(srv: Server, model_dir: str) -> None:
    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    rng = random.Random(7)
    ids = [rng.randrange(3, min(vocab, 500)) for _ in range(40)]  # random tokens: mostly not the model's top one
    body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1}
    req = urllib.request.Request(srv.http + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        plp = json.load(r)["choices"][0]["prompt_logprobs"]
    ref = reference_logprobs(model_dir, ids)
    assert len(plp) == len(ids) and plp[0] is None
    outside = 0
    for i, (tok, entry) in enumerate(zip(ids[1:], plp[1:])):
        row, x = ref[i], ref[i][tok].item()
        top = int(row.argmax())
        # vLLM's shape: the prompt token and the top one, each {logprob, rank, decoded_token}.
        assert set(entry) == {str(tok), str(top)}
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        assert entry[str(top)]["rank"] == 1
        rank = entry[str(tok)]["rank"]
        assert isinstance(rank, int), f"position {i + 1}: rank {rank!r}"
        lo, hi = int((row > x + TOL).sum()) + 1, int((row >= x - TOL).sum())
        assert lo <= rank <= hi, f"position {i + 1}: rank {rank}, reference {lo}..{hi}"
        assert abs(entry[str(tok)]["logprob"] - x) < TOL
        outside += rank > 1
    assert outside >= len(ids) // 2  # the ranks checked are mostly outside the top one


def test_messages_decode_without_ranks() -> None:
    """An older worker / scheduler sends no ranks: they decode as empty (the frontend prints null)."""
    old = msgspec.msgpack.encode([5, 1, [[-1.5, [[3, -0.5]]]]])
    assert msgspec.msgpack.decode(old, type=PromptLogprobs).ranks == []
    new = msgspec.msgpack.encode(PromptLogprobs(5, 1, [(-1.5, [(3, -0.5)])], [4]))
    assert msgspec.msgpack.decode(new, type=PromptLogprobs).ranks == [4]
    delta = msgspec.msgpack.decode(msgspec.msgpack.encode(["r", 0, [1]]), type=TokenDelta)
    assert delta.prompt_logprob_ranks == []
