"""How much of guidellm's TTFT at its start is guidellm's own? (issue 23, TTFT p99)

A null server: an OpenAI-style `/v1/completions` that streams its chunks at once
(the first immediately, then one every 20 ms, sleeping, no model) and notes when
each request arrived. guidellm runs against it as `bench-guidellm-peers.py`
runs it against the real servers (warm-up, then a constant rate), a few times.
Prints, for the first requests of each run, guidellm's TTFT beside the time
from guidellm's send timestamp to the request's arrival here: what a server
cannot make shorter.

    .venv/bin/python scripts/experiments/guidellm_null_server.py --guidellm /tmp/gl/bin/guidellm
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from pagedserve.bench.guidellm import guidellm_run, sends_and_ttfts, warm_up
from pagedserve.common.default_model import resolve_model

arrivals: list[tuple[float, int]] = []  # (arrival time, max_tokens)


class NullHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._json({"object": "list", "data": [{"id": "null", "object": "model", "owned_by": "null"}]})

    def do_POST(self) -> None:
        t = time.time()
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
        n = int(req.get("max_tokens") or 16)
        arrivals.append((t, n))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(n):
            chunk = {"id": "cmpl-null", "object": "text_completion", "created": int(t), "model": "null",
                     "choices": [{"index": 0, "text": " a", "logprobs": None,
                                  "finish_reason": "length" if i == n - 1 else None}]}
            if i == n - 1:
                chunk["usage"] = {"prompt_tokens": 64, "completion_tokens": n, "total_tokens": 64 + n}
            self._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
            time.sleep(0.02)
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guidellm", required=True)
    p.add_argument("--rate", type=float, default=1.6)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--show", type=int, default=3, help="requests shown per run")
    args = p.parse_args()
    model_dir = resolve_model(None)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NullHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    warm_up(args.guidellm, url, model_dir, 64, 64, Path("/tmp/guidellm-null-warm.json"))
    worst: list[float] = []
    for run in range(args.runs):
        arrivals.clear()
        bench = guidellm_run(args.guidellm, url, model_dir, f"kind=constant,rate={args.rate}",
                               f"kind=max_duration,seconds={args.seconds}", 64, 64, Path("/tmp/guidellm-null.json"))
        reqs = sends_and_ttfts(bench)
        got = sorted(t for t, _ in arrivals)
        ttfts = [ttft for _, ttft in reqs]
        worst.append(max(ttfts))
        print(f"run {run + 1}: {len(reqs)} requests ({len(got)} arrived here), TTFT max {max(ttfts):.0f} ms, median "
              f"{sorted(ttfts)[len(ttfts) // 2]:.0f} ms", flush=True)
        for (sent, ttft), arrived in list(zip(reqs, got))[:args.show]:
            print(f"  TTFT {ttft:6.0f} ms, of which guidellm's send to arrival here {(arrived - sent) * 1000:6.0f} ms",
                  flush=True)
    httpd.shutdown()
    print(f"worst TTFT per run (ms): {' '.join(f'{w:.0f}' for w in worst)}")


if __name__ == "__main__":
    main()
