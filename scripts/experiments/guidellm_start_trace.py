"""What guidellm's start does to the server's steps (issue 23, the p99 TTFT):
`pagedserve serve` with the per-step trace (PAGEDSERVE_STEP_TRACE=1), guidellm's
warm-up, then one constant-rate run while `/proc/loadavg`'s runnable count is
sampled. Prints each request's send time and TTFT (guidellm's), the first
steps of the run with the governor's switches between them, and the runnable
count every 0.5 s.

    .venv/bin/python scripts/experiments/guidellm_start_trace.py --guidellm /tmp/gl/bin/guidellm [--nice -5]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import threading
import time
from pathlib import Path
from types import ModuleType

from pagedserve.bench.serve_proc import start_serve
from pagedserve.common.default_model import resolve_model

STEP = re.compile(r"pagedserve gpuworker: step of (\d+) seqs, (\d+) tokens: wall ([\d.]+) ms, cpu ([\d.]+) ms")
SWITCH = re.compile(r"pagedserve gpuworker: (\d+) -> (\d+) threads")


def bench_script() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "bench-guidellm-peers.py"
    spec = importlib.util.spec_from_file_location("bench_guidellm_peers", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guidellm", required=True)
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--nice", type=int, default=0, help="the server's nice value (guidellm stays at 0)")
    p.add_argument("--show-steps", type=int, default=30)
    args = p.parse_args()
    g = bench_script()
    model_dir = resolve_model(None)
    os.environ["PAGEDSERVE_STEP_TRACE"] = "1"
    srv = start_serve("--device cpu --dtype float32 --kv-cache-memory 1GiB".split(),
                      preexec_fn=(lambda: os.nice(args.nice)) if args.nice else None)
    runnable: list[int] = []  # every 50 ms
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            with open("/proc/loadavg") as f:
                runnable.append(int(f.read().split()[3].split("/")[0]))

    try:
        g.guidellm_run(args.guidellm, srv.http_url, model_dir, "kind=concurrent,streams=8",
                       "kind=max_requests,count=16", 64, 64, Path("/tmp/guidellm-start-warm.json"))
        first_step = len(srv.log)
        t0 = time.time()
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        bench = g.guidellm_run(args.guidellm, srv.http_url, model_dir, f"kind=constant,rate={args.rate}",
                               f"kind=max_duration,seconds={args.seconds}", 64, 64,
                               Path("/tmp/guidellm-start-run.json"))
        done.set()
        th.join()
        lines = srv.log[first_step:]
    finally:
        srv.stop()
    reqs = sorted(bench["requests"]["successful"], key=lambda r: r["info"]["timings"]["request_start"])
    print(f"server nice {args.nice}; guidellm requests (send time after guidellm was started, TTFT):")
    for r in reqs:
        t = r["info"]["timings"]
        print(f"  sent {t['request_start'] - t0:6.2f} s  TTFT {(t['first_token_iteration'] - t['request_start']) * 1000:6.0f} ms")
    print(f"first {args.show_steps} steps of the run (runnable tasks on the machine, most during the run: "
          f"{max(runnable, default=0)}):")
    shown = 0
    for line in lines:
        if (sw := SWITCH.search(line)) is not None:
            print(f"  (then {sw[2]} threads)")
        elif (m := STEP.search(line)) is not None and shown < args.show_steps:
            shown += 1
            print(f"  {m[1]:>3} seqs {m[2]:>4} tokens  wall {float(m[3]):7.1f} ms  cpu {float(m[4]):7.1f} ms")
    print("switches:", sum(SWITCH.search(x) is not None for x in lines))
    print(*(x.strip() for x in srv.log if "contention:" in x))  # the worker's summary, at exit
    print("runnable tasks, every 0.5 s from guidellm's start:",
          " ".join(map(str, runnable[::10])))


if __name__ == "__main__":
    main()
