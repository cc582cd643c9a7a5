"""The CPU linears, this tree's ``kernels/cpu_linear.cpp`` against an earlier
commit's, in one process, calls interleaved (docs/gpuworker.md, "Linear layers").

Every linear of one SmolLM2 decode step (30 layers of qkv [960, 576], o [576,
576], gate_up [3072, 576], down [576, 1536], then the LM head [49152, 576]),
each weight its own (538 MB in fp32, more than the caches hold), at 1 to 256
rows. Each library packs its own copy of the same weights; the outputs must be
bit-identical (the arithmetic is the same, only the layout and prefetch differ).
The earlier kernel is built from `git show REV:kernels/...` with the same flags.

    .venv/bin/python scripts/experiments/linear_stream_ab.py [--rev 31fe556] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pagedserve.kernels import cpu_build

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
HEAD = (49152, 576)


def build(source_of: dict[str, str], folder: Path) -> ctypes.CDLL:
    for name, text in source_of.items():
        (folder / name).write_text(text)
    cxx = cpu_build._compiler()
    obj, lib = folder / "a.o", folder / "lib.so"
    subprocess.run([cxx, *cpu_build.COMPILE, str(folder / "cpu_linear.cpp"), "-o", str(obj)], check=True)
    subprocess.run([cxx, str(obj), *cpu_build.LINK, "-o", str(lib)], check=True)
    dll = ctypes.CDLL(str(lib))  # after torch (imported above): its libgomp first, as cpu_build does
    for fn in ("pagedserve_linear_pack", "pagedserve_linear"):
        getattr(dll, fn).argtypes = cpu_build.SIGNATURES[fn]
        getattr(dll, fn).restype = ctypes.c_int
    return dll


def sources(rev: str | None) -> dict[str, str]:
    out = {}
    for name in ("cpu_linear.cpp", "cpu_common.h"):
        if rev is None:
            out[name] = (ROOT / "kernels" / name).read_text()
        else:
            out[name] = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kernels/{name}"], check=True,
                                       capture_output=True, text=True).stdout
    return out


def pack_all(lib: ctypes.CDLL, code: int, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    packs = []
    for w in weights:
        n, k = w.shape
        p = torch.empty((-(-n // 16) * 16, k), dtype=w.dtype)
        assert lib.pagedserve_linear_pack(code, w.data_ptr(), p.data_ptr(), n, k) == 0
        packs.append(p)
    return packs


def step(lib: ctypes.CDLL, code: int, weights: list[torch.Tensor], packs: list[torch.Tensor],
         xs: dict[int, torch.Tensor], outs: dict[int, torch.Tensor]) -> None:
    for w, p in zip(weights, packs):
        n, k = w.shape
        x, y = xs[k], outs[n]
        assert lib.pagedserve_linear(code, x.data_ptr(), p.data_ptr(), None, y.data_ptr(), x.shape[0], n, k) == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="31fe556", help="the earlier commit")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", default="1,4,16,64,256")
    args = ap.parse_args()
    dtype, code = (torch.float32, 0) if args.dtype == "float32" else (torch.bfloat16, 1)
    torch.manual_seed(0)
    weights = [torch.randn(n, k).to(dtype) for _ in range(LAYERS) for n, k in SHAPES] + [torch.randn(*HEAD).to(dtype)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {}
        for name, rev in ((args.rev, args.rev), ("this tree", None)):
            folder = Path(tmp) / name.replace(" ", "_")
            folder.mkdir()
            libs[name] = build(sources(rev), folder)
        packs = {name: pack_all(lib, code, weights) for name, lib in libs.items()}
        print(f"{args.dtype}, {len(weights)} linears of one SmolLM2 decode step ({nbytes / 1e6:.0f} MB of weights), "
              f"torch threads {torch.get_num_threads()}; medians of interleaved calls")
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k).to(dtype) for k in {k for _, k in SHAPES}}
            outs = {name: {n: torch.empty(m, n, dtype=dtype) for n in {n for n, _ in [*SHAPES, HEAD]}} for name in libs}
            for name, lib in libs.items():
                step(lib, code, weights, packs[name], xs, outs[name])
            a, b = outs.values()
            identical = all(torch.equal(a[n], b[n]) for n in a)
            times: dict[str, list[float]] = {name: [] for name in libs}
            for _ in range(10 if m < 64 else 4):
                for name, lib in libs.items():
                    t = time.perf_counter()
                    step(lib, code, weights, packs[name], xs, outs[name])
                    times[name].append(time.perf_counter() - t)
            old, new = (statistics.median(v) for v in times.values())
            print(f"  {m:4d} rows: {args.rev} {old * 1e3:6.1f} ms ({nbytes / old / 1e9:4.1f} GB/s), this tree "
                  f"{new * 1e3:6.1f} ms ({nbytes / new / 1e9:4.1f} GB/s): {old / new:.2f}x, bit-identical {identical}")


if __name__ == "__main__":
    main()
