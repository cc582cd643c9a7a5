"""Seeded tiny random Hugging Face checkpoints for tests, built offline.

``make_tiny_model(tmp_dir, arch, seed)`` writes config.json, float32
safetensors, generation_config.json and a byte-level BPE tokenizer (trained
here on a small embedded corpus, so ``AutoTokenizer.from_pretrained`` works
without the network) and returns the folder. Shapes are deliberately odd
(GQA, head_dim != hidden / heads for Llama, tied embeddings for Qwen2) so a
forward that silently assumes the common case fails.
"""
from __future__ import annotations

import copy
import os
from typing import Any

import torch

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in fixed-size blocks,
so memory is allocated on demand and shared between sequences. The scheduler batches requests continuously:
new prompts join the running batch as soon as blocks are free. What is the capital of France? Paris is the
capital of France, and Berlin is the capital of Germany. Hello, world! Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100.
Once upon a time, a small model learned to count, to spell and to answer questions about cities and rivers.
Attention reads every cached token of the sequence through its block table; copy-on-write shares prompts.
Unicode too: café, naïve, 東京, Москва, emoji 🙂 and symbols like €, ±, → are split into bytes when needed.
"""

# Deliberately odd shapes; vocab_size > tokenizer size leaves unused rows, as real checkpoints do.
ARCHS: dict[str, dict[str, Any]] = {
    "llama": dict(
        hidden_size=60, num_attention_heads=6, num_key_value_heads=2, head_dim=12, intermediate_size=97,
        num_hidden_layers=3, vocab_size=509, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_theta=10000.0,
    ),
    "qwen2": dict(
        hidden_size=56, num_attention_heads=7, num_key_value_heads=1, intermediate_size=83,
        num_hidden_layers=2, vocab_size=509, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_theta=1000000.0,
    ),
    # The paper's model: learned positions, LayerNorm, ReLU; word_embed_proj_dim != hidden exercises project_in/out.
    "opt": dict(
        hidden_size=48, num_attention_heads=6, ffn_dim=91, num_hidden_layers=2, vocab_size=509,
        max_position_embeddings=512, word_embed_proj_dim=40, do_layer_norm_before=True,
    ),
    "gpt2": dict(n_embd=48, n_head=4, n_layer=2, n_inner=77, n_positions=512, vocab_size=509),
    # Today's families (issue 38). Sliding windows of at most 32 tokens, so short test prompts cross them.
    "qwen3": dict(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=71,
        num_hidden_layers=2, vocab_size=509, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_theta=1000000.0,
    ),
    "gemma3": dict(  # 5 sliding layers to 1 full, as Gemma 3 ships
        hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=71,
        num_hidden_layers=6, vocab_size=509, max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=16,
        query_pre_attn_scalar=24,  # != head_dim: a head_dim ** -0.5 scale would show
    ),
    "qwen3_moe": dict(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=71,
        moe_intermediate_size=28, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        num_hidden_layers=2, vocab_size=509, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "mixtral": dict(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=36,
        num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=509,
        max_position_embeddings=512, sliding_window=24, tie_word_embeddings=False,
    ),
    "phi3": dict(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=2, intermediate_size=71, num_hidden_layers=2,
        vocab_size=509, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "gpt_oss": dict(  # sliding (16) and full layers alternate; YaRN as the real model's, scaled down (4 x 128)
        hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
        num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=509,
        max_position_embeddings=512, sliding_window=16, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=128),
    ),
    # sliding window 64 on every layer
    "mistral": dict(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=71,
        num_hidden_layers=2, vocab_size=509, max_position_embeddings=512, sliding_window=64,
        tie_word_embeddings=False,
    ),
}


def _classes(arch: str) -> tuple[Any, Any]:
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "opt": (tf.OPTConfig, tf.OPTForCausalLM),
        "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
    }[arch]


def train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (any text encodes) wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token="<|im_start|>", pad_token=EOS, chat_template=CHAT_TEMPLATE
    )


def make_tiny_model(tmp_dir: str | os.PathLike[str], arch: str = "llama", seed: int = 0, **overrides: Any) -> str:
    """Write a seeded random ``arch`` (a key of ``ARCHS``: "llama", "qwen2",
    "opt", "gpt2", "mistral") checkpoint under
    ``tmp_dir`` and return its folder (reused if already written)."""
    from transformers import GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    suffix = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    folder = os.path.join(os.fspath(tmp_dir), f"tiny-{arch}-s{seed}" + (f"-{suffix}" if suffix else ""))
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    shape = copy.deepcopy({**ARCHS[arch], **overrides})  # config classes fill defaults into rope dicts in place
    tokenizer = train_tokenizer(min(shape["vocab_size"], 500))
    assert len(tokenizer) <= shape["vocab_size"]
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    config_cls, model_cls = _classes(arch)
    # A wide init keeps logits well separated, so greedy argmax is robust to rounding.
    config = config_cls(
        **shape, initializer_range=0.15, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id,
        pad_token_id=eos_id, dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).float().eval()
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
