"""Frozen configuration shared by every component.

Each component parses the same flags (so ``pagedserve serve`` can hand its
command line to every child, and compose can set them per service) and builds
one immutable ``EngineConfig``; nothing mutates it afterwards.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tempfile
from dataclasses import dataclass

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'512MiB', '2G', '1048576' -> bytes (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class Addresses:
    """ZeroMQ endpoints. The scheduler binds the two frontend-facing queues;
    blockmgr and gpuworker bind their request sockets."""

    scheduler_in: str
    scheduler_out: str
    blockmgr: str
    worker: str


def default_addresses(run_dir: str | None = None) -> Addresses:
    run_dir = run_dir or os.environ.get("PAGEDSERVE_RUN_DIR") or os.path.join(tempfile.gettempdir(), "pagedserve")
    return Addresses(
        scheduler_in=os.environ.get("PAGEDSERVE_SCHEDULER_IN", f"ipc://{run_dir}/scheduler_in.sock"),
        scheduler_out=os.environ.get("PAGEDSERVE_SCHEDULER_OUT", f"ipc://{run_dir}/scheduler_out.sock"),
        blockmgr=os.environ.get("PAGEDSERVE_BLOCKMGR", f"ipc://{run_dir}/blockmgr.sock"),
        worker=os.environ.get("PAGEDSERVE_WORKER", f"ipc://{run_dir}/worker.sock"),
    )


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    device: str = "cpu"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes; CPU default below
    gpu_memory_utilization: float = 0.90
    swap_space: float = 0.0  # GiB of CPU swap space
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None  # None: the model's own
    enable_prefix_caching: bool = True
    # Share of the KV blocks kept free when admitting (running sequences may
    # still grow into it). Above vLLM's 1 %: the serving simulation shows it
    # cuts recompute thrash under overload 4-5x (docs/serving-sim.md).
    kv_watermark: float = 0.05
    preemption_mode: str = "recompute"  # recompute | swap | auto
    attention_backend: str = "auto"  # auto: triton on CUDA, torch on CPU
    worker: str = "model"  # model | sim (SIMULATED: no model, cost-model step times)
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # no CUDA graphs
    seed: int = 0
    # frontend bounds
    max_prompt_chars: int = 1_000_000
    max_stop_ids: int = 64

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32, got {self.block_size}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be recompute, swap or auto, got {self.preemption_mode!r}")
        if not 0.0 <= self.kv_watermark < 0.5:
            raise ValueError(f"kv_watermark must be in [0, 0.5), got {self.kv_watermark}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.worker not in ("model", "sim"):
            raise ValueError(f"worker must be model or sim, got {self.worker!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2")

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", default=os.environ.get("PAGEDSERVE_MODEL"), help="local Hugging Face folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=os.environ.get("PAGEDSERVE_DEVICE", d.device))
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--block-size", type=int, default=d.block_size, choices=[8, 16, 32])
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--num-gpu-blocks", type=int, default=None)
    mem.add_argument("--kv-cache-memory", type=parse_size, default=None, help="bytes for the KV pool, e.g. 512MiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--swap-space", type=float, default=d.swap_space, help="GiB of CPU swap space")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--kv-watermark", type=float, default=d.kv_watermark,
                   help="share of KV blocks kept free when admitting new requests")
    p.add_argument("--preemption-mode", default=d.preemption_mode, choices=["recompute", "swap", "auto"])
    p.add_argument("--attention-backend", default=d.attention_backend, choices=["auto", "torch", "triton"])
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--enforce-eager", action="store_true", default=None, help="never capture CUDA graphs")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size)
    p.add_argument("--worker", default=d.worker, choices=["model", "sim"],
                   help="sim: a SIMULATED worker (no model; step times from a cost model)")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names and v is not None or k == "model"})


def add_address_args(p: argparse.ArgumentParser) -> None:
    d = default_addresses()
    p.add_argument("--scheduler-in", default=d.scheduler_in)
    p.add_argument("--scheduler-out", default=d.scheduler_out)
    p.add_argument("--blockmgr-addr", default=d.blockmgr)
    p.add_argument("--worker-addr", default=d.worker)


def addresses_from_args(args: argparse.Namespace) -> Addresses:
    return Addresses(args.scheduler_in, args.scheduler_out, args.blockmgr_addr, args.worker_addr)


def engine_argv(cfg: EngineConfig) -> list[str]:
    """The command-line flags that rebuild ``cfg`` in a child process."""
    out: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        v = getattr(cfg, f.name)
        if f.name in ("max_prompt_chars", "max_stop_ids") or v is None:
            continue
        if f.name == "enable_prefix_caching":
            if not v:
                out.append("--no-prefix-caching")
            continue
        if f.name == "enforce_eager":
            if v:
                out.append("--enforce-eager")
            continue
        out += ["--" + f.name.replace("_", "-"), str(v)]
    return out
