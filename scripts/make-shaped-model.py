#!/usr/bin/env python3
"""Writes a Hugging Face folder with seeded random weights of a named shape,
for benchmarks that need a model of today's families that this machine can
run (docs/benchmarks.md): config from transformers' own config class, the
embedded SmolLM2's tokenizer (so every engine tokenizes alike), safetensors.

    scripts/make-shaped-model.py qwen3-moe OUT_DIR   # 8 experts, top-2
    scripts/make-shaped-model.py gemma3 OUT_DIR      # 5 sliding layers (512) to 1 full
    scripts/make-shaped-model.py llama-1b OUT_DIR --dtype bfloat16   # issue 40's 1B shape
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Qwen3-30B-A3B's layout scaled to two cores: 8 experts, top-2, q/k norm.
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64, intermediate_size=1024,
        moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=8,
        max_position_embeddings=4096, rope_theta=1000000.0, tie_word_embeddings=False)),
    # Gemma 3 270M's layout: 18 layers, 5 sliding (window 512) to 1 full, head_dim 256, one KV head.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=640, num_attention_heads=4, num_key_value_heads=1, head_dim=256, intermediate_size=2048,
        num_hidden_layers=18, sliding_window=512, query_pre_attn_scalar=256, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, max_position_embeddings=32768)),
    # Llama 3.2 1B's layout (issue 40's realistic size): 16 layers, hidden 2048, 32 heads, 8 KV heads.
    "llama-1b": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=8192,
        num_hidden_layers=16, rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=True)),
    # Gemma 3's layer pattern at a size whose prefills are cheap here, for KV-limited serving runs.
    "gemma3-small": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=64, intermediate_size=512,
        num_hidden_layers=6, sliding_window=128, query_pre_attn_scalar=64, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, max_position_embeddings=4096)),
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the saved weights' dtype")
    args = p.parse_args(argv)
    import torch
    import transformers as tf

    from pagedserve.common.default_model import resolve_model

    tok_dir = resolve_model(None)  # the embedded SmolLM2, converted once
    tokenizer = tf.AutoTokenizer.from_pretrained(tok_dir)
    config_cls, model_cls, shape = SHAPES[args.shape]
    config = getattr(tf, config_cls)(**shape, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                                     dtype="float32")
    torch.manual_seed(args.seed)
    model = getattr(tf, model_cls)(config).float().eval().to(getattr(torch, args.dtype))
    model.config.dtype = args.dtype  # config.json's torch_dtype, which every engine's "auto" reads
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    for name in os.listdir(tok_dir):
        if name.startswith(("tokenizer", "special_tokens", "generation_config")) or name.endswith(".jinja"):
            shutil.copy(os.path.join(tok_dir, name), args.out)
    n = sum(t.numel() for t in model.parameters())
    print(f"{args.shape}: {n / 1e6:.0f} M parameters in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
