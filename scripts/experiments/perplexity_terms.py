"""Perplexity of one GGUF file on tests/test_quant_serve.py's text set, served five ways: dequantized
to fp32 (the reference) and to bf16, its blocks with bf16 activations in one int8 term and in two
(PAGEDSERVE_QUANT_BF16_TWO=1, read by this commit's quant_cpu.cpp only), and with fp32 activations.
An experiment, not kept: it measured what a second int8 term does for bf16 activations.

    python scripts/experiments/perplexity_terms.py Q8_0|Q4_1|gemma3-Q4_K_M
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WAYS = {"fp32 dequantized": ("float32", True, "0"), "bf16 dequantized": ("bfloat16", True, "0"),
        "bf16 blocks, one term": ("bfloat16", False, "0"), "bf16 blocks, two terms": ("bfloat16", False, "1"),
        "fp32 blocks, two terms": ("float32", False, "0")}


def one(which: str, dtype: str, dequantize: bool) -> float:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_quant_serve import accuracy_file, perplexity, runner, text_chunks
    from transformers import AutoTokenizer

    from pagedserve.common.default_model import resolve_model

    model = accuracy_file(which)
    chunks = text_chunks(AutoTokenizer.from_pretrained(resolve_model(model)))
    return perplexity(runner(model, blocks=40, dequantize=dequantize, dtype=dtype), chunks)


if __name__ == "__main__":
    if len(sys.argv) == 4:  # a child: one way, its environment set by the parent
        print(json.dumps(one(sys.argv[1], sys.argv[2], sys.argv[3] == "1")))
        sys.exit(0)
    which, ref = sys.argv[1], None
    for name, (dtype, deq, two) in WAYS.items():
        env = {**os.environ, "PAGEDSERVE_QUANT_BF16_TWO": two}
        out = subprocess.run([sys.executable, __file__, which, dtype, str(int(deq))], env=env, capture_output=True,
                             text=True, check=True).stdout
        ppl = float(out.strip().splitlines()[-1])
        ref = ref or ppl
        print(f"{which} {name}: {ppl:.4f} ({ppl / ref - 1:+.3%})", flush=True)
