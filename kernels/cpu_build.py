"""Builds and loads the CPU kernel library: PagedAttention (``cpu_attention.cpp``),
the fused per-layer ops (``cpu_ops.cpp``), the linear layers over packed
panels (``cpu_linear.cpp``) and a Llama decoder stack over all of them in one
call (``cpu_model.cpp``), sharing ``cpu_common.h``.

Compiled once per source, compiler and CPU into a cache folder
(``<folder>/<hash>/``) with ``-march=native``, so a cache shared between
machines never runs code built for another CPU. The kernels read no
configuration: the worker passes the folder (``$PAGEDSERVE_CACHE/kernels``)
and the ``PAGEDSERVE_CPU_KERNEL`` switch in with ``configure`` at start-up.
Processes that build at the same time each write a private file and rename it
into place.
Without a compiler ``load()`` returns None and callers use the torch path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = (HERE / "cpu_attention.cpp", HERE / "cpu_ops.cpp", HERE / "cpu_linear.cpp", HERE / "cpu_model.cpp",
           HERE / "quant_cpu.cpp", HERE / "quant_pack.cpp", HERE / "quant_bf16.cpp", HERE / "cpu_coded.cpp")
HEADERS = (HERE / "cpu_common.h", HERE / "cpu_scores.h", HERE / "cpu_cascade.h", HERE / "cpu_bf16.h", HERE / "cpu_rows.h",
           HERE / "quant_blocks.h", HERE / "cpu_panels.h")
# Compiled with fast math (vectorised expf, reassociated sums) but linked
# without it: a -ffast-math link adds crtfastmath, whose constructor turns on
# flush-to-zero for the whole process (hypothesis caught that).
COMPILE = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-fPIC", "-std=c++17", "-c")
LINK = ("-shared", "-fopenmp", "-lmvec", "-lm")
FLAGS = COMPILE + LINK
ENV = "CPU_KERNEL"  # PAGEDSERVE_CPU_KERNEL=0: never build or use the compiled kernel (read by the worker)
DISABLE_ENV = "PAGEDSERVE_" + ENV

_ptr, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# ctypes argument types of every entry point (the scripts that load an older build reuse them).
SIGNATURES = {
    "pagedserve_paged_attention_ex": [_i32, _i32, *[_ptr] * 7, *[_i32] * 6, _i64, _f32, _ptr, _ptr, _i32, _f32],
    "pagedserve_cascade_groups": [_ptr, _i32, _ptr, _ptr, _i32, _i32, _ptr, _i32],
    "pagedserve_add_rms_norm": [_i32, _ptr, _ptr, _ptr, _ptr, _i32, _i32, _f32],
    "pagedserve_rope_and_cache": [_i32, _i32, _ptr, _i64, _i32, _i32, _i32, _i32, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr],
    "pagedserve_silu_and_mul": [_i32, _ptr, _ptr, _i32, _i32],
    "pagedserve_gelu_tanh_and_mul": [_i32, _ptr, _ptr, _i32, _i32],
    "pagedserve_add_rms_norm_f32w": [_i32, _ptr, _ptr, _ptr, _ptr, _i32, _i32, _f32],
    "pagedserve_head_norms": [_i32, _ptr, _i64, _i32, _i32, _i32, _i32, _ptr, _ptr, _i32, _f32],
    "pagedserve_linear_group": [],
    "pagedserve_linear_pack": [_i32, _ptr, _ptr, _i64, _i64],
    "pagedserve_linear": [_i32, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64],
    "pagedserve_coded_rows": [],
    "pagedserve_coded_pack": [_ptr, _i64, _i64, _ptr, _i64, _ptr],
    "pagedserve_coded_linear": [*[_ptr] * 5, _i64, _i64, _i64],
    "pagedserve_llama_stack": [_ptr],
    "pagedserve_quant_repack": [_i32, _ptr, _ptr, _i64, _i64, _i64],
    "pagedserve_quant_unpack": [_i32, _ptr, _ptr, _i64, _i64, _i64],
    "pagedserve_quant_act": [_i32, _ptr, _i64, _i64, _ptr, _ptr, _ptr],
    "pagedserve_quant_linear_parts": [_i32, _ptr, _ptr, _ptr, _i64, _i64, _i32, _ptr, _ptr, _ptr],
    "pagedserve_quant_rows": [_i32, _ptr, _i64, _i64, _ptr, _i64, _ptr],
    "pagedserve_quant_linear_bf16": [_i32, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
}

# Until configured (kernels used directly, outside a worker): on, in the default cache's folder.
_cache_dir: Path = Path.home() / ".cache" / "pagedserve" / "kernels"
_enabled: bool = True


def configure(cache_dir: Path | str | None = None, enabled: bool | None = None) -> None:
    """Set the build folder and the on/off switch (None keeps the current one); the next
    ``load()`` uses them."""
    global _cache_dir, _enabled
    new = (_cache_dir if cache_dir is None else Path(cache_dir), _enabled if enabled is None else enabled)
    if new != (_cache_dir, _enabled):  # each ModelRunner configures; reload only on a change
        _cache_dir, _enabled = new
        load.cache_clear()


def settings() -> tuple[Path, bool]:
    """The folder and switch ``load()`` uses (tests save and restore them)."""
    return _cache_dir, _enabled


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The loaded library, or None (disabled, no compiler, or the build failed)."""
    if not _enabled:
        return None
    cxx = _compiler()
    if cxx is None:
        print("pagedserve: no C++ compiler; the CPU path runs torch ops", file=sys.stderr)
        return None
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    texts = [p.read_text() for p in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, cxx, version, " ".join(FLAGS), _cpu_id()]).encode()).hexdigest()[:16]
    lib = _cache_dir / key / "libpagedserve_cpu.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        objs = [f"{tmp[:-3]}.{i}.o" for i in range(len(SOURCES))]
        for src, obj in zip(SOURCES, objs):
            proc = subprocess.run([cxx, *COMPILE, str(src), "-o", obj], capture_output=True, text=True)
            if proc.returncode != 0:
                break
        else:
            proc = subprocess.run([cxx, *objs, *LINK, "-o", tmp], capture_output=True, text=True)
        for obj in objs:
            if os.path.exists(obj):
                os.unlink(obj)
        if proc.returncode != 0:
            os.unlink(tmp)
            print(f"pagedserve: building the CPU kernels failed; using the torch path\n{proc.stderr[-2000:]}",
                  file=sys.stderr)
            return None
        os.replace(tmp, lib)
    import torch  # noqa: F401 - torch's libgomp must be loaded first, so the kernel shares its threads

    dll = ctypes.CDLL(str(lib))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(dll, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    return dll
