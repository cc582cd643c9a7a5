"""``python -m benchmarks soak``: the HTTP kill soak of issue 41, acceptance 6.

``pagedserve serve`` (the embedded model unless ``--model``, a small KV pool, so
requests preempt each other) gets ``--clients`` threads, each sending the
``openai`` client's requests in a fixed mix (chat and completions, streamed and
not, n 1 and 2, greedy and seeded: ``benchmarks/soak_client.py``), while every
``--kill-every`` seconds one launcher-managed component is killed with SIGKILL,
in turn gpuworker, blockmgr, scheduler, frontend; the launcher restarts it.

Each request ends as one of:
- ``ok``: n choices, each ``length`` (EOS ignored), usage right, and, once the
  warm-up (no kill) has answered the same request, the same text;
- ``cut_by_frontend_kill``: its connection dropped after it was sent, while a
  frontend kill was taking effect (a stream open when the frontend died, a
  non-streamed request in flight then, or one sent on a pooled connection to the
  dead frontend). A client sees ``httpx.RemoteProtocolError`` (the ``openai``
  client: ``APIConnectionError``); the request is not retried, as its tokens may
  already have been shown: the caller decides, as with vLLM when its server dies;
- ``failed``: anything else (a 4xx/5xx that is not a refusal, an error event in
  a stream, a wrong or short answer, a refusal that never ended, a hang).

A connection refused while the frontend is down and a 503/429 are retried by the
client (after 0.5 s, after ``Retry-After``); every refusal is recorded with its
``Retry-After`` and whether it fell in a recovery window (from a kill until
``/health`` is 200 again for 2 s). Verdicts, from the data: zero failed, every
refusal carries ``Retry-After``, each component killed and restarted.

    python -m benchmarks soak --duration 360 --out docs/results/soak-http-2026-12-06.json
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any

from benchmarks import soak_client as sc
from pagedserve.bench.workloads import machine_info

VICTIMS = ("gpuworker", "blockmgr", "scheduler", "frontend")
SERVING = re.compile(r"serving (\S+): .* \(pids (.*)\)")
RESTARTED = re.compile(r"pagedserve: restarted (\w+) \(pid (\d+)\)")
STEADY_S = 2.0  # /health 200 this long: a recovery is over


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``pagedserve serve`` in a child process; its log lines with their times."""

    def __init__(self, args: list[str], start_timeout_s: float = 900.0) -> None:
        self.port = free_port()
        self.cmd = [sys.executable, "-m", "pagedserve", "serve", "--port", str(self.port),
                    "--grpc-port", str(free_port()), *args]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[tuple[float, str]] = []
        self.pids: dict[str, int] = {}
        self.model = ""
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(start_timeout_s) or not self.pids:
            self.stop()
            raise RuntimeError("pagedserve serve did not start:\n" + "".join(s for _, s in self.log[-40:]))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append((time.monotonic(), line))
            if (m := SERVING.search(line)) and not self.pids:
                self.model = m.group(1)
                self.pids = {k: int(v) for k, v in (p.split("=") for p in m.group(2).split(", "))}
                self.ready.set()
            elif m := RESTARTED.search(line):
                self.pids[m.group(1)] = int(m.group(2))
        self.ready.set()

    def restarts(self, name: str, since: float) -> list[tuple[float, int]]:
        return [(t, int(m.group(2))) for t, line in list(self.log)
                if t >= since and (m := RESTARTED.search(line)) and m.group(1) == name]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class Health:
    """Polls ``/health`` every 0.1 s; keeps each change of its answer (200, 503, refused, ...)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.changes: list[tuple[float, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def probe(self) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", "/health")
            return str(conn.getresponse().status)
        except ConnectionRefusedError:
            return "refused"
        except (OSError, http.client.HTTPException) as e:
            return type(e).__name__
        finally:
            conn.close()

    def _run(self) -> None:
        while not self.stop.wait(0.1):
            state = self.probe()
            if not self.changes or self.changes[-1][1] != state:
                self.changes.append((time.monotonic(), state))

    def steady_since(self, after: float) -> float | None:
        """The start of the first stretch after ``after`` with 200 for STEADY_S, or None."""
        now = time.monotonic()
        for i, (t, state) in enumerate(self.changes):
            if state != "200":
                continue
            end = self.changes[i + 1][0] if i + 1 < len(self.changes) else now
            start = max(t, after)
            if end - start >= STEADY_S:
                return start
        return None


def run_soak(a: argparse.Namespace) -> dict[str, Any]:
    serve_args = [*(["--model", a.model] if a.model else []), "--kv-cache-memory", a.kv_cache_memory,
                  "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs)]
    t_start = time.monotonic()
    server = Server(serve_args)
    started_s = time.monotonic() - t_start
    print(f"soak: {server.model} served after {started_s:.0f} s; warm-up {a.warmup:g} s", file=sys.stderr, flush=True)
    health = Health(server.port)
    sc.MODEL = server.model
    work = sc.jobs(a.seed)
    outcomes: list[sc.Outcome] = []
    reference: dict[int, dict[int, tuple[str, str]]] = {}
    lock = threading.Lock()
    stop = threading.Event()
    warm = threading.Event()  # set when the warm-up (no kill) ends
    t_end = [time.monotonic() + a.duration]

    def client(i: int) -> None:
        import openai

        c = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="soak", max_retries=0)
        k = i
        while not stop.is_set():
            job = work[k % len(work)]
            k += a.clients
            out = sc.run_one(c, job, t_end[0] + sc.DEADLINE_S)
            with lock:
                if not warm.is_set() and out.status == "ok" and job.key not in reference:
                    reference[job.key] = out.answer  # the undisturbed answer (checked like any other below)
                outcomes.append(out)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(a.clients)]
    for t in threads:
        t.start()
    time.sleep(a.warmup)
    warm.set()
    kills: list[dict[str, Any]] = []
    k = 0
    while time.monotonic() + a.kill_every < t_end[0] or k < len(VICTIMS) * a.min_rounds:
        time.sleep(a.kill_every)
        victim = VICTIMS[k % len(VICTIMS)]
        kills.append(kill_and_wait(server, health, victim))
        print(f"soak: {len(outcomes)} requests so far; killed {victim}: restarted after {kills[-1]['restart_s']} s, "
              f"steady again after {kills[-1]['recovered_s']} s", file=sys.stderr, flush=True)
        k += 1
        t_end[0] = max(t_end[0], time.monotonic())
    stop.set()
    for t in threads:
        t.join(sc.DEADLINE_S + 30)
    health.stop.set()
    rc = server.stop()
    return summarize(a, server, health, work, outcomes, reference, kills, started_s, rc)


def kill_and_wait(server: Server, health: Health, victim: str) -> dict[str, Any]:
    """SIGKILL ``victim``; wait for the launcher's restart and for /health to be steady again."""
    old = server.pids[victim]
    t_kill = time.monotonic()
    os.kill(old, signal.SIGKILL)
    rec: dict[str, Any] = {"victim": victim, "t": t_kill, "pid": old, "new_pid": None, "restart_s": None,
                           "recovered_s": None}
    deadline = t_kill + 180
    while time.monotonic() < deadline:
        again = server.restarts(victim, t_kill)
        if again and rec["new_pid"] is None:
            rec["new_pid"], rec["restart_s"] = again[0][1], round(again[0][0] - t_kill, 2)
        steady = health.steady_since(again[0][0]) if again else None
        if steady is not None:
            rec["recovered_s"] = round(steady - t_kill, 2)
            break
        time.sleep(0.2)
    return rec


