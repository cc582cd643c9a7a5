"""``pagedserve bench structured``: structured outputs on a real model (default:
the embedded SmolLM2-135M-Instruct), in-process (the engine core with the real
scheduler, block manager and model worker; no sockets).

Per kind (JSON schema with a nested object, enums and an array; regex; choice;
a named tool call's arguments), ``--n`` requests (default 50) run as one
concurrent batch, seeded at temperature ``--temperature``; every output is
parsed and validated. The baseline in the same run is unconstrained decoding
of the same prompts forced to the same output lengths (``ignore_eos``), so
both runs decode the same number of tokens in the same batch shapes and the
difference is the grammar's cost (compiling the spec, one bitmask per step,
matcher updates; the worker reads the tokenizer's vocabulary once, untimed). A final JSON line carries everything.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

from pagedserve.common.messages.types import StructuredSpec

# Nested object, enums, an array; every size bounded, so even a random model ends
# within MAX_TOKENS (a character may cost up to 4 byte tokens).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "vip": {"type": "boolean"}},
            "required": ["city", "vip"],
        },
    },
    "required": ["name", "kind", "age", "tags", "owner"],
}
REGEX = r"[a-z]{2,5}-\d{2,3}"
CHOICES = ["red", "green", "blue", "dark purple"]
TOOL_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                           "parameters": TOOL_PARAMS}}]
MAX_TOKENS = 256
KINDS = ("json", "regex", "choice", "tool")
_CITIES = ["Paris", "Berlin", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Quito", "Seoul"]
_PETS = ["Rex", "Milo", "Luna", "Kiki", "Bo", "Nala", "Ziggy", "Pip", "Odin", "Mara"]


def validate(instance: Any, schema: dict[str, Any]) -> None:
    """Raises AssertionError unless ``instance`` follows ``schema`` (``jsonschema``
    when installed, else a validator of the subset the schemas here use)."""
    try:
        import jsonschema
    except ImportError:
        _check(instance, schema, "$")
        return
    try:
        jsonschema.validate(instance, schema)
    except jsonschema.ValidationError as e:
        raise AssertionError(f"{instance!r}: {e.message}") from None


_TYPES: dict[str, Any] = {"object": dict, "array": list, "string": str, "boolean": bool, "number": (int, float)}


def _check(x: Any, s: dict[str, Any], at: str) -> None:
    t = s.get("type")
    if t == "integer":
        assert isinstance(x, int) and not isinstance(x, bool), f"{at}: {x!r} is not an integer"
    elif t is not None:
        assert isinstance(x, _TYPES[t]) and (t == "boolean" or not isinstance(x, bool)), f"{at}: {x!r} is not {t}"
    if "enum" in s:
        assert x in s["enum"], f"{at}: {x!r} not in {s['enum']}"
    if "minimum" in s:
        assert x >= s["minimum"], f"{at}: {x} < {s['minimum']}"
    if "maximum" in s:
        assert x <= s["maximum"], f"{at}: {x} > {s['maximum']}"
    if "maxLength" in s:
        assert len(x) <= s["maxLength"], f"{at}: {x!r} longer than {s['maxLength']}"
    if "maxItems" in s:
        assert len(x) <= s["maxItems"], f"{at}: more than {s['maxItems']} items"
    for key in s.get("required", []):
        assert key in x, f"{at}: {key!r} missing"
    for key, sub in s.get("properties", {}).items():
        if isinstance(x, dict) and key in x:
            _check(x[key], sub, f"{at}.{key}")
    if "items" in s:
        for i, item in enumerate(x):
            _check(item, s["items"], f"{at}[{i}]")


def check_output(kind: str, text: str) -> None:
    """Raises AssertionError unless ``text`` is a valid output of ``kind``."""
    if kind in ("json", "tool"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise AssertionError(f"not JSON ({e}): {text!r}") from None
        validate(value, SCHEMA if kind == "json" else TOOL_PARAMS)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), f"{text!r} does not match {REGEX}"
    elif kind == "choice":
        assert text in CHOICES, f"{text!r} not in {CHOICES}"
    else:
        raise ValueError(kind)


def spec(kind: str) -> StructuredSpec:
    # Compact JSON (vLLM's disable_any_whitespace): a random model given free whitespace pads it to the length limit.
    return {"json": StructuredSpec("json", json.dumps(SCHEMA), True), "regex": StructuredSpec("regex", REGEX),
            "choice": StructuredSpec("choice", json.dumps(CHOICES)),
            "tool": StructuredSpec("json", json.dumps(TOOL_PARAMS), True)}[kind]


def conversation(kind: str, i: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    pet, city = _PETS[i % len(_PETS)], _CITIES[(i // len(_PETS) + i) % len(_CITIES)]
    text = {
        "json": f"Describe a pet named {pet} that lives with an owner in {city}, as JSON.",
        "regex": f"Invent a product code for a shop in {city} (letters, a dash, digits).",
        "choice": f"Which color suits a pet named {pet}: red, green, blue or dark purple?",
        "tool": f"What will the weather be like in {city} for the next few days?",
    }[kind]
    return [{"role": "user", "content": text}], (TOOLS if kind == "tool" else None)


def _run(core: Any, requests: list[tuple[str, list[int], Any]]) -> tuple[dict[str, list[int]], float]:
    from pagedserve.common.messages.frontend import AddRequest

    t0 = time.perf_counter()
    for rid, ids, params in requests:
        core.handle(AddRequest(rid, ids, params, time.time()))
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    for d in core.run_until_idle():
        if d.error:
            raise RuntimeError(f"{d.request_id}: {d.error}")
        out[d.request_id] += d.token_ids
    return out, time.perf_counter() - t0


def run(model: str | None, n: int, temperature: float, kinds: tuple[str, ...] = KINDS, max_tokens: int = MAX_TOKENS,
        seed: int = 0, num_gpu_blocks: int | None = None) -> dict[str, Any]:
    import msgspec
    from transformers import AutoTokenizer

    from pagedserve.blockmgr.manager import BlockManager
    from pagedserve.common.config import EngineConfig
    from pagedserve.common.default_model import resolve_model
    from pagedserve.common.messages.types import SamplingParams
    from pagedserve.frontend.core.chat_template import render_chat
    from pagedserve.gpuworker.model_runner import ModelRunner
    from pagedserve.scheduler.engine import EngineCore, InProcessBlockClient, InProcessWorkerClient

    folder = resolve_model(model)
    tok = AutoTokenizer.from_pretrained(folder)
    cfg = EngineConfig(model=model, num_gpu_blocks=num_gpu_blocks, max_num_seqs=max(n, 1))
    runner = ModelRunner(cfg)
    core = EngineCore(cfg, InProcessBlockClient(lambda i: BlockManager(i.num_gpu_blocks, i.num_cpu_blocks, i.block_size)),
                      InProcessWorkerClient(runner))
    name = runner.ready.model.model_name if runner.ready else folder
    runner.structured.compiler()  # the tokenizer's vocabulary, read once per worker: not timed
    results: dict[str, Any] = {"bench": "structured", "model": name, "n": n, "temperature": temperature,
                               "max_tokens": max_tokens, "kinds": {}}
    for kind in kinds:
        prompts = []
        for i in range(n):
            conv, tools = conversation(kind, i)
            text = render_chat(tok, conv, tools) if tok.chat_template else conv[0]["content"]
            prompts.append(tok(text, add_special_tokens=not tok.chat_template).input_ids)
        p = SamplingParams(max_tokens=max_tokens, temperature=temperature, structured=spec(kind))
        reqs = [(f"{kind}-{i}", ids, msgspec.structs.replace(p, seed=seed + i)) for i, ids in enumerate(prompts)]
        runner.structured._cache.clear()  # time the compile too
        out, t_con = _run(core, reqs)
        texts = [tok.decode(out[rid], skip_special_tokens=True) for rid, _, _ in reqs]
        errors = []
        for t in texts:
            try:
                check_output(kind, t)
            except AssertionError as e:
                errors.append(str(e))
        lens = [max(1, len(out[rid])) for rid, _, _ in reqs]
        base = [(f"base-{rid}", ids, SamplingParams(max_tokens=k, temperature=temperature, seed=seed + i, ignore_eos=True))
                for i, ((rid, ids, _), k) in enumerate(zip(reqs, lens))]
        bout, t_base = _run(core, base)
        n_con, n_base = sum(len(v) for v in out.values()), sum(len(v) for v in bout.values())
        results["kinds"][kind] = {
            "valid": n - len(errors), "total": n, "valid_fraction": (n - len(errors)) / n if n else 0.0,
            "output_tokens": n_con, "constrained_s": t_con, "constrained_tok_s": n_con / t_con,
            "baseline_tokens": n_base, "baseline_s": t_base, "baseline_tok_s": n_base / t_base,
            "cost": t_con / t_base, "examples": texts[:3], "errors": errors[:3],
        }
    return results


def report(r: dict[str, Any]) -> str:
    lines = [f"bench structured: {r['model']}, {r['n']} outputs per kind, temperature {r['temperature']}, "
             f"max_tokens {r['max_tokens']} (in-process engine; baseline: the same prompts unconstrained, "
             "forced to the same lengths)",
             f"{'kind':<8}{'valid':>9}{'tokens':>8}{'constrained tok/s':>19}{'unconstrained tok/s':>21}{'time ratio':>12}"]
    for kind, k in r["kinds"].items():
        lines.append(f"{kind:<8}{k['valid']:>5}/{k['total']:<3}{k['output_tokens']:>8}{k['constrained_tok_s']:>19.1f}"
                     f"{k['baseline_tok_s']:>21.1f}{k['cost']:>11.2f}x")
    for kind, k in r["kinds"].items():
        lines.append(f"  {kind} e.g. {k['examples'][0]!r}" + (f"; INVALID: {k['errors'][0]}" if k["errors"] else ""))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pagedserve bench structured", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--n", type=int, default=50, help="outputs per kind")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--num-gpu-blocks", type=int, default=None)
    a = ap.parse_args(argv)
    r = run(a.model, a.n, a.temperature, tuple(a.kinds.split(",")), a.max_tokens, num_gpu_blocks=a.num_gpu_blocks)
    print(report(r))
    print(json.dumps(r))
    return 0 if all(k["valid"] == k["total"] for k in r["kinds"].values()) else 1
