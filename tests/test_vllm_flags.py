"""An unchanged `vllm serve` command line (issue 41, acceptance 1 and 2).

1. Every flag of vLLM 0.32's serve parser (tests/data/vllm_serve_flags.json, which
   is regenerated from vLLM's own parser and compared when the peer venv is here)
   is fed with a realistic value to `pagedserve serve`'s parser: each is honoured,
   accepted with one log line naming it, or refused in one stderr line naming it
   (exit 2); never a usage text (the real CLI in a subprocess for the refusals).
2. With --device left out, serve runs on this machine's CPU and says so (its start
   line and ServerInfo.device); the GPU half runs where torch sees a GPU.
Plus --config YAML, --download-dir, VLLM_CPU_KVCACHE_SPACE, the response flags
(--return-tokens-as-token-ids, --enable-request-id-headers, --enable-prompt-tokens-details,
--enable-force-include-usage, --chat-template-content-format) and docs/api.md's table."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from e2e_util import serve
from models import ARCHS, make_tiny_model
from pagedserve.frontend.openai_api.server_flags import ServerFlags, detect_content_format, with_content_format
from pagedserve.frontend.openai_api.tool_parsers import PARSERS
from pagedserve.serve_args import build_parser, parse_serve_args
from pagedserve.vllm_flags import FLAGS, VLLM_TOOL_CALL_PARSERS, markdown_table

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "vllm_serve_flags.json"
PEER_PY = Path(os.environ.get("PAGEDSERVE_PEERS_VENV", "/work/main/.venv-peers")) / "bin" / "python"
VLLM = json.loads(DATA.read_text())
BY_NAME = {f.name: f for f in FLAGS}
# Realistic values for the flags this parser defines itself (from real launch commands).
NATIVE_VALUES = {
    "--host": "0.0.0.0", "--port": "8001", "--grpc-port": "50052", "--api-key": "token-abc123",
    "--model": "org/name", "--served-model-name": "my-model", "--revision": "main", "--tokenizer": "/models/tok",
    "--chat-template": "{{ messages[0]['content'] }}", "--root-path": "/llm", "--allowed-origins": '["*"]',
    "--allowed-methods": '["GET", "POST"]', "--allowed-headers": '["*"]', "--max-model-len": "4096",
    "--hf-overrides": '{"max_position_embeddings": 4096}', "--override-generation-config": '{"temperature": 0.5}',
    "--generation-config": "vllm", "--kv-events-config": '{"enable_kv_cache_events": true}',
    "--structured-outputs-config": '{"backend": "xgrammar"}', "--gpu-memory-utilization": "0.85",
    "--kv-cache-memory-bytes": "1GiB", "--num-gpu-blocks-override": "512", "--max-num-seqs": "64",
    "--max-num-batched-tokens": "2048", "--block-size": "32", "--tensor-parallel-size": "1", "--seed": "42",
    "--shutdown-timeout": "10", "--max-logprobs": "5", "--quantization": "awq", "--pipeline-parallel-size": "2",
    "--data-parallel-size": "2", "--tool-call-parser": "hermes", "--ssl-certfile": "/certs/c.pem",
    "--ssl-keyfile": "/certs/k.pem", "--dtype": "bfloat16", "--tokenizer-mode": "auto", "--load-format": "auto",
    "--kv-cache-dtype": "fp8", "--attention-backend": "FLASH_ATTN", "--prefix-caching-hash-algo": "sha256",
    "--uvicorn-log-level": "warning", "--response-role": "assistant", "--download-dir": "/models",
    "--chat-template-content-format": "openai", "--default-chat-template-kwargs": '{"enable_thinking": false}',
}
SIBLINGS = {"--enable-auto-tool-choice": ["--tool-call-parser", "hermes"], "--ssl-certfile": ["--ssl-keyfile", "k"],
            "--ssl-keyfile": ["--ssl-certfile", "c"], "--revision": ["--model", "org/name"]}


def _value(v: dict[str, Any], refused: bool) -> list[str]:
    """A realistic value; for a flag refused unless harmless, one that is not."""
    name, f = v["options"][0], BY_NAME.get(v["options"][0])
    if v["kind"] in ("bool", "store_true"):
        return []
    if name in NATIVE_VALUES:
        return [NATIVE_VALUES[name]]
    if v["choices"]:
        other = [c for c in v["choices"] if c != str(v["default"]) and c != "None" and (not f or c not in f.harmless)]
        return [other[0] if refused and other else str(v["default"] if v["default"] is not None else v["choices"][0])]
    if v["type"] in ("int", "human_readable_int"):
        return [str((v["default"] or 0) + 2)]
    if v["type"] == "float":
        return [str((v["default"] or 0) + 0.5)]
    if name.endswith("config") or "kwargs" in name or name.endswith("overrides"):
        return ['{"key": 1}']
    return ["value-1"]


def _argv(v: dict[str, Any]) -> list[str]:
    f = BY_NAME.get(v["options"][0])
    values = _value(v, bool(f and f.refused))
    return [v["options"][0], *values, *SIBLINGS.get(v["options"][0], [])]


def _answer(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], list[str]]:
    """(exit status, stderr lines, the start notes) of parsing ``argv`` as serve does."""
    capsys.readouterr()
    try:
        sa = parse_serve_args(argv)
    except SystemExit as e:
        return int(e.code or 0), capsys.readouterr().err.splitlines(), []
    return 0, capsys.readouterr().err.splitlines(), list(sa.notes[1:])  # notes[0]: the device


def test_checked_in_list_is_vllms() -> None:
    if not PEER_PY.exists():
        pytest.skip(f"no peer venv at {PEER_PY.parent.parent}: the checked-in list is used as it is")
    r = subprocess.run([str(PEER_PY), str(ROOT / "tests" / "data" / "dump_vllm_serve_flags.py")], cwd="/tmp",
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout) == VLLM, "tests/data/vllm_serve_flags.json is not vLLM's current list: regenerate it"


def test_table_covers_vllms_list_and_nothing_else() -> None:
    assert VLLM["vllm"] == "0.32.0" and len(VLLM["flags"]) == 316  # 317 with --help
    assert sorted(VLLM_TOOL_CALL_PARSERS) == VLLM["tool_call_parsers"]
    assert set(PARSERS) <= set(VLLM_TOOL_CALL_PARSERS)
    p = build_parser()
    vllm_names = {o for v in VLLM["flags"] for o in v["options"]}
    for v in VLLM["flags"]:
        for o in v["options"]:
            assert o in p._option_string_actions, f"{o} is unknown to pagedserve serve"
        f = BY_NAME.get(v["options"][0])
        native = not p._option_string_actions[v["options"][0]].dest.startswith("vllm_")
        if f is not None and not native:
            assert set(f.options) == set(v["options"]), (f.options, v["options"])
            shape = {"bool": "!", "store_true": "^", "append": "*"}.get(v["kind"], {"+": "+", "?": "?"}.get(
                str(v["nargs"]), ""))
            assert f.shape == shape, (f.name, f.shape, shape)
    stale = [f.name for f in FLAGS if f.name not in vllm_names]
    assert not stale, f"not vLLM 0.32 flags: {stale}"


def test_every_vllm_flag_is_answered(capsys: pytest.CaptureFixture[str]) -> None:
    counts = {"honoured": 0, "no effect": 0, "refused": 0}
    for v in VLLM["flags"]:
        name, argv = v["options"][0], _argv(v)
        f = BY_NAME.get(name)
        native = not build_parser()._option_string_actions[name].dest.startswith("vllm_")
        rc, err, notes = _answer(argv, capsys)
        assert not any("usage:" in line for line in err), (argv, err)
        if rc != 0:  # refused: one line naming the flag
            assert rc == 2 and len(err) == 1 and name in err[0], (argv, rc, err)
            assert native or (f is not None and f.refused), (argv, err)
            counts["refused"] += 1
        elif native:
            mine = [n for n in notes if n.startswith(name)]
            assert not mine or (len(mine) == 1 and "without effect" in mine[0]), (argv, notes)
            counts["no effect" if mine else "honoured"] += 1  # e.g. vLLM's --attention-backend FLASH_ATTN
        else:
            assert f is not None and not f.refused, (argv, "a refused flag was accepted")
            mine = [n for n in notes if n.startswith(name)]
            assert len(mine) == 1 and "without effect" in mine[0], (argv, notes)
            counts["no effect"] += 1
        if f is not None and f.refused and not native:
            assert rc == 2, (argv, "refused flag accepted")
    assert sum(counts.values()) == 316 and min(counts.values()) > 20, counts


def test_harmless_values_of_refused_flags_are_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--cpu-offload-gb", "0"], ["--no-enable-sleep-mode"], ["--data-parallel-backend", "mp"],
                 ["--runner", "generate"], ["--max-loras", "1"]):
        rc, err, notes = _answer(argv, capsys)
        assert rc == 0 and len(notes) == 1 and notes[0].startswith(argv[0]), (argv, err, notes)


@pytest.mark.parametrize("argv, needle", [
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'], "--speculative-config"),
    (["--kv-transfer-config", '{"kv_connector": "NixlConnector"}'], "--kv-transfer-config"),
    (["--lora-modules", "a=/lora/a"], "--lora-modules"),
    (["--cpu-offload-gb", "8"], "--cpu-offload-gb"),
    (["--tool-call-parser", "qwen3_coder"] if "qwen3_coder" not in PARSERS else ["--tool-call-parser", "kimi_k2"],
     "--tool-call-parser"),
    (["--tool-call-parser", "no_such_parser"], "no_such_parser"),
    (["--no-such-flag", "1"], "--no-such-flag"),
    (["--task", "generate"], "--task"),
    (["--dtype", "int3"], "--dtype"),
    (["--config", "/nonexistent/x.yaml"], "--config"),
])
def test_refusals_from_the_real_cli_are_one_line(argv: list[str], needle: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pagedserve", "serve", *argv], capture_output=True, text=True,
                       timeout=120, env={k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")})
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and needle in lines[0] and "usage" not in r.stderr, r.stderr


def test_config_yaml_as_vllm_reads_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_model_len: 512\nmax-num-seqs: 8\nenable_prefix_caching: false\nenforce-eager: true\n"
                   "served-model-name: [a, b]\ncompilation-config:\n  mode: 3\nport: 8123\n")
    sa = parse_serve_args(["--config", str(cfg), "--max-num-seqs", "16"])
    assert (sa.cfg.max_model_len, sa.cfg.max_num_seqs, sa.cfg.enable_prefix_caching, sa.cfg.enforce_eager) == (
        512, 16, False, True)  # the command line wins over the file
    assert sa.served_model_names == ["a", "b"] and sa.http_port == 8123
    assert any(n.startswith('--compilation-config {"mode": 3}') for n in sa.notes)
    cfg.write_text("speculative_config:\n  method: ngram\n")
    rc, err, _ = _answer(["--config", str(cfg)], capsys)
    assert rc == 2 and len(err) == 1 and "--speculative-config" in err[0]
    (tmp_path / "c.json").write_text("{}")
    rc, err, _ = _answer(["--config", str(tmp_path / "c.json")], capsys)
    assert rc == 2 and len(err) == 1 and ".yaml" in err[0]
    # underscores and -O as vLLM's parser takes them
    sa = parse_serve_args(["--max_num_seqs", "4", "-O3"])
    assert sa.cfg.max_num_seqs == 4 and any(n.startswith("--optimization-level 3") for n in sa.notes)


HUMAN_INTS = ["512", "32k", "25.6k", "2K", "1M", "3g", "1T", "2.5K", "x1", "auto", "-1"]


def test_human_readable_lengths_are_vllms() -> None:
    from pagedserve.vllm_argv import human_readable_int, model_len

    def ours(text: str) -> Any:
        try:
            v = model_len(text)
            return [human_readable_int(text) if v is not None else -1, v]
        except ValueError:
            return "error"

    if not PEER_PY.exists():
        pytest.skip(f"no peer venv at {PEER_PY.parent.parent}")
    code = ("import json,sys\nfrom vllm.utils.argparse_utils import human_readable_int as h, "
            "human_readable_int_or_auto as a\nout = []\nfor t in json.load(sys.stdin):\n    try:\n"
            "        v = a(t)\n        out.append([h(t) if v != -1 else -1, None if v == -1 else v])\n"
            "    except Exception:\n        out.append('error')\nprint(json.dumps(out))")
    r = subprocess.run([str(PEER_PY), "-c", code], input=json.dumps(HUMAN_INTS), cwd="/tmp", capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [ours(t) for t in HUMAN_INTS] == json.loads(r.stdout.strip().splitlines()[-1])
    assert parse_serve_args(["--max-model-len", "2K", "--max-num-batched-tokens", "8k"]).cfg.max_model_len == 2048


def test_cpu_kv_cache_space_sizes_the_pool(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                           ) -> None:
    import torch

    from pagedserve.gpuworker.pool_sizing import cpu_default_kv_bytes, pool_blocks

    per_block = 2 * 4 * 16 * 64 * 16 * 4  # K and V, 4 layers, 16 tokens, 64 dims, 16 heads, fp32
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    sa = parse_serve_args(["--device", "cpu", "--kv-cache-memory-bytes", "512MiB"])  # the variable wins, as vLLM
    assert sa.cfg.kv_cache_memory == 2 << 30
    assert pool_blocks(sa.cfg, torch.device("cpu"), 2048, per_block, lambda: 0) == (2 << 30) // per_block
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "")
    cfg = parse_serve_args(["--device", "cpu"]).cfg
    assert cfg.kv_cache_memory is None
    full = cfg.max_num_seqs * 2048 // 16 + 1
    assert pool_blocks(cfg, torch.device("cpu"), 2048, per_block, lambda: 0) == min(
        cpu_default_kv_bytes() // per_block, full)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1.5")
    rc, err, _ = _answer(["--device", "cpu"], capsys)
    assert rc == 2 and len(err) == 1 and "VLLM_CPU_KVCACHE_SPACE" in err[0]


TEMPLATES = [
    "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "{% for message in messages %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}",
    "{% for message in messages %}{% for c in message.content %}{{ c.text }}{% endfor %}{% endfor %}",
    "{%- for message in messages %}{%- if message.content is string %}{{ message.content }}{%- else %}"
    "{%- for content in message.content %}{{ content.text }}{%- endfor %}{%- endif %}{%- endfor %}",
    "{{ messages | length }}",
]


def test_content_format_detection_is_vllms() -> None:
    if not PEER_PY.exists():
        pytest.skip(f"no peer venv at {PEER_PY.parent.parent}")
    code = ("import json,sys\nfrom vllm.renderers.hf import _detect_content_format as d\n"
            "print(json.dumps([d(t, default='string') for t in json.load(sys.stdin)]))")
    r = subprocess.run([str(PEER_PY), "-c", code], input=json.dumps(TEMPLATES), cwd="/tmp", capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    assert [detect_content_format(t) for t in TEMPLATES] == theirs
    assert "openai" in theirs and "string" in theirs


def test_content_format_shapes_the_messages() -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c"}]
    conv = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"}]
    string = with_content_format(ServerFlags(chat_template_content_format="string"), conv, msgs, TEMPLATES[1], None)
    assert [m["content"] for m in string] == ["a\nb", "c"]  # vLLM joins text parts with newlines
    auto = with_content_format(ServerFlags(), conv, msgs, TEMPLATES[1], None)
    assert auto[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert auto[1]["content"] == [{"type": "text", "text": "c"}]


def test_docs_table_is_the_parsers() -> None:
    text = (ROOT / "docs" / "api.md").read_text()
    start, end = "<!-- vllm-flags:start -->\n", "<!-- vllm-flags:end -->"
    assert start in text and end in text, "docs/api.md lost its generated flag table"
    shown = text.split(start, 1)[1].split(end, 1)[0]
    assert shown == markdown_table(VLLM["flags"], build_parser()), (
        "docs/api.md's vLLM flag table is stale: run `python tests/test_vllm_flags.py` to rewrite it")


ENGINE = ("common", "frontend", "scheduler", "blockmgr", "gpuworker", "kernels", "pagedserve")
_READS = re.compile(r'(?:\benv|env_int|env_flag|read_env)\(\s*"([A-Z_]+)"|env_name="([A-Z_]+)"|"PAGEDSERVE_([A-Z_]+)"'
                    r'|\b[A-Z_]*ENV = "([A-Z_]+)"')
# Names built at run time: frontend/openai_api/http_conn.py's HTTP_<limit>, common/metrics.py's <COMPONENT>_METRICS_PORT.
FAMILIES = {"HTTP_HEADER_TIMEOUT", "HTTP_BODY_TIMEOUT", "HTTP_MAX_CONNECTIONS", "FRONTEND_METRICS_PORT",
            "SCHEDULER_METRICS_PORT", "BLOCKMGR_METRICS_PORT", "GPUWORKER_METRICS_PORT"}


def test_env_table_is_every_variable_the_engine_reads() -> None:
    """docs/deployment.md's table lists exactly the PAGEDSERVE_* variables the engine reads (issue 39)."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    table = text.split("<!-- env-vars:start -->", 1)[1].split("<!-- env-vars:end -->", 1)[0]
    listed = set(re.findall(r"`PAGEDSERVE_([A-Z_]+)`", table))
    read: set[str] = set()
    for top in ENGINE:
        for path in (ROOT / top).rglob("*.py"):
            if "bench" not in path.parts:  # pagedserve bench is a client of the engine, not the engine
                read |= {next(g for g in m.groups() if g).removeprefix("PAGEDSERVE_")
                         for m in _READS.finditer(path.read_text())}
    read.discard("")  # common/env.py's prefix itself
    assert read | FAMILIES == listed, (sorted(read - listed), sorted(listed - read - FAMILIES))
    assert len(listed) <= 84 - 30  # issue 39 counted 84 that mirrored flags
    # and no flag of serve reads a variable the table does not list
    for a in build_parser()._actions:
        for name in re.findall(r"env PAGEDSERVE_([A-Z_]+)", a.help or ""):
            assert name in listed, (a.option_strings, name)


