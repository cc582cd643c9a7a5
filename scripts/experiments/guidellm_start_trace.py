"""What guidellm's start does to the server's steps (issue 23, the p99 TTFT):
`pagedserve serve` with the per-step trace (PAGEDSERVE_STEP_TRACE=1), guidellm's
warm-up, then one constant-rate run while `/proc/loadavg`'s runnable count is
sampled. Prints each request's send time, TTFT (guidellm's) and when the
frontend logged it (--enable-log-requests); the first steps of the run with the
governor's switches between them and when each ended (the trace's own time, and
when this script saw the line, by 10 ms polls; both from the first request's
send); the runnable count every 0.5 s; and how both cores spent each 100 ms
around the first request (/proc/stat).

    .venv/bin/python scripts/experiments/guidellm_start_trace.py --guidellm /tmp/gl/bin/guidellm [--nice -5] [--own-session]
"""
from __future__ import annotations

import argparse
import os
import re
import threading
import time
from pathlib import Path

from pagedserve.bench.guidellm import guidellm_run, sends_and_ttfts, warm_up
from pagedserve.bench.serve_proc import start_serve
from pagedserve.common.default_model import resolve_model

STEP = re.compile(r"pagedserve gpuworker: step of (\d+) seqs, (\d+) tokens: wall ([\d.]+) ms, cpu ([\d.]+) ms; "
                  r"preempted (\d+), waited (\d+), faults (\d+); ended ([\d.]+)")
RECEIVED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) frontend INFO Received request")
SWITCH = re.compile(r"pagedserve gpuworker: (\d+) -> (\d+) threads")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guidellm", required=True)
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--nice", type=int, default=0, help="the server's nice value (guidellm stays at 0)")
    p.add_argument("--show-steps", type=int, default=30)
    p.add_argument("--own-session", action="store_true", help="the server in a session of its own")
    args = p.parse_args()
    model_dir = resolve_model(None)
    os.environ["PAGEDSERVE_STEP_TRACE"] = "1"
    srv = start_serve("--device cpu --dtype float32 --kv-cache-memory 1GiB --enable-log-requests".split(),
                      preexec_fn=(lambda: os.nice(args.nice)) if args.nice else None, own_session=args.own_session)
    runnable: list[int] = []  # every 50 ms
    cpu: list[tuple[float, list[int]]] = []  # /proc/stat's first line, every 10 ms
    seen: list[float] = []  # when each log line of the run was first seen
    done = threading.Event()

    def sample() -> None:
        n = 0
        while not done.wait(0.01):
            seen.extend([time.time()] * (len(srv.log) - first_step - len(seen)))
            with open("/proc/stat") as f:
                cpu.append((time.time(), [int(x) for x in f.readline().split()[1:9]]))
            n += 1
            if n % 5 == 0:
                with open("/proc/loadavg") as f:
                    runnable.append(int(f.read().split()[3].split("/")[0]))

    try:
        warm_up(args.guidellm, srv.http_url, model_dir, 64, 64, Path("/tmp/guidellm-start-warm.json"))
        first_step = len(srv.log)
        t0 = time.time()
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        bench = guidellm_run(args.guidellm, srv.http_url, model_dir, f"kind=constant,rate={args.rate}",
                               f"kind=max_duration,seconds={args.seconds}", 64, 64,
                               Path("/tmp/guidellm-start-run.json"))
        done.set()
        th.join()
        lines = srv.log[first_step:]
    finally:
        srv.stop()
    reqs = sends_and_ttfts(bench)
    t_first = reqs[0][0]
    received = sorted(time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")) + int(m[2]) / 1000
                      for line in lines if (m := RECEIVED.search(line)) is not None)
    print(f"server nice {args.nice}, launcher in {'its own' if args.own_session else 'this'} session; guidellm requests "
          "(send time after guidellm was started, TTFT, when the frontend logged it):")
    for i, (sent, ttft) in enumerate(reqs):
        got = f"  frontend +{(received[i] - sent) * 1000:5.0f} ms" if i < len(received) else ""
        print(f"  sent {sent - t0:6.2f} s ({(sent - t_first) * 1000:6.0f} ms after the first)  TTFT {ttft:6.0f} ms{got}")
    print(f"first {args.show_steps} steps of the run (runnable tasks on the machine, most during the run: "
          f"{max(runnable, default=0)}):")
    shown = 0
    for i, line in enumerate(lines):
        if (sw := SWITCH.search(line)) is not None:
            print(f"  (then {sw[2]} threads)")
        elif (m := STEP.search(line)) is not None and shown < args.show_steps:
            shown += 1
            seen_at = f", its line seen {(seen[i] - t_first) * 1000:5.0f} ms" if i < len(seen) else ""
            at = f"ended {(float(m[8]) - t_first) * 1000:5.0f} ms{seen_at}"
            print(f"  {m[1]:>3} seqs {m[2]:>4} tokens  wall {float(m[3]):7.1f} ms  cpu {float(m[4]):7.1f} ms  "
                  f"preempted {m[5]:>3} waited {m[6]:>3} faults {m[7]:>5}  {at}")
    print("switches:", sum(SWITCH.search(x) is not None for x in lines))
    print(*(x.strip() for x in srv.log if "contention:" in x))  # the worker's summary, at exit
    print("runnable tasks, every 0.5 s from guidellm's start:",
          " ".join(map(str, runnable[::10])))
    print("both cores' time (ticks of 10 ms) by 100 ms from the first request's send: user, system, idle, "
          "iowait, steal")
    for w in range(-3, 12):
        inside = [v for t, v in cpu if t_first + w / 10 <= t < t_first + (w + 1) / 10]
        if len(inside) >= 2:
            d = [b - a for a, b in zip(inside[0], inside[-1])]
            print(f"  {w * 100:5d} ms: {d[0] + d[1]:3d} {d[2] + d[5] + d[6]:3d} {d[3]:3d} {d[4]:3d} {d[7]:3d}")


if __name__ == "__main__":
    main()