def summarize(a: argparse.Namespace, server: Server, health: Health, work: list[sc.Job],
              outcomes: list[sc.Outcome], reference: dict[int, dict[int, tuple[str, str]]],
              kills: list[dict[str, Any]], started_s: float, rc: int) -> dict[str, Any]:
    windows = [(k["victim"], k["t"], k["t"] + (k["recovered_s"] if k["recovered_s"] is not None else 180.0))
               for k in kills]
    fe_windows = [(t0, t1) for v, t0, t1 in windows if v == "frontend"]

    def window_of(t: float) -> str | None:
        return next((v for v, t0, t1 in windows if t0 <= t <= t1), None)

    by_key = {j.key: j for j in work}
    counts = {"ok": 0, "cut_by_frontend_kill": 0, "failed": 0}
    failed: list[dict[str, Any]] = []
    cut: list[dict[str, Any]] = []
    refusals: list[dict[str, Any]] = []
    per_kind: dict[str, dict[str, int]] = {}
    retried_connects = 0
    for o in outcomes:
        status, why = o.status, o.why
        if status == "ok":
            why = sc.check_answer(by_key[o.job], o, reference.get(o.job)) or ""
            status = "failed" if why else "ok"
        elif status == "cut":
            fe = any(t0 <= o.t1 and o.t0 <= t1 + 1.0 for t0, t1 in fe_windows)  # open while the frontend died
            status = "cut_by_frontend_kill" if fe else "failed"
        counts[status] += 1
        per_kind.setdefault(o.kind, dict.fromkeys(counts, 0))[status] += 1
        retried_connects += bool(o.refused_connects)
        rec = {"job": o.job, "kind": o.kind, "t": round(o.t0 - kills[0]["t"], 2) if kills else o.t0,
               "seconds": round(o.t1 - o.t0, 2), "why": why, "window": window_of(o.t1)}
        if status == "failed":
            failed.append(rec)
        elif status == "cut_by_frontend_kill":
            cut.append({**rec, "first_chunk_seen": o.got_first_chunk})
        for r in o.refusals:
            refusals.append({**r, "t": round(r["t"] - t_zero(kills, o), 2), "window": window_of(r["t"]),
                             "job": o.job})
    refused_in_window = [r for r in refusals if r["window"]]
    verdicts = {
        "zero_failed": counts["failed"] == 0,
        "every_refusal_in_a_recovery_window_has_retry_after": all(
            r["retry_after"] is not None for r in refused_in_window),
        "every_refusal_has_retry_after": all(r["retry_after"] is not None for r in refusals),
        "every_component_killed_and_restarted": all(
            any(k["victim"] == v and k["new_pid"] for k in kills) for v in VICTIMS),
        "every_kill_recovered": all(k["recovered_s"] is not None for k in kills),
        "some_requests_answered_after_each_kill": all(
            any(o.status == "ok" and o.t0 > k["t"] for o in outcomes) for k in kills),
    }
    log = "".join(s for _, s in server.log)
    return {
        "benchmark": "soak (HTTP, kills)", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "loadavg_at_end": os.getloadavg(),
        "command": "python -m benchmarks soak " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["soak"] else []),
        "server_command": " ".join(server.cmd[1:]), "server_exit_code": rc, "server_started_s": round(started_s, 1),
        "model": server.model, "clients": a.clients, "duration_s": a.duration, "kill_every_s": a.kill_every,
        "warmup_s": a.warmup,
        "baseline": "each request's text against its own first answer in the warm-up (no kill)",
        "jobs": [j.kind() + (" seeded" if j.seed is not None else " greedy") for j in work],
        "references": len(reference), "requests": len(outcomes), "counts": counts, "per_kind": per_kind,
        "requests_that_retried_a_refused_connection": retried_connects,
        "kills": [{**k, "t": round(k["t"] - kills[0]["t"], 2)} for k in kills],
        "refusals": {"total": len(refusals), "in_recovery_windows": len(refused_in_window),
                     "with_retry_after": sum(r["retry_after"] is not None for r in refusals),
                     "without_retry_after": [r for r in refusals if r["retry_after"] is None],
                     "by_status": {s: sum(r["status"] == s for r in refusals) for s in (429, 503)},
                     "first": refusals[:20]},
        "failed": failed[:50], "cut_by_frontend_kill": cut[:50],
        "health_changes": [(round(t - kills[0]["t"], 2) if kills else t, s) for t, s in health.changes][:400],
        "server_log_tracebacks": log.count("Traceback"),
        "verdicts": verdicts, "passed": all(verdicts.values()),
    }


def t_zero(kills: list[dict[str, Any]], o: sc.Outcome) -> float:
    return kills[0]["t"] if kills else o.t0


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=360.0, help="seconds of load after the warm-up")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds of load before the first kill")
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills")
    p.add_argument("--min-rounds", type=int, default=1, help="kill each component at least this often")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--model", default=None, help="none: the embedded model")
    p.add_argument("--kv-cache-memory", default="24MiB")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--seed", type=int, default=41)
    p.add_argument("--out", default=None, help="write the results JSON here")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    a = parse(argv)
    res = run_soak(a)
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    c = res["counts"]
    print(f"soak: {res['requests']} requests: {c['ok']} ok, {c['cut_by_frontend_kill']} cut by a frontend kill, "
          f"{c['failed']} failed; kills {[(k['victim'], k['recovered_s']) for k in res['kills']]}; refusals "
          f"{res['refusals']['total']} ({res['refusals']['with_retry_after']} with Retry-After); "
          f"verdicts {res['verdicts']}")
    return 0 if res["passed"] else 1
