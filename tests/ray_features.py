"""Run by tests/test_ray_ingress.py in the Ray venv: the same requests to a single
engine (`pagedserve serve`, the embedded SmolLM2) and through the Ray ingress (two
replicas of it, same SERVE_ARGS); prints one JSON line per probe with both answers
normalized (ids and timestamps out), then the /metrics and /health summaries."""
from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import ray
from ray import serve

from pagedserve.rayserve.app import build_app, shutdown
from pagedserve.rayserve.engine import free_port, start_engine

KEY = "feature-test-key-1"
SERVE_ARGS = ["--api-key", KEY, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
              "--max-model-len", "2048", "--num-gpu-blocks", "256"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer briefly."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
G = {"temperature": 0, "max_tokens": 12}
S = {"temperature": 0.8, "seed": 1234, "max_tokens": 12}  # seeded: the same sample on any engine
PROBES: list[tuple[str, str, str, Any, str | None]] = [  # name, method, path, body, key
    ("models", "GET", "/v1/models", None, KEY),
    ("models_no_key", "GET", "/v1/models", None, None),
    ("completion", "POST", "/v1/completions", {"prompt": "The capital of France is", **G}, KEY),
    ("completion_wrong_key", "POST", "/v1/completions", {"prompt": "Hi", **G}, "wrong-key-123"),
    ("completion_stream", "POST", "/v1/completions", {"prompt": "Once upon a time", "stream": True, **G}, KEY),
    ("completion_ids", "POST", "/v1/completions", {"prompt": [504, 3458, 282, 4649, 314], **G}, KEY),
    ("completion_n2", "POST", "/v1/completions", {"prompt": "Water is", "n": 2, **S}, KEY),
    ("completion_n2_greedy", "POST", "/v1/completions", {"prompt": "Water is", "n": 2, **G}, KEY),
    ("completion_logprobs", "POST", "/v1/completions", {"prompt": "One, two,", "logprobs": 2, "echo": True, **G},
     KEY),
    ("completion_stop", "POST", "/v1/completions",
     {"prompt": "List: apples, pears,", "stop": [","], "include_stop_str_in_output": False, **G}, KEY),
    ("chat", "POST", "/v1/chat/completions", {"messages": ASK, **G}, KEY),
    ("chat_stream", "POST", "/v1/chat/completions",
     {"messages": ASK, "stream": True, "stream_options": {"include_usage": True}, **G}, KEY),
    ("chat_n2_logprobs", "POST", "/v1/chat/completions",
     {"messages": ASK, "n": 2, "logprobs": True, "top_logprobs": 3, **S}, KEY),
    ("chat_stop", "POST", "/v1/chat/completions", {"messages": ASK, "stop": ["."], **G}, KEY),
    ("chat_json_schema", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Give a person as JSON."}], "temperature": 0, "max_tokens": 40,
      "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}, KEY),
    ("chat_json_object", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "A JSON object, please."}], "temperature": 0, "max_tokens": 20,
      "response_format": {"type": "json_object"}}, KEY),
    ("tools_named", "POST", "/v1/chat/completions",
     {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "temperature": 0, "max_tokens": 100}, KEY),
    ("tools_required", "POST", "/v1/chat/completions",
     {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 100}, KEY),
    ("tools_auto", "POST", "/v1/chat/completions",
     {"messages": ASK, "tools": TOOLS, "tool_choice": "auto", "temperature": 0, "max_tokens": 100}, KEY),
    ("tools_named_stream", "POST", "/v1/chat/completions",
     {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "temperature": 0, "max_tokens": 100, "stream": True}, KEY),
    ("error_max_tokens", "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": -1}, KEY),
    ("error_unknown_model", "POST", "/v1/chat/completions", {"model": "no-such-model", "messages": ASK, **G}, KEY),
    ("error_bad_json", "POST", "/v1/completions", "{not json", KEY),
    ("error_too_long", "POST", "/v1/completions", {"prompt": [100] * 3000, **G}, KEY),
    ("error_unknown_route", "GET", "/v1/nothing-here", None, KEY),
    ("tokenize", "POST", "/tokenize", {"prompt": "Hello world"}, KEY),
    ("tokenize_chat", "POST", "/tokenize", {"messages": ASK}, KEY),
    ("detokenize", "POST", "/detokenize", {"tokens": [19556, 905]}, KEY),
    ("version", "GET", "/version", None, KEY),
]
RANDOM_ID = re.compile(r"^(chatcmpl|cmpl|modelperm)-")  # an id new per request on any server (vLLM's too)


