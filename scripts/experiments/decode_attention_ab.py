"""Decode attention over long contexts, this tree's CPU kernel against an
earlier commit's, in one process, calls interleaved (docs/kernels.md).

SmolLM2's geometry (9 heads, 3 KV heads, head_dim 64, 16-token blocks): 64
decoding sequences of 1,800 tokens whose first 62 blocks are (a) their own,
(b) one shared system prompt (the long workload of `bench peers` once its
prompt is cached), (c) two tables alternating (every block in L3: the
compute floor). The earlier kernel is built from `git show REV:kernels/...`
with the same compiler flags.

    .venv/bin/python scripts/experiments/decode_attention_ab.py [--rev 67460c5] [--reps 30]
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
from pagedserve.kernels.cpu_attention import DTYPE_CODES, KV_SAME, scale_ptr

ROOT = Path(__file__).resolve().parents[2]


def build_old(rev: str, folder: Path) -> ctypes.CDLL:
    for name in ("cpu_attention.cpp", "cpu_common.h", "cpu_scores.h", "cpu_cascade.h"):
        r = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kernels/{name}"], capture_output=True, text=True)
        if r.returncode == 0:
            (folder / name).write_text(r.stdout)
    cxx = cpu_build._compiler()
    obj, lib = folder / "a.o", folder / "libold.so"
    subprocess.run([cxx, *cpu_build.COMPILE, str(folder / "cpu_attention.cpp"), "-o", str(obj)], check=True)
    subprocess.run([cxx, str(obj), *cpu_build.LINK, "-o", str(lib)], check=True)
    dll = ctypes.CDLL(str(lib))  # after torch (imported above): its libgomp first, as cpu_build does
    dll.pagedserve_paged_attention.argtypes = cpu_build.SIGNATURES["pagedserve_paged_attention"]
    dll.pagedserve_paged_attention.restype = ctypes.c_int
    return dll


def call(lib: ctypes.CDLL, q, k, v, tables, lens, qsl, out) -> None:
    rc = lib.pagedserve_paged_attention(
        DTYPE_CODES[q.dtype], KV_SAME, q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        qsl.data_ptr(), out.data_ptr(), lens.numel(), q.shape[1], k.shape[2], q.shape[2], k.shape[1],
        tables.shape[1], q.stride(0), ctypes.c_float(q.shape[2] ** -0.5), scale_ptr(None), scale_ptr(None))
    assert rc == 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", default="67460c5", help="the earlier commit")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    torch.manual_seed(0)
    H, KVH, D, BS, N, ctx, shared_blocks = 9, 3, 64, 16, 64, 1800, 62
    nb = -(-ctx // BS)
    new = cpu_build.load()
    with tempfile.TemporaryDirectory() as tmp:
        old = build_old(args.rev, Path(tmp))
        for dtype in (torch.float32, torch.bfloat16):
            k = torch.randn(N * nb + 8, BS, KVH, D).to(dtype)
            v = torch.randn(N * nb + 8, BS, KVH, D).to(dtype)
            q = torch.randn(N, H, D).to(dtype)
            lens = torch.full((N,), ctx, dtype=torch.int32)
            qsl = torch.arange(N + 1, dtype=torch.int32)
            own = torch.randperm(N * nb + 8)[:N * nb].view(N, nb).to(torch.int32)
            shared = own.clone()
            shared[:, :shared_blocks] = own[0, :shared_blocks]
            alternating = own[torch.arange(N) % 2].contiguous()
            for name, tables in (("own blocks", own), ("shared 62-block prefix", shared), ("all in L3", alternating)):
                outs = {"new": torch.empty_like(q), "old": torch.empty_like(q)}
                times: dict[str, list[float]] = {"new": [], "old": []}
                for _ in range(args.reps):
                    for label, lib in (("old", old), ("new", new)):
                        t0 = time.perf_counter()
                        call(lib, q, k, v, tables, lens, qsl, outs[label])
                        times[label].append(time.perf_counter() - t0)
                diff = (outs["new"].float() - outs["old"].float()).abs().max().item()
                o, n = statistics.median(times["old"]) * 1e3, statistics.median(times["new"]) * 1e3
                print(f"{str(dtype)[6:]:9s} {name:24s} {args.rev}: {o:6.2f} ms  this tree: {n:6.2f} ms  "
                      f"{o / n:4.2f}x  (max |diff| {diff:.1e}; per layer, 30 a step)", flush=True)


if __name__ == "__main__":
    main()
