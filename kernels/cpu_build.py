"""Builds and loads the CPU kernel library: PagedAttention (``cpu_attention.cpp``)
and the fused per-layer ops (``cpu_ops.cpp``), sharing ``cpu_common.h``.

Compiled once per source, compiler and CPU into the pagedserve cache
(``$PAGEDSERVE_CACHE/kernels/<hash>/``) with ``-march=native``, so a cache
shared between machines never runs code built for another CPU. Processes that
build at the same time each write a private file and rename it into place.
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

from pagedserve.common.config import env_flag
from pagedserve.common.default_model import cache_dir

HERE = Path(__file__).parent
SOURCES = (HERE / "cpu_attention.cpp", HERE / "cpu_ops.cpp")
HEADERS = (HERE / "cpu_common.h",)
# Compiled with fast math (vectorised expf, reassociated sums) but linked
# without it: a -ffast-math link adds crtfastmath, whose constructor turns on
# flush-to-zero for the whole process (hypothesis caught that).
COMPILE = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-fPIC", "-std=c++17", "-c")
LINK = ("-shared", "-fopenmp", "-lmvec", "-lm")
FLAGS = COMPILE + LINK
ENV = "CPU_KERNEL"  # PAGEDSERVE_CPU_KERNEL=0: never build or use the compiled kernel
DISABLE_ENV = "PAGEDSERVE_" + ENV


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
    if not env_flag(ENV, True):
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
    lib = cache_dir() / "kernels" / key / "libpagedserve_cpu.so"
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
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    signatures = {
        "pagedserve_paged_attention": [i32, *[ptr] * 7, *[i32] * 6, i64, f32],
        "pagedserve_add_rms_norm": [i32, ptr, ptr, ptr, ptr, i32, i32, f32],
        "pagedserve_rope_and_cache": [i32, ptr, i64, i32, i32, i32, i32, ptr, ptr, ptr, ptr, ptr, ptr],
        "pagedserve_silu_and_mul": [i32, ptr, ptr, i32, i32],
    }
    for name, argtypes in signatures.items():
        fn = getattr(dll, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    return dll