def _http(base: str, path: str, body: Any = None, headers: dict[str, str] | None = None
          ) -> tuple[dict[str, str], bytes]:
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as r:
        return dict(r.headers), r.read()


def _per_block(dtype_bytes: int) -> int:
    """Bytes of one KV block of tests/models.py's tiny llama (layers x K,V x 16 tokens x KV heads x dims)."""
    shape = ARCHS["llama"]
    return shape["num_hidden_layers"] * 2 * 16 * shape["num_key_value_heads"] * shape["head_dim"] * dtype_bytes


def _hub_cache(tmp_path: Path) -> Path:
    """The tiny model as the hub id org/tiny in a Hugging Face cache folder."""
    cache = tmp_path / "hub"
    snap = cache / "models--org--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(make_tiny_model(tmp_path), snap)
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("0123abcd")
    return cache


def test_cpu_by_default_with_vllms_flags(tmp_path: Path) -> None:
    """--device left out on this CPU machine: serves on cpu and says so; the model comes from
    --download-dir; VLLM_CPU_KVCACHE_SPACE sizes the pool; the response flags shape the bodies."""
    template = ("{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
                "{{ suffix }}")
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if os.path.exists("/dev/nvidia0"):
        env["CUDA_VISIBLE_DEVICES"] = ""  # on a GPU machine, the CPU half hides the GPUs
    with serve("org/tiny", "--download-dir", str(_hub_cache(tmp_path)), "--disable-fastapi-docs",
               "--return-tokens-as-token-ids", "--enable-request-id-headers", "--enable-prompt-tokens-details",
               "--enable-force-include-usage", "--chat-template", template, "--max-model-len", "128",
               "--default-chat-template-kwargs", '{"suffix": "!", "other": 1}',
               env=env) as srv:
        log = "".join(srv.log)
        assert "pagedserve: device cpu (auto: " in log, log[-3000:]
        if not os.path.exists("/dev/nvidia0"):
            assert "pagedserve: device cpu (auto: no GPU on this machine)" in log
        assert "--disable-fastapi-docs: accepted, without effect here" in log
        with srv.client() as c:
            info = c.server_info()
        assert info.device == "cpu"
        assert info.num_gpu_blocks == (1 << 30) // _per_block(4) - 1, info  # 1 GiB of fp32 blocks, less the null one
        body = {"model": "org/tiny", "prompt": "hello there", "max_tokens": 3, "logprobs": 1, "temperature": 0}
        headers, raw = _http(srv.http, "/v1/completions", body, {"X-Request-Id": "my-id-1"})
        out = json.loads(raw)
        assert headers.get("X-Request-Id") == "my-id-1"
        assert all(t.startswith("token_id:") for t in out["choices"][0]["logprobs"]["tokens"]), out
        assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": None,
                                                         "multimodal_tokens": None}, out["usage"]
        long_prompt = {**body, "prompt": " ".join(["alpha beta gamma delta"] * 4), "logprobs": None}
        _, first = _http(srv.http, "/v1/completions", long_prompt)
        _, again = _http(srv.http, "/v1/completions", long_prompt)  # its full blocks now in the prefix cache
        n_prompt = json.loads(first)["usage"]["prompt_tokens"]
        assert json.loads(first)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert json.loads(again)["usage"]["prompt_tokens_details"]["cached_tokens"] == (n_prompt - 1) // 16 * 16 > 0
        headers, raw = _http(srv.http, "/v1/completions", {**body, "return_tokens_as_token_ids": False})
        assert len(headers.get("X-Request-Id", "")) == 32  # a new uuid4 hex
        assert not any(t.startswith("token_id:") for t in json.loads(raw)["choices"][0]["logprobs"]["tokens"])
        # streamed without stream_options: usage in every chunk and at the end (forced)
        _, raw = _http(srv.http, "/v1/completions", {**body, "stream": True, "prompt": "hello there again x"})
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        assert events and all("usage" in e for e in events), events
        assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
        # the template loops over message content: auto gives it OpenAI's parts
        chat = {"model": "org/tiny", "max_tokens": 1, "return_prompt_text": True,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": "b"}]}]}
        _, raw = _http(srv.http, "/v1/chat/completions", chat)
        assert json.loads(raw)["prompt_text"] == "[a][b]!"  # --default-chat-template-kwargs
        _, raw = _http(srv.http, "/v1/chat/completions", {**chat, "chat_template_kwargs": {"suffix": "?"}})
        assert json.loads(raw)["prompt_text"] == "[a][b]?"  # the request's own win


def test_gpu_by_default_where_torch_sees_one(tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("the GPU half: torch sees no CUDA GPU on this machine (run it where a device is lent)")
    model = make_tiny_model(tmp_path)
    blocks = {}
    for util in ("0.3", "0.5"):
        with serve(model, "--gpu-memory-utilization", util) as srv:
            assert "pagedserve: device cuda (auto: torch sees" in "".join(srv.log)
            with srv.client() as c:
                info = c.server_info()
            assert info.device.startswith("cuda")
            blocks[util] = info.num_gpu_blocks
    per_block = _per_block(2)  # bfloat16
    total = torch.cuda.mem_get_info()[1]
    # vLLM's meaning: the pool gets the share of total memory less a fixed cost, so 0.2 more of it is
    # 0.2 x total more bytes of blocks
    assert abs((blocks["0.5"] - blocks["0.3"]) * per_block - 0.2 * total) < 0.01 * total, blocks


if __name__ == "__main__":  # rewrite docs/api.md's table from the parser
    doc = ROOT / "docs" / "api.md"
    head, rest = doc.read_text().split("<!-- vllm-flags:start -->\n", 1)
    doc.write_text(head + "<!-- vllm-flags:start -->\n" + markdown_table(VLLM["flags"], build_parser())
                   + "<!-- vllm-flags:end -->" + rest.split("<!-- vllm-flags:end -->", 1)[1])
