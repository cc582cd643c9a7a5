"""``python -m benchmarks NAME [args]``: runs ``benchmarks.NAME.main(argv)`` (dashes in NAME
read as underscores, as ``pagedserve bench``)."""
from __future__ import annotations

import importlib
import pkgutil
import sys

import benchmarks

# Modules that are not benchmarks: helpers, and the scripts that run inside .venv-peers.
HELPERS = {"peer_engines", "peer_slices", "vllm_server", "vllm_diff_accepted", "vllm_diff_bodies",
           "vllm_diff_compare", "vllm_diff_corpus", "vllm_diff_invalid", "vllm_diff_tools", "vllm_peer_worker",
           "vllm_bench_client", "guidellm", "soak_client", "multiturn_client"}


def names() -> list[str]:
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(benchmarks.__path__)
                  if m.name not in HELPERS and not m.name.startswith("_"))


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m benchmarks NAME [args]\n  NAME: {', '.join(names())}")
        return 0 if argv else 2
    name = argv[0].replace("-", "_")
    if name in HELPERS or name.startswith("_"):
        print(f"no such benchmark: {argv[0]} (one of: {', '.join(names())})", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(f"benchmarks.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"benchmarks.{name}":
            print(f"no such benchmark: {argv[0]} (one of: {', '.join(names())})", file=sys.stderr)
            return 2
        raise
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
