"""The ``pagedserve`` command line.

  pagedserve serve ...                     all four components, locally
  pagedserve frontend|scheduler|blockmgr|gpuworker ...   one component
  pagedserve generate PROMPT ...           a small streaming client
  pagedserve keygen DIR                    CurveZMQ keys for internal tcp:// sockets
  pagedserve healthcheck [grpc|http|tcp T]  exit 0 when this container's component is ready
  pagedserve bench NAME ...                pagedserve.bench.NAME.main(argv): throughput, serving and the
                                           components' micro-benchmarks (peers: `python -m benchmarks`)
  pagedserve ray-serve ...                 replicas on Ray Serve, KV-cache-aware routing (pagedserve[ray])
"""
from __future__ import annotations

import importlib
import logging
import os
import sys

from pagedserve.common.curve import InsecureTransport
from pagedserve.common.hub_cache import ModelNotFound
from pagedserve.common.model_check import UnservableModel
from pagedserve.common.rundir import UnsafeRunDir

_COMPONENTS = {
    "frontend": "pagedserve.frontend.service",
    "scheduler": "pagedserve.scheduler.service",
    "blockmgr": "pagedserve.blockmgr.service",
    "gpuworker": "pagedserve.gpuworker.service",
    "serve": "pagedserve.launcher",
    "generate": "pagedserve.client",
    "keygen": "pagedserve.common.curve",
    "healthcheck": "pagedserve.healthcheck",
    "ray-serve": "pagedserve.rayserve.app",
}

# Moved out of the wheel to the repository's benchmarks/ (they start or import other engines);
# named here only to point there.
_PEER_BENCHMARKS = {"peers", "vllm_diff", "kv_fp8", "ray_multiturn", "guidellm_peers"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from pagedserve.common.version import version

        print(f"pagedserve {version()}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "gpuworker":
        from pagedserve.gpuworker.cpu_affinity import bind_worker_threads, short_spin

        bind_worker_threads(rest)  # before torch is imported
        short_spin()
        refused = _worker_refusal(rest)
        if refused:
            print(f"pagedserve gpuworker: error: {refused}", file=sys.stderr, flush=True)
            return 1
    if cmd == "bench":
        if not rest or rest[0].startswith("-"):
            print("usage: pagedserve bench NAME [args]", file=sys.stderr)
            return 2
        name = rest[0].replace("-", "_")
        try:
            module = importlib.import_module(f"pagedserve.bench.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"pagedserve.bench.{name}":
                print(f"no such benchmark: {rest[0]}", file=sys.stderr)
                if name in _PEER_BENCHMARKS:
                    print(f"it compares with other engines: `python -m benchmarks {rest[0]}` in a source "
                          "checkout (benchmarks/, not in the wheel)", file=sys.stderr)
                return 2
            raise
        return int(module.main(rest[1:]) or 0)
    if cmd not in _COMPONENTS:
        print(f"unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
        return 2
    try:
        rc = int(importlib.import_module(_COMPONENTS[cmd]).main(rest) or 0)
    # Refused internal sockets, a model that is not there: a clear line, no traceback.
    except (InsecureTransport, UnsafeRunDir, ModelNotFound) as e:
        print(f"pagedserve {cmd}: error: {e}", file=sys.stderr)
        return 2
    except UnservableModel as e:  # e.g. a GGUF whose converted config names no served architecture
        print(f"pagedserve {cmd}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before a component's own handlers are set: quiet
        rc = 130
    _quiet_exit(rc)
    return rc


def _worker_refusal(argv: list[str]) -> str | None:
    """The model check ``serve`` makes, for a worker started on
    its own: before it starts tensor-parallel ranks or converts a GGUF file.
    Reads only the engine flags; the worker's own parser still judges the rest."""
    import argparse

    from pagedserve.common.config import add_engine_args, config_from_args
    from pagedserve.common.model_check import engine_refusal

    p = argparse.ArgumentParser(prog="pagedserve gpuworker", add_help=False, allow_abbrev=False)
    add_engine_args(p)
    p.add_argument("--tp-rank", type=int, default=0)
    args, _ = p.parse_known_args(argv)
    if args.tp_rank > 0:  # rank 0 checked before starting it
        return None
    try:
        cfg = config_from_args(args)
    except ValueError:
        return None  # the worker's parser says what is wrong
    return engine_refusal(cfg)


def _quiet_exit(rc: int) -> None:
    """After a component's clean stop, end without the interpreter's teardown
    when a nanobind extension may be loaded (xgrammar's, triton's, which torch
    and transformers import): its objects, still referenced from module
    globals, print dozens of "leaked" warnings then. Nothing is lost: our
    cleanup has already run, and the process ends either way."""
    if not any(m in sys.modules for m in ("xgrammar", "triton", "torch")):
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