def normalize(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: "*" if k == "created" or (k == "id" and RANDOM_ID.match(str(v))) else normalize(v)
                for k, v in x.items()}
    if isinstance(x, list):
        return [normalize(v) for v in x]
    if isinstance(x, float):
        return round(x, 2)  # logprobs: a prefix-cache hit changes the last bits of a prefill
    return x


def call(url: str, method: str, path: str, body: Any, key: str | None) -> dict[str, Any]:
    data = None if body is None else (body if isinstance(body, str) else json.dumps(body)).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            status, ctype, raw = r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        status, ctype, raw = e.code, e.headers.get("Content-Type", ""), e.read()
    text = raw.decode()
    if "text/event-stream" in ctype:
        events = [ev.removeprefix("data: ") for ev in text.split("\n\n") if ev.strip()]
        out: Any = [normalize(json.loads(ev)) if ev != "[DONE]" else ev for ev in events]
    else:
        try:
            out = normalize(json.loads(text))
        except ValueError:
            out = text
    return {"status": status, "content_type": ctype.split(";")[0], "body": out}


def families(text: str) -> set[str]:
    return {line.split(" ")[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def metrics(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    samples = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    replicas = sorted({m.group(1) for ln in samples for m in [re.search(r'replica="([^"]+)"', ln)] if m})
    return {"families": sorted(families(text)), "unlabelled": sum(1 for ln in samples if 'replica="' not in ln
                                                                   and not ln.startswith("pagedserve_")),
            "replicas": replicas, "text": text}


RESUME_PROBES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
                              "stream": True, "temperature": 0, "max_tokens": 80}),
    ("/v1/completions", {"prompt": "The history of the Roman Empire began", "stream": True, "temperature": 0,
                         "max_tokens": 80}),
]


def _sse_text(events: list[Any]) -> str:
    return "".join((c.get("text") if "text" in c else (c.get("delta") or {}).get("content")) or ""
                   for e in events if isinstance(e, dict) for c in e.get("choices") or ())


def _wait_healthy(ingress: str, n: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = call(ingress, "GET", "/health", None, None)["body"]
        if isinstance(h, dict) and sum(r["healthy"] for r in h.get("replicas", [])) >= n \
                and h.get("replica_states", {}).get("RUNNING") == n:
            return
        time.sleep(1)
    raise TimeoutError(f"{n} healthy replicas")


def resume_probe(single: str, ingress: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A stream through the ingress whose replica is killed after a few events, against the single engine."""
    _wait_healthy(ingress, 2)
    want = call(single, "POST", path, body, KEY)["body"]
    req = urllib.request.Request(ingress + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    events: list[Any] = []
    killed = ""
    with urllib.request.urlopen(req, timeout=600) as r:
        buf = b""
        while True:
            chunk = r.read1(65536)
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                data = ev.decode().removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
            if len(events) >= 3 and not killed:
                killed = _kill_busy_replica(ingress)
                n_before = len(events)
    return {"route": path, "killed": killed, "events_before_kill": n_before if killed else 0,
            "ray_text": _sse_text(events), "single_text": _sse_text(want), "done": events[-1] == "[DONE]",
            "ids": len({e.get("id") for e in events if isinstance(e, dict)}),
            "errors": [e["error"] for e in events if isinstance(e, dict) and "error" in e]}


def _kill_busy_replica(ingress: str) -> str:
    """ray.kill on the replica with a request in flight (its stats say so within a period)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        reps = call(ingress, "GET", "/health", None, None)["body"]["replicas"]
        busy = [r["replica"] for r in reps if r["in_flight"]]
        if len(busy) == 1:
            for a in ray.util.list_named_actors(all_namespaces=True):
                if a["name"].endswith("#" + busy[0]):
                    ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]))
                    return busy[0]
        time.sleep(0.05)
    return ""


