"""``python -m benchmarks schemathesis``: schemathesis with vLLM 0.32's OpenAPI schema
against ``pagedserve serve`` (issue 41, acceptance 6), on the routes we serve.

- The schema: tests/data/vllm-openapi-0.32.json, vLLM's own ``app.openapi()``
  (tests/data/vllm-openapi-dump.py says how it is made and regenerated).
- schemathesis (4.32.5) lives in a tool venv of its own, not in the engine's
  dependencies: ``--tools-venv`` (default ~/.cache/pagedserve/tools-venv), created
  and filled on first use.
- The server: the embedded model (or ``--model``) with ``--max-model-len 256``,
  so that a generated request without ``max_tokens`` still ends in seconds.
- The checks: every schemathesis check except the two that judge acceptance of
  generated bodies (``positive_data_acceptance``, ``negative_data_rejection``:
  vLLM's schema declares fields as free strings and numbers that both servers
  refuse or accept by value) and ``status_code_conformance`` (vLLM's schema lists
  400/404/422/500 only; both servers also answer 413, 503 ...); those three are
  counted but not verdicts. The verdict is zero ``response_schema_conformance``
  failures and zero 5xx answers from pagedserve (a 503 while it starts aside).
- Probes beside it, from outside: a 405 names ``Allow``; a header with a NUL byte
  is answered 400 and logged with no traceback; ``/tokenize`` takes vLLM's declared
  chat fields; an error's ``code`` is an integer.

Every request and answer comes from schemathesis's HAR report; the JSON written
to ``--out`` has the counts per route and status, the failures by check, the
probes and the verdicts.

    python -m benchmarks schemathesis --max-examples 25 --out docs/results/schemathesis-2026-12-06.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from benchmarks.soak import Server
from pagedserve.bench.workloads import machine_info

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "tests" / "data" / "vllm-openapi-0.32.json"
SCHEMATHESIS = "schemathesis==4.32.5"
# The routes pagedserve serves (frontend/openai_api/http_gateway.py, http_extras.py) that vLLM's schema has.
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
          "/detokenize", "/version")
NOT_VERDICTS = ("positive_data_acceptance", "negative_data_rejection", "status_code_conformance",
                "max_response_time")
# schemathesis's failure codes (``st explain CODE``) and the check that reports each.
CHECK_OF_CODE = {"ST101": "not_a_server_error", "ST102": "not_a_server_error", "ST103": "status_code_conformance",
                 "ST104": "content_type_conformance", "ST105": "content_type_conformance",
                 "ST106": "content_type_conformance", "ST107": "response_headers_conformance",
                 "ST108": "response_schema_conformance", "ST109": "response_schema_conformance",
                 "ST110": "response_schema_conformance", "ST111": "response_schema_conformance",
                 "ST112": "max_response_time", "ST201": "negative_data_rejection",
                 "ST202": "positive_data_acceptance", "ST203": "missing_required_header",
                 "ST204": "unsupported_method", "ST205": "allow_header_conformance", "ST301": "use_after_free",
                 "ST302": "ensure_resource_availability", "ST401": "ignored_auth",
                 "ST402": "object_level_authorization"}


# The generation pass: schemathesis's positive bodies for the two generation routes, each cut down
# to the fields below (every one optional in vLLM's schema, so the body stays schema-valid), with
# max_tokens at most 16 and n at most 2, integers within 32 bits, an empty or malformed prompt or
# messages list replaced by "Hi" (one message); the acceptance checks (positive_data_acceptance ...)
# are off in it, so a refusal by value does not end an operation's examples. Left whole, nearly every generated body carries a value
# that both servers refuse (allowed_token_ids: [] first of all), and no request would generate.
GENERATION_HOOKS = """
import schemathesis

KEEP = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
        "n", "stream", "stop", "seed", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "min_p", "echo", "ignore_eos", "min_tokens", "skip_special_tokens", "user",
        "add_generation_prompt", "include_stop_str_in_output"}


@schemathesis.hook
def map_body(context, body):
    if not isinstance(body, dict):
        return body
    body = {k: v for k, v in body.items() if k in KEEP}
    body["model"] = None
    for key, value in body.items():  # JSON integers past 64 bits: refused by value by both servers
        if isinstance(value, int) and not isinstance(value, bool):
            body[key] = max(-2**31, min(value, 2**31))
    if "messages" in body and not (isinstance(body["messages"], list) and body["messages"]):
        body["messages"] = [{"role": "user", "content": "Hi"}]
    if context.operation is not None and context.operation.path == "/v1/completions":
        body.setdefault("prompt", "Hi")
    if "prompt" in body and not (isinstance(body["prompt"], str) and body["prompt"]):
        body["prompt"] = "Hi"
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool):
            body[key] = max(0, min(body[key], 16))
    body["max_tokens"] = body.get("max_tokens") if body.get("max_tokens") is not None else 8
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool):
        body["n"] = max(1, min(body["n"], 2))
    return body
