"""Multi-turn chat through the Kubernetes path, KV-event picking against round-robin
(issue 42, acceptance 4).

    python -m benchmarks kube-multiturn --rounds 3 --out docs/results/kube-multiturn.json

Per run: ``deploy/k8s/podman_kube.py up --replicas 2`` plays deploy/k8s/pagedserve.yaml as two
engine pods (the image from scripts/build-image.sh, --bake-model saves converting in each pod;
podman as root with runc), each warmed with one short request (the CPU kernel is compiled at
first use in the pod); the picker (pagedserve/kvpicker_proxy.py) runs on the host with
``--policy kv`` or ``round-robin``, subscribed to each pod's KV events (5560, replay 5561) and
forwarding to each pod's OpenAI server (8000); the client of benchmarks/multiturn_client.py (the
one ray_multiturn.py uses: 12 users, 600-1,000-token system prompts, 4 growing turns, 24 greedy
tokens, all at once, streamed) talks to the picker; the prefix-cache hit rate comes from each
pod's own /metrics. Then the picker stops and ``down`` removes every pod, container, volume,
secret and network it made. Policies are interleaved round by round (kv, round-robin, then
round-robin, kv, ...) and the table is the median of the rounds; the verdicts come from the
medians: kv ahead on hit rate, TTFT p50, TTFT p99 and throughput, and nothing lost."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.multiturn_client import median_row, prefix_counters, run_once, system_prompt
from pagedserve.bench.serve_proc import stop_process

ROOT = Path(__file__).resolve().parents[1]
KUBE = [sys.executable, str(ROOT / "deploy" / "k8s" / "podman_kube.py")]
HOST_PORTS = (50051, 8000, 9090, 9091, 9092, 9093, 5560, 5561)  # replica 0 publishes its containerPorts
CONFIG = ["PAGEDSERVE_MAX_NUM_SEQS=16"]  # as ray_multiturn.py's replicas (--max-num-seqs 16)


def containers_conf() -> str:
    """Debian's podman as root here: crun fails on setrlimit, runc works (docs/deployment.md)."""
    fd, path = tempfile.mkstemp(prefix="kube-multiturn-", suffix=".conf")
    with os.fdopen(fd, "w") as f:
        f.write('[containers]\ndefault_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]\n[engine]\nruntime = "runc"\n')
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 30) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for(what: str, check: Any, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if check():
                return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{what}: not ready after {timeout_s:.0f} s")


def play(env: dict[str, str], replicas: int, image: str) -> dict[str, str]:
    """The pods, serving and warmed: pod -> its address."""
    r = subprocess.run([*KUBE, "up", "--replicas", str(replicas), "--image", image,
                        *(a for c in CONFIG for a in ("--config", c))], capture_output=True, text=True, env=env,
                       timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"podman_kube.py up: {r.stderr.strip()[-2000:]}")
    r = subprocess.run([*KUBE, "addresses"], capture_output=True, text=True, env=env, timeout=120, check=True)
    pods = dict(line.split() for line in r.stdout.splitlines() if line.strip())
    for pod, ip in pods.items():
        s = wait_for(f"{pod} /health", lambda ip=ip: http(f"http://{ip}:8000/health")[0] == 200, 900)
        # the first request compiles the CPU kernel in the pod: outside the measurement
        status, body = http(f"http://{ip}:8000/v1/completions", {"prompt": "Hi", "max_tokens": 2}, timeout=600)
        if status != 200:
            raise RuntimeError(f"{pod}: warm-up answered {status}: {body[:300]!r}")
        print(f"kube-multiturn: {pod} at {ip} serving {s:.0f} s after play", flush=True)
    return pods


def down(env: dict[str, str]) -> None:
    r = subprocess.run([*KUBE, "down"], capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0:
        print(f"kube-multiturn: podman_kube.py down: {r.stderr.strip()[-1000:]}", file=sys.stderr, flush=True)


def start_picker(pods: dict[str, str], policy: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.kvpicker_proxy", "--port", str(port), "--policy", policy]
    for pod, ip in pods.items():
        cmd += ["--pod", f"{pod}=http://{ip}:8000,tcp://{ip}:5560,tcp://{ip}:5561"]
    log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe nobody reads while the run goes
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True, cwd="/")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("the picker", lambda: proc.poll() is None and http(url + "/picker/state")[0] == 200, 300)
    except TimeoutError:
        proc.kill()
        proc.wait()
        log.seek(0)
        raise RuntimeError(f"the picker did not start: {log.read()[-2000:]}") from None
    finally:
        log.close()  # the child keeps its own descriptor
    return proc, url


def pod_counters(pods: dict[str, str]) -> Any:
    async def counters(session: Any) -> dict[str, tuple[float, float]]:
        out = {}
        for pod, ip in pods.items():
            async with session.get(f"http://{ip}:8000/metrics") as r:
                out[pod] = prefix_counters(await r.text()).get("", (0.0, 0.0))
        return out
    return counters


def one_run(env: dict[str, str], args: argparse.Namespace, policy: str, systems: list[str]) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        pods = play(env, args.replicas, args.image)
        ready_s = time.monotonic() - t0
        proc, url = start_picker(pods, policy, env)
        try:
            res = asyncio.run(run_once(url, systems, args.turns, args.answer, pod_counters(pods)))
            res["picker"] = json.loads(http(url + "/picker/state")[1])
        finally:
            stop_process(proc, 30)
    finally:
        down(env)
    return res | {"policy": policy, "pods_ready_s": round(ready_s, 1)}


def verdicts(table: dict[str, dict[str, Any]]) -> dict[str, bool]:
    kv, rr = table["kv"], table["round-robin"]
    return {"hit_rate_ahead": kv["prefix_hit_rate"] > rr["prefix_hit_rate"],
            "ttft_p50_ahead": kv["ttft_p50_s"] < rr["ttft_p50_s"],
            "ttft_p99_ahead": kv["ttft_p99_s"] < rr["ttft_p99_s"],
            "throughput_ahead": kv["output_tok_s"] > rr["output_tok_s"],
            "nothing_lost": kv["lost"] == 0 and rr["lost"] == 0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kube-multiturn", description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--answer", type=int, default=24, help="tokens per answer")
    p.add_argument("--system-tokens", default="600-1000", help="LO-HI tokens of each user's system prompt")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--image", default=os.environ.get("PAGEDSERVE_IMAGE", "localhost/pagedserve:0.1.0"))
    p.add_argument("--note", default="", help="a line for the results (e.g. the machine's load)")
    p.add_argument("--out", default=None, help="write the results here (JSON)")
    args = p.parse_args(argv)
    if not 1 <= args.users <= 256 or not 1 <= args.turns <= 32 or not 1 <= args.answer <= 4096 \
            or not 2 <= args.replicas <= 8 or not 1 <= args.rounds <= 10:
        p.error("--users 1-256, --turns 1-32, --answer 1-4096, --replicas 2-8, --rounds 1-10")
    busy = []
    for port in HOST_PORTS:
        with socket.socket() as sk:
            if sk.connect_ex(("127.0.0.1", port)) == 0:
                busy.append(port)
    if busy:
        p.error(f"host ports {busy} are in use: podman kube play publishes replica 0's containerPorts there")
    from transformers import AutoTokenizer

    from pagedserve.common.default_model import resolve_model

    lo, hi = (int(x) for x in args.system_tokens.split("-"))
    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    systems = [system_prompt(tok, u, lo, hi) for u in range(args.users)]
    conf = os.environ.get("CONTAINERS_CONF") or containers_conf()
    env = {**os.environ, "CONTAINERS_CONF": conf, "PAGEDSERVE_IMAGE": args.image,
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    policies = ["kv", "round-robin"]
    plan = [(r, pol) for r in range(args.rounds) for pol in (policies if r % 2 == 0 else policies[::-1])]
    started = datetime.datetime.now(datetime.timezone.utc)
    runs: list[dict[str, Any]] = []
    for rnd, policy in plan:
        res = one_run(env, args, policy, systems) | {"round": rnd}
        runs.append(res)
        print(json.dumps({k: v for k, v in res.items() if k not in ("lost", "picker")} | {"lost": len(res["lost"])}),
              flush=True)
    table = {pol: median_row([r for r in runs if r["policy"] == pol]) for pol in policies}
    load = os.getloadavg()
    out = {"benchmark": "kube-multiturn", "date": started.strftime("%Y-%m-%d %H:%M UTC"),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_at_end": load,
                       "podman": subprocess.run(["podman", "--version"], capture_output=True, text=True).stdout.strip(),
                       "note": args.note},
           "config": vars(args) | {"pod_config": CONFIG, "baseline": "round-robin"},
           "runs": runs, "median": table, "verdicts": verdicts(table)}
    print(json.dumps(out["median"]), json.dumps(out["verdicts"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