def grpc_probes(single_grpc: str, ingress: str) -> dict[str, Any]:
    """gRPC through the documented path: the ingress names the replica for the prompt, the client talks to it."""
    import grpc

    from pagedserve.client import GenerationClient

    route = call(ingress, "POST", "/pagedserve/route", {"prompt": "The capital of France is"}, KEY)
    wrong = call(ingress, "POST", "/pagedserve/route", {"prompt": "Hi"}, "wrong-key-123")
    out: dict[str, Any] = {"route_status": route["status"], "route_wrong_key": wrong["status"],
                           "route_wrong_key_body": wrong["body"]}
    for name, addr in (("single", single_grpc), ("ray", route["body"]["grpc"])):
        with GenerationClient(addr, api_key=KEY) as c:
            ids, text, reason = c.generate("The capital of France is", timeout=300, max_tokens=12, temperature=0)
            out[name] = {"ids": ids, "text": text, "finish": reason, "model": c.model_info().model_name}
        with GenerationClient(addr, api_key="wrong-key-123") as c:
            try:
                c.model_info()
                out[name]["wrong_key"] = "OK"
            except grpc.RpcError as e:
                out[name]["wrong_key"] = e.code().name
    return out


def main() -> int:
    # A shared test machine runs near its memory limit: Ray's OOM killer would kill replicas, not the culprit
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    single = start_engine(None, SERVE_ARGS, "127.0.0.1")
    try:
        ray.init(num_cpus=4, logging_level="ERROR")
        port = free_port("127.0.0.1")
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(None, SERVE_ARGS, num_replicas=2, router="kv"), name="pagedserve", route_prefix="/")
        ingress = f"http://127.0.0.1:{port}"
        for name, method, path, body, key in PROBES:
            got = {"single": call(single.http_url, method, path, body, key),
                   "ray": call(ingress, method, path, body, key)}
            print("PROBE " + json.dumps({"name": name, **got}), flush=True)
        ms, mr = metrics(single.http_url), metrics(ingress)
        own = [f for f in mr["families"] if f.startswith("pagedserve_router_") or f.startswith("pagedserve_ingress_")]
        routed = re.findall(r'^pagedserve_router_requests_total\{reason="([a-z_]+)"\} ([0-9.]+)', mr["text"], re.M)
        print("METRICS " + json.dumps({"single_families": ms["families"], "ray_families": mr["families"],
                                       "ray_own": own, "ray_unlabelled": mr["unlabelled"],
                                       "ray_replicas": mr["replicas"], "single_unlabelled": ms["unlabelled"],
                                       "routed": {k: float(v) for k, v in routed}}), flush=True)
        print("GRPC " + json.dumps(grpc_probes(single.grpc_addr, ingress)), flush=True)
        hs, hr = call(single.http_url, "GET", "/health", None, None), call(ingress, "GET", "/health", None, None)
        print("HEALTH " + json.dumps({"single": hs, "ray": hr}), flush=True)
        for path, body in RESUME_PROBES:
            print("RESUME " + json.dumps(resume_probe(single.http_url, ingress, path, body)), flush=True)
        text = metrics(ingress)["text"]
        resumed = re.search(r"^pagedserve_ingress_resumed_streams_total ([0-9.]+)", text, re.M)
        print("METRICS_AFTER_KILL " + json.dumps({"resumed": float(resumed.group(1)) if resumed else 0}), flush=True)
    finally:
        shutdown()
        single.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
