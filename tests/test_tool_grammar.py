"""vLLM 0.32's grammar for tool calls under ``--tool-call-parser hermes``
(frontend/openai_api/tool_grammar.py): the structural tag equals the one vLLM builds
(its own code, in the peer venv), and our EBNF text equals xgrammar's
rendering of that tag."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pagedserve.frontend.openai_api.tool_grammar import structural_tag, to_ebnf

PEERS = Path(__file__).resolve().parents[1] / ".venv-peers"


def _fn(name: str, props: dict[str, Any], strict: bool | None = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name, "description": name, "parameters": {
        "type": "object", "properties": props, "required": list(props)}}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


TOOLS = [_fn("get_weather", {"city": {"type": "string"}}), _fn("get_time", {"timezone": {"type": "string"}})]
STRICT = [_fn("get_weather", {"city": {"type": "string"}}, True), _fn("get_time", {"tz": {"type": "string"}}, False)]
NAMED = {"type": "function", "function": {"name": "get_time"}}
CASES: list[tuple[list[dict[str, Any]], Any, bool | None]] = [
    (TOOLS, NAMED, None), (TOOLS, "required", None), (TOOLS, "required", False), (TOOLS, "auto", None),
    (TOOLS, "auto", False), (STRICT, "auto", None), (STRICT, "required", None), (STRICT, NAMED, None),
    (TOOLS, "none", None)]


@pytest.mark.parametrize("tools,choice,parallel", CASES[:3])
def test_ebnf_is_xgrammars_rendering_of_the_tag(tools: list[dict[str, Any]], choice: Any,
                                                parallel: bool | None) -> None:
    import xgrammar

    tag = structural_tag(tools, choice, parallel)
    assert tag is not None
    ours = to_ebnf(tag)
    assert ours.strip() == str(xgrammar.Grammar.from_structural_tag(json.dumps(tag))).strip()
    assert '"}\\n</tool_call>"' in ours and "get_time" in ours


def test_which_requests_get_a_grammar() -> None:
    assert structural_tag(TOOLS, "auto", None) is None  # vLLM: no tag for auto without a strict tool
    assert structural_tag(TOOLS, "none", None) is None
    named = structural_tag(TOOLS, NAMED, None)
    assert named is not None and [t["begin"] for t in named["format"]["tags"]] == [
        '<tool_call>\n{"name": "get_time", "arguments": ', '<tool_call>{"name": "get_time", "arguments": ']
    assert named["format"]["stop_after_first"] and named["format"]["at_least_one"]
    req = structural_tag(TOOLS, "required", None)
    assert req is not None and not req["format"]["stop_after_first"] and len(req["format"]["tags"]) == 4
    # Only a strict tool's arguments follow its schema.
    strict = structural_tag(STRICT, "required", None)
    assert strict is not None
    schemas = [t["content"]["json_schema"] for t in strict["format"]["tags"]]
    assert schemas == [STRICT[0]["function"]["parameters"]] * 2 + [True, True]


_PEER_CODE = """
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag, limit_to_single_tool_call
from vllm.tool_parsers.tool_strict_level import ToolStrictLevel
out = []
for model, tools, choice, parallel in json.loads(sys.stdin.read()):
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                tool_choice=choice, parallel_tool_calls=parallel)
    level = ToolStrictLevel.FUNCTION if parallel is False else ToolStrictLevel.AUTO  # _apply_structural_tag
    tag = get_model_structural_tag(model, req.tools, req.tool_choice, False, strict_level=level)
    if tag is not None and parallel is False:
        limit_to_single_tool_call(tag)
    out.append(None if tag is None else tag.model_dump(mode="json"))
print(json.dumps(out))
"""


def _strip_defaults(node: Any) -> Any:
    """Keep the keys our tag sets (vLLM's dump also lists every default)."""
    if isinstance(node, dict):
        keep = {"type", "format", "tags", "triggers", "begin", "end", "content", "json_schema", "separator",
                "at_least_one", "stop_after_first", "elements", "value", "pattern"}
        return {k: _strip_defaults(v) for k, v in node.items() if k in keep}
    if isinstance(node, list):
        return [_strip_defaults(v) for v in node]
    return node


@pytest.mark.skipif(not (PEERS / ".peers-stamp").exists(), reason="the peer venv with vLLM 0.32 is not installed "
                                                                  "(scripts/setup-peers.sh)")
def test_the_tag_is_vllms(tmp_path: Path) -> None:
    # hermes (built here) and llama3_json's "llama" (xgrammar's builtin template, pinned strictness).
    cases = [(model, *case) for model in ("hermes", "llama") for case in CASES]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.run([str(PEERS / "bin" / "python"), "-c", _PEER_CODE], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    for (model, tools, choice, parallel), ref in zip(cases, theirs):
        ours = structural_tag(tools, choice, parallel, model)
        assert (None if ours is None else _strip_defaults(ours)) == (None if ref is None else _strip_defaults(ref)), \
            (model, choice, parallel)
        if ours is not None:
            to_ebnf(ours)  # xgrammar takes it
