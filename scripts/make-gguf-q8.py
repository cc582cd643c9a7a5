#!/usr/bin/env python3
"""Write a Q8_0 GGUF file of a model given as another GGUF file (by default the
embedded SmolLM2-135M-Instruct Q4_1): every metadata key copied as it is
(architecture, tokenizer, chat template), every 2-D weight dequantized with
gguf-py and quantized again to Q8_0 (as llama.cpp's Q8_0 files hold them,
the norms stay F32). The tensors keep llama.cpp's order (q/k rows permuted
as the source file has them), so transformers and llama.cpp read it alike.

    scripts/make-gguf-q8.py [--src FILE.gguf] [--out OUT.gguf]

The default output is <cache>/SmolLM2-135M-Instruct.Q8_0.gguf (the cache
directory of ``pagedserve``: $PAGEDSERVE_CACHE or ~/.cache/pagedserve). About
20 s for SmolLM2 on an idle 2-core machine.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np


def default_out() -> Path:
    from pagedserve.common.default_model import cache_dir

    return cache_dir() / "SmolLM2-135M-Instruct.Q8_0.gguf"


def make_q8(src: str | os.PathLike[str], out: str | os.PathLike[str], qtype: str = "Q8_0") -> Path:
    """``src`` requantized into ``out`` (written next to it first, then renamed)."""
    import gguf

    quant = gguf.GGMLQuantizationType[qtype]
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header, written by the writer itself
        if name == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype}"])
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        weights = gguf.quants.dequantize(t.data, t.tensor_type)
        if weights.ndim == 2 and not t.name.endswith("norm.weight") and weights.shape[1] % 32 == 0:
            writer.add_tensor(t.name, gguf.quants.quantize(weights.astype(np.float32), quant), raw_dtype=quant)
        else:
            writer.add_tensor(t.name, np.ascontiguousarray(weights, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", help="the GGUF file to requantize (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("--out", help="where to write it (default: <cache>/SmolLM2-135M-Instruct.Q8_0.gguf)")
    args = p.parse_args(argv)
    from pagedserve.common.default_model import gguf_path

    src = args.src or str(gguf_path())
    out = make_q8(src, args.out or default_out())
    print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