"""


def tools_venv(path: Path) -> Path:
    """The ``st`` executable of the tool venv, installing schemathesis there first if needed."""
    st = path / "bin" / "st"
    if not st.exists():
        print(f"schemathesis: installing {SCHEMATHESIS} into {path} (a minute)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(path / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        SCHEMATHESIS], check=True)
    return st


def run_schemathesis(st: Path, base: str, work: Path, a: argparse.Namespace,
                     generation: bool = False) -> dict[str, Any]:
    """The whole run on ROUTES; ``generation``: the generation pass (above) in a folder of its own."""
    routes = ("/v1/completions", "/v1/chat/completions") if generation else ROUTES
    regex = "^(" + "|".join(r.replace("/", "\\/") for r in routes) + ")$"
    env = {**os.environ, "NO_COLOR": "1"}
    if generation:
        work = work / "generation"
        work.mkdir(exist_ok=True)
        (work / "hooks.py").write_text(GENERATION_HOOKS)
        env["SCHEMATHESIS_HOOKS"] = str(work / "hooks.py")
    cmd = [str(st), "run", str(SCHEMA), "--url", base, "--include-path-regex", regex,
           *(["--mode", "positive", "--exclude-checks", ",".join(NOT_VERDICTS[:3])] if generation else []),
           "--checks", "all", "--max-examples", str(a.max_examples), "--seed", str(a.seed),
           "--workers", str(a.workers), "--request-timeout", str(a.request_timeout), "--continue-on-failure",
           "--max-response-time", str(a.request_timeout),  # `--checks all` would fail a 10 s answer
           "--suppress-health-check", "all", "--generation-database", "none", "--phases", "fuzzing" if generation else a.phases,
           "--report", "json,har", "--report-json-path", str(work / "report.json"),
           "--report-har-path", str(work / "report.har"), "--no-color", "--output-truncate", "true"]
    if a.max_time:
        cmd += ["--max-time", str(a.max_time)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env)
    (work / "st.log").write_text(p.stdout + p.stderr)
    report = json.loads((work / "report.json").read_text()) if (work / "report.json").exists() else {}
    har = json.loads((work / "report.har").read_text()) if (work / "report.har").exists() else {"log": {}}
    return {"command": cmd[1:], "exit_code": p.returncode, "seconds": round(time.monotonic() - t0, 1),
            "report": report, "entries": har["log"].get("entries", []), "tail": (p.stdout + p.stderr)[-6000:]}


def per_route(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for e in entries:
        key = f"{e['request']['method']} {urlparse(e['request']['url']).path}"
        r = out.setdefault(key, {"requests": 0, "statuses": {}})
        r["requests"] += 1
        s = str(e["response"]["status"])
        r["statuses"][s] = r["statuses"].get(s, 0) + 1
    return dict(sorted(out.items()))


def raw(port: int, data: bytes) -> bytes:
    """One request as bytes (it says ``Connection: close``); the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    return b"".join(chunks)


def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), dict(e.headers)


