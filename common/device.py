"""``--device auto`` (the default, as ``vllm serve`` picks its platform): CUDA
when torch sees a GPU, else the CPU; and the CPU KV pool's size from vLLM's
``VLLM_CPU_KVCACHE_SPACE`` (GiB). torch is asked, in a child process, only
where a GPU device node exists, so a CPU machine decides at once."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

GIB = 1 << 30
# Device nodes a CUDA (or ROCm / WSL) GPU needs before torch can see it.
_GPU_NODES = ("/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd")


def resolve_device(device: str) -> tuple[str, str]:
    """``(device, why)``: ``auto`` becomes ``cuda`` or ``cpu``; any other value stays as given."""
    if device != "auto":
        return device, "--device"
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return "cpu", "auto: CUDA_VISIBLE_DEVICES hides every GPU"
    if not any(glob.glob(pattern) for pattern in _GPU_NODES):
        return "cpu", "auto: no GPU on this machine"
    # In a child process: CUDA initialised here would hold GPU memory in this process (the launcher
    # outlives the worker's profiling) and break CUDA in any process forked from it.
    code = ("import torch\nn = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
            "print(n, torch.cuda.get_device_name(0) if n else '')")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        count, _, name = r.stdout.strip().partition(" ")
        n = int(count)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return "cpu", "auto: torch could not be asked about GPUs"
    if n == 0:
        return "cpu", "auto: torch sees no CUDA GPU"
    return "cuda", f"auto: torch sees {n} GPU(s), {name}"


def cpu_kv_cache_space() -> int | None:
    """vLLM's ``VLLM_CPU_KVCACHE_SPACE`` in bytes (whole GiB, as vLLM reads it), or None when unset.
    As in vLLM's CPU platform, it sets the KV pool's size and overrides ``--kv-cache-memory-bytes``."""
    text = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if text == "":
        return None
    try:
        gib = int(text)
    except ValueError:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE: whole GiB, as vLLM reads it, got {text!r}") from None
    if gib < 1:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE: at least 1 (GiB of KV cache), got {gib}")
    return gib * GIB
