"""Run by tests/test_ray_serve.py in the Ray venv: one replica (SIMULATED worker) behind the
ingress; prints one JSON line with the HTTP status of each request."""
from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

import ray
from ray import serve

from pagedserve.rayserve.engine import free_port
from pagedserve.rayserve.app import build_app


def post(url: str, body: dict) -> int:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def main() -> int:
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")  # a shared machine: no OOM killer on replicas
    ray.init(num_cpus=2, logging_level="ERROR")
    port = free_port("127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = ["--worker", "sim", "--num-gpu-blocks", "64", "--max-model-len", "256"]
    serve.run(build_app(None, args, 1, "kv", env={"PAGEDSERVE_SIM_COST_MODEL": "none"}), name="pagedserve",
              route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    codes = {
        "ok": post(url, {"prompt": list(range(100, 120)), "max_tokens": 4}),
        "ok_stream": post(url, {"prompt": list(range(100, 120)), "max_tokens": 4, "stream": True}),
        "too_long": post(url, {"prompt": list(range(100, 400)), "max_tokens": 4}),
        "too_long_stream": post(url, {"prompt": list(range(100, 400)), "max_tokens": 4, "stream": True}),
        "max_tokens_0": post(url, {"prompt": [1, 2, 3], "max_tokens": 0}),
        "bad_ids": post(url, {"prompt": [1, -2, 3], "max_tokens": 4}),
        "after": post(url, {"prompt": list(range(100, 120)), "max_tokens": 4}),
    }
    print("RAY_REFUSALS " + json.dumps(codes), flush=True)
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