def probes(server: Server) -> dict[str, Any]:
    """The four defects of issue 41, each checked from outside."""
    port = server.port
    out: dict[str, Any] = {}
    r = raw(port, b"PUT /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    head = r.split(b"\r\n\r\n")[0].decode("latin-1")
    allow = next((h.split(":", 1)[1].strip() for h in head.split("\r\n") if h.lower().startswith("allow:")), None)
    out["405_allow"] = {"status_line": head.split("\r\n")[0], "allow": allow,
                        "ok": " 405 " in head.split("\r\n")[0] and allow is not None and "POST" in allow}
    n_log = len(server.log)
    r = raw(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Probe: a\x00b\r\nConnection: close\r\n\r\n")
    time.sleep(1.0)
    new = "".join(s for _, s in server.log[n_log:])
    out["nul_header"] = {"status_line": r.split(b"\r\n")[0].decode("latin-1"), "traceback_logged": "Traceback" in new,
                         "error_lines_logged": sum("ERROR" in line for line in new.splitlines())}
    out["nul_header"]["ok"] = " 400 " in out["nul_header"]["status_line"] and not out["nul_header"]["traceback_logged"]
    status, body, _ = post(port, "/tokenize", {"model": server.model, "messages": [{"role": "user", "content": "hi"}],
                                               "add_generation_prompt": True, "continue_final_message": False,
                                               "add_special_tokens": False, "return_token_strs": True})
    out["tokenize_chat_fields"] = {"status": status, "ok": status == 200 and bool(body.get("tokens"))}
    status, body, _ = post(port, "/detokenize", {"model": server.model, "tokens": [1, 2, 3]})
    out["detokenize"] = {"status": status, "ok": status == 200 and "prompt" in body}
    status, body, _ = post(port, "/v1/completions", {"model": server.model, "prompt": "x", "max_tokens": -1})
    code = body.get("error", {}).get("code")
    out["error_code_integer"] = {"status": status, "code": code, "type": body.get("error", {}).get("type"),
                                 "ok": status == 400 and type(code) is int and code == 400}
    return out


def summarize(a: argparse.Namespace, server: Server, runs: dict[str, dict[str, Any]], probe: dict[str, Any],
              started_s: float, rc: int) -> dict[str, Any]:
    entries = [e for st in runs.values() for e in st["entries"]]
    routes = per_route(entries)
    fails: dict[str, dict[str, Any]] = {}
    for f in (f for st in runs.values() for f in st["report"].get("failures", [])):
        g = fails.setdefault(CHECK_OF_CODE.get(f["code"], f["code"]), {"count": 0, "titles": [], "operations": []})
        g["count"] += f["count"]
        g["titles"] = sorted(set(g["titles"]) | {f"{f['code']} {f['title']}"})
        g["operations"] = sorted(set(g["operations"]) | set(f.get("operations") or []))
    five = [f"{e['request']['method']} {urlparse(e['request']['url']).path} {e['response']['status']}"
            for e in entries if e["response"]["status"] >= 500]
    schema_fails = fails.get("response_schema_conformance", {"count": 0})["count"]
    generated_200 = sum(v["statuses"].get("200", 0) for k, v in per_route(runs["generation"]["entries"]).items())
    verdicts = {
        "zero_response_schema_violations": schema_fails == 0 and bool(entries),
        "zero_5xx": not five,
        "every_route_tested": all(any(k.endswith(" " + r) for k in routes) for r in ROUTES),
        "schemathesis_completed": all(st["report"].get("complete") for st in runs.values()),
        "generation_answered": generated_200 > 0,
        "probes_pass": all(p["ok"] for p in probe.values()),
        "zero_failures_of_other_checks": not any(k not in NOT_VERDICTS for k in fails),
    }
    passes = {name: {"command": " ".join(r["command"]), "exit_code": r["exit_code"], "seconds": r["seconds"],
                     "requests": len(r["entries"]), "test_cases": r["report"].get("test_cases"),
                     "errors": r["report"].get("errors"), "per_route": per_route(r["entries"])}
              for name, r in runs.items()}
    log = "".join(s for _, s in server.log)
    return {
        "benchmark": "schemathesis with vLLM 0.32's OpenAPI schema",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info(),
        "schemathesis": SCHEMATHESIS, "schema": str(SCHEMA.relative_to(ROOT)),
        "command": "python -m benchmarks schemathesis " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["schemathesis"]
                                                                   else []),
        "passes": {k: {kk: vv for kk, vv in v.items() if kk != "per_route"} for k, v in passes.items()},
        "generation_pass_per_route": passes["generation"]["per_route"],
        "server_command": " ".join(server.cmd[1:]), "server_started_s": round(started_s, 1),
        "server_exit_code": rc, "routes": list(ROUTES), "requests": len(entries), "per_route": routes,
        "five_xx": five[:50],
        "failures_by_check": fails, "not_verdicts": list(NOT_VERDICTS),
        "verdict_checks_failed": {k: v["count"] for k, v in fails.items() if k not in NOT_VERDICTS},
        "violations": {"response_schema_conformance": schema_fails,
                       **{k: v["count"] for k, v in fails.items() if k != "response_schema_conformance"}},
        "probes": probe,
        "server_log_tracebacks": log.count("Traceback"),
        "st_output_tail": {k: r["tail"] if not all(verdicts.values()) else r["tail"][-1500:] for k, r in runs.items()},
        "verdicts": verdicts, "passed": all(verdicts.values()),
    }


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks schemathesis", description=__doc__.split("\n\n")[0])
    p.add_argument("--max-examples", type=int, default=25, help="test cases per operation and phase at most")
    p.add_argument("--phases", default="examples,coverage,fuzzing")
    p.add_argument("--max-time", type=float, default=None, help="seconds for the whole run at most")
    p.add_argument("--workers", type=int, default=1, help="more than 1 made schemathesis fail on its own (an AST error in its threads)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=41)
    p.add_argument("--model", default=None, help="none: the embedded model")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--kv-cache-memory", default="64MiB")
    p.add_argument("--tools-venv", type=Path, default=Path.home() / ".cache" / "pagedserve" / "tools-venv")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="keep schemathesis's reports and output here (default: a temporary folder)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    a = parse(argv)
    st_exe = tools_venv(a.tools_venv)
    t0 = time.monotonic()
    server = Server([*(["--model", a.model] if a.model else []), "--max-model-len", str(a.max_model_len),
                     "--kv-cache-memory", a.kv_cache_memory])
    started = time.monotonic() - t0
    try:
        with tempfile.TemporaryDirectory(prefix="pagedserve-st-") as d:
            work = a.work_dir or Path(d)
            work.mkdir(parents=True, exist_ok=True)
            probe = probes(server)
            base = f"http://127.0.0.1:{server.port}"
            runs = {"all": run_schemathesis(st_exe, base, work, a),
                    "generation": run_schemathesis(st_exe, base, work, a, generation=True)}
    finally:
        rc = server.stop()
    res = summarize(a, server, runs, probe, started, rc)
    if a.out:
        with open(a.out, "w") as f:
            f.write(json.dumps(res, indent=1) + "\n")
    print(f"schemathesis: {res['requests']} requests, violations {res['violations']}, 5xx {len(res['five_xx'])}; "
          f"probes {[k for k, v in probe.items() if not v['ok']] or 'all pass'}; verdicts {res['verdicts']}")
    return 0 if res["passed"] else 1
