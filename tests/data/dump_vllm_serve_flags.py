"""Print every option of vLLM's ``vllm serve`` parser as JSON (run it with the
peer venv's python, from a folder outside this repository: its top-level
``kernels`` folder would shadow vLLM's imports):

    cd /tmp && /work/main/.venv-peers/bin/python /path/to/dump_vllm_serve_flags.py > vllm_serve_flags.json

tests/data/vllm_serve_flags.json is this output for vLLM 0.32; tests/test_vllm_flags.py
checks it is current when the peer venv is present."""
import argparse
import json
import sys


def _simple(value):
    """A default as JSON where it is a plain value; else None (not compared)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple, set)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return sorted(value) if isinstance(value, set) else list(value)
    return None


def main() -> None:
    import vllm
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    flags = []
    for a in parser._actions:
        if not a.option_strings or isinstance(a, argparse._HelpAction):
            continue
        kind = ("bool" if isinstance(a, argparse.BooleanOptionalAction) else
                "store_true" if isinstance(a, argparse._StoreTrueAction) else
                "append" if isinstance(a, argparse._AppendAction) else "value")
        type_name = getattr(a.type, "__name__", None) if a.type is not None else None
        flags.append({"options": list(a.option_strings), "dest": a.dest, "kind": kind,
                      "nargs": a.nargs if kind in ("value", "append") else 0,
                      "choices": [str(c) for c in a.choices] if a.choices is not None else None,
                      "type": type_name if type_name in ("int", "float", "str", "human_readable_int") else None,
                      "default": _simple(a.default) if a.default is not argparse.SUPPRESS else None})
    from vllm.tool_parsers import ToolParserManager

    parsers = sorted({*ToolParserManager.tool_parsers, *getattr(ToolParserManager, "lazy_parsers", {})})
    json.dump({"vllm": vllm.__version__, "tool_call_parsers": parsers, "flags": flags}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
