"""``pagedserve bench kernel``: the Triton paged-attention kernel against a
device-to-device copy and against contiguous SDPA, measured in the same run.

Default geometry is Llama-3-8B's (32 query heads, 8 KV heads, head_dim 128,
bf16, block 16). Decode points are batch x context; prefill points are
batch x prompt length (fresh prefill, causal). Per point:

  us          kernel time, ``triton.testing.do_bench`` median (L2 flushed)
  GB/s        (K/V bytes actually read + q + out) / time
  vs_copy     that bandwidth / the bandwidth of ``copy_`` of the same K/V
              bytes (read + write counted), measured here: ~1 is copy speed
  sdpa_us     ``scaled_dot_product_attention`` on the same K/V laid out
              contiguously (decode: the query group folded into the query
              length, so K/V are read once, as here; prefill: enable_gqa)
  vs_sdpa     sdpa_us / us (> 1: the paged kernel is faster)

On CPU it runs a tiny configuration in the Triton interpreter so CI proves
the script works; those timings say nothing about performance.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from pagedserve.common.blocks import cdiv

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        b, n = item.lower().split("x")
        out.append((int(b), int(n)))
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve bench kernel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", type=_ints, default=None, help="decode batch sizes, e.g. 1,16,64,256")
    p.add_argument("--contexts", type=_ints, default=None, help="decode context lengths, e.g. 512,2048,8192")
    p.add_argument("--prefill", type=_pairs, default=None, help="prefill points BATCHxLEN, e.g. 1x2048,4x1024")
    p.add_argument("--num-heads", type=int, default=None)
    p.add_argument("--num-kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32])
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time per measurement")
    p.add_argument("--seed", type=int, default=0)
    return p


def _defaults(args: argparse.Namespace, cuda: bool) -> None:
    full = dict(batches=[1, 16, 64, 256], contexts=[512, 2048, 8192], prefill=[(1, 512), (1, 2048), (1, 8192), (8, 2048)],
                num_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    tiny = dict(batches=[1, 3], contexts=[40, 100], prefill=[(2, 24)], num_heads=4, num_kv_heads=2, head_dim=64,
                dtype="float32")
    for k, v in (full if cuda else tiny).items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def _timer(cuda: bool, rep_ms: int) -> Callable[[Callable[[], object]], float]:
    """Median seconds per call."""
    if cuda:
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e-3

    def cpu_time(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return cpu_time


def _build(batch: int, lens: list[int], args: argparse.Namespace, device: str, gen: torch.Generator):
    """A shuffled block pool holding every sequence's K/V, plus the same K/V
    contiguous as [batch, kv_heads, len, head_dim] for SDPA."""
    dtype, kv, d, bs = DTYPES[args.dtype], args.num_kv_heads, args.head_dim, args.block_size
    max_len = max(lens)
    per_seq = cdiv(max_len, bs)
    num_blocks = batch * per_seq
    perm = torch.randperm(num_blocks, generator=gen).to(device)
    block_tables = perm.view(batch, per_seq).to(torch.int32)
    k_contig = torch.randn(batch, kv, per_seq * bs, d, device=device, dtype=dtype)
    v_contig = torch.randn(batch, kv, per_seq * bs, d, device=device, dtype=dtype)
    k_cache = torch.empty(num_blocks, bs, kv, d, device=device, dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    # contiguous [b, kv, pos, d] -> blocks [b, per_seq, bs, kv, d] -> shuffled physical blocks
    k_cache[block_tables.long().flatten()] = k_contig.permute(0, 2, 1, 3).reshape(num_blocks, bs, kv, d)
    v_cache[block_tables.long().flatten()] = v_contig.permute(0, 2, 1, 3).reshape(num_blocks, bs, kv, d)
    return k_cache, v_cache, block_tables, k_contig[:, :, :max_len], v_contig[:, :, :max_len]


def _point(kind: str, batch: int, length: int, args, device: str, timer, gen) -> dict:
    from pagedserve.kernels import paged_attention

    dtype, h, kv, d = DTYPES[args.dtype], args.num_heads, args.num_kv_heads, args.head_dim
    elt = torch.finfo(dtype).bits // 8
    q_len = 1 if kind == "decode" else length
    k_cache, v_cache, block_tables, k_c, v_c = _build(batch, [length] * batch, args, device, gen)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    qsl = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=device)
    q = torch.randn(batch * q_len, h, d, device=device, dtype=dtype)
    out = torch.empty_like(q)
    scale = d ** -0.5
    hints = dict(max_seq_len=length, max_query_len=q_len)
    t_kernel = timer(lambda: paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, scale, out, **hints))
    paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, scale, out, **hints)

    t_sdpa, diff = _sdpa(kind, q, out, k_c, v_c, scale, timer)
    del k_c, v_c

    kv_bytes = 2 * batch * length * kv * d * elt
    io_bytes = kv_bytes + 2 * q.numel() * elt
    k_dst, v_dst = torch.empty_like(k_cache), torch.empty_like(v_cache)
    t_copy = timer(lambda: (k_dst.copy_(k_cache), v_dst.copy_(v_cache)))
    copy_bw = 2 * (k_cache.numel() + v_cache.numel()) * elt / t_copy  # read + write
    bw = io_bytes / t_kernel
    flops = 4 * batch * h * d * (q_len * length - q_len * (q_len - 1) // 2)  # causal pairs x (QK + PV)
    return dict(kind=kind, batch=batch, len=length, us=t_kernel * 1e6, gbps=bw / 1e9, copy_gbps=copy_bw / 1e9,
                vs_copy=bw / copy_bw, sdpa_us=t_sdpa * 1e6, vs_sdpa=t_sdpa / t_kernel, tflops=flops / t_kernel / 1e12,
                max_abs_diff_vs_sdpa=diff)


def _sdpa(kind: str, q: torch.Tensor, out: torch.Tensor, k_c: torch.Tensor, v_c: torch.Tensor, scale: float,
          timer) -> tuple[float, float]:
    """Time SDPA on contiguous K/V [batch, kv_heads, len, head_dim]; also
    return its largest difference from the paged kernel's ``out``."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    batch, kv, length, d = k_c.shape
    h = q.shape[1]
    if kind == "decode":
        # head = kv_head * group + g, so the group folds into the query length.
        q_s = q.view(batch, kv, h // kv, d)
        run = lambda: sdpa(q_s, k_c, v_c, scale=scale)  # noqa: E731
        ref = run().reshape(batch, h, d)
    else:
        q_s = q.view(batch, length, h, d).transpose(1, 2)
        try:
            sdpa(q_s, k_c, v_c, is_causal=True, scale=scale, enable_gqa=True)
            run = lambda: sdpa(q_s, k_c, v_c, is_causal=True, scale=scale, enable_gqa=True)  # noqa: E731
        except (TypeError, RuntimeError):  # older torch: expand the KV heads
            k_c, v_c = k_c.repeat_interleave(h // kv, 1), v_c.repeat_interleave(h // kv, 1)
            run = lambda: sdpa(q_s, k_c, v_c, is_causal=True, scale=scale)  # noqa: E731
        ref = run().transpose(1, 2).reshape(batch * length, h, d)
    diff = (out.float() - ref.float()).abs().max().item()
    return timer(run), diff


def _fits(batch: int, length: int, args, device: str) -> bool:
    if device == "cpu":
        return True
    elt = torch.finfo(DTYPES[args.dtype]).bits // 8
    kv_bytes = 2 * batch * (cdiv(length, args.block_size) * args.block_size) * args.num_kv_heads * args.head_dim * elt
    free, _ = torch.cuda.mem_get_info()
    return 4 * kv_bytes < 0.8 * free  # pool, contiguous copy, a transient, the copy target


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("CUDA requested but not available")
        return 2
    _defaults(args, cuda)
    if args.num_heads % args.num_kv_heads:
        print("--num-heads must be a multiple of --num-kv-heads")
        return 2
    if cuda:
        machine = torch.cuda.get_device_name()
        print(f"bench kernel on {machine}, torch {torch.__version__}")
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        machine = f"CPU ({platform.processor() or platform.machine()}), Triton interpreter"
        print("bench kernel on CPU: tiny configuration in the Triton interpreter; the timings only prove the "
              "script runs and say nothing about kernel performance")
    import triton

    print(f"geometry: {args.num_heads} q heads, {args.num_kv_heads} kv heads, head_dim {args.head_dim}, "
          f"{args.dtype}, block {args.block_size}; triton {triton.__version__}")
    timer = _timer(cuda, args.rep_ms)
    gen = torch.Generator().manual_seed(args.seed)
    points = [("decode", b, c) for b in args.batches for c in args.contexts]
    points += [("prefill", b, n) for b, n in args.prefill]
    results, skipped = [], []
    header = f"{'kind':8}{'batch':>6}{'len':>7}{'us':>10}{'GB/s':>9}{'vs_copy':>9}{'sdpa_us':>10}{'vs_sdpa':>9}{'TFLOP/s':>9}"
    print(header)
    for kind, b, n in points:
        if not _fits(b, n, args, args.device):
            skipped.append(dict(kind=kind, batch=b, len=n, reason="exceeds free device memory"))
            print(f"{kind:8}{b:>6}{n:>7}  skipped: exceeds free device memory")
            continue
        r = _point(kind, b, n, args, args.device, timer, gen)
        results.append(r)
        print(f"{kind:8}{b:>6}{n:>7}{r['us']:>10.1f}{r['gbps']:>9.1f}{r['vs_copy']:>9.2f}"
              f"{r['sdpa_us']:>10.1f}{r['vs_sdpa']:>9.2f}{r['tflops']:>9.2f}")
        if cuda:
            torch.cuda.empty_cache()
    print(json.dumps(dict(bench="kernel", machine=machine, mode="cuda" if cuda else "interpreter",
                          torch=torch.__version__, triton=triton.__version__,
                          geometry=dict(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                                        head_dim=args.head_dim, dtype=args.dtype, block_size=args.block_size),
                          points=results, skipped=skipped)))
    return 0
