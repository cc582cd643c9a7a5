"""The engines `bench peers` compares: pagedserve over its real gRPC server,
transformers' continuous batching, and vLLM's CPU build in its own venv.

Each engine loads once (``start``), then ``run(name)`` serves one workload
(all requests submitted at once, greedy, EOS ignored, each request its own
output length) and returns the wall time from the first submit to the last
token plus every request's output token ids, so the caller can check that
greedy decoding agreed across engines. With ``text`` each engine also
detokenizes, inside the timed run, the way its users get text: pagedserve's
frontend streams it, vLLM's ``SamplingParams(detokenize=True)``, transformers
``batch_decode`` after generating.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pagedserve.bench.serve_proc import ServeProc, start_serve
from pagedserve.common.blocks import cdiv

# One workload: (prompt token ids, output length) per request.
Work = list[tuple[list[int], int]]


@dataclass(frozen=True)
class RunResult:
    seconds: float
    ids: list[list[int]]
    texts: list[str] | None  # each request's text; None on the ids-only path


PEERS_VENV = Path(__file__).resolve().parents[1] / ".venv-peers"
VLLM_WORKER = Path(__file__).with_name("vllm_peer_worker.py")


class Engine(Protocol):
    name: str
    label: str

    def start(self) -> None: ...

    def run(self, workload: str) -> RunResult: ...

    def close(self) -> None: ...

    def pids(self) -> list[int]:
        """Root processes of its own (none for an in-process engine)."""
        ...


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_tree(root: int) -> list[int]:
    """``root`` and every descendant, parents first (from /proc: pagedserve's
    components lead process groups of their own, so the launcher's would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(proc_stat(int(entry))[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def engine_pids(engine: Engine) -> list[int]:
    """Every process of ``engine``, its roots' descendants included."""
    return [pid for root in engine.pids() for pid in process_tree(root)]


def signal_all(pids: list[int], sig: int) -> None:
    """``sig`` to each of ``pids`` that still runs."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def set_paused(engine: Engine, paused: bool) -> None:
    """SIGSTOP (SIGCONT) every process of ``engine``. An idle engine is not
    idle to the CPU: measured here, vLLM's waiting processes made pagedserve's
    Alpaca-like run 20 % slower (8.6-8.9 s instead of 7.2), so each engine is
    measured with the others stopped, as if it had the machine to itself."""
    signal_all(engine_pids(engine), signal.SIGSTOP if paused else signal.SIGCONT)


def _check_lengths(name: str, work: Work, out: list[list[int]]) -> None:
    got = [len(o) for o in out]
    want = [o for _, o in work]
    if got != want:
        bad = sum(g != w for g, w in zip(got, want)) + abs(len(got) - len(want))
        raise RuntimeError(f"{name}: {bad} of {len(want)} requests did not produce their output length")


class PagedserveEngine:
    """`pagedserve serve` as a subprocess; requests over one grpc.aio channel."""

    name, label = "pagedserve", "pagedserve (4 processes, gRPC)"

    def __init__(self, model: str | None, workloads: dict[str, Work], serve_args: list[str],
                 async_scheduling: bool | None = None, text: bool = False) -> None:
        """``async_scheduling``: forced on or off (engine pagedserve-async / -sync); None: the default."""
        self.model, self.workloads, self.serve_args, self.text = model, workloads, serve_args, text
        if async_scheduling is not None:
            self.serve_args = [*serve_args, "--async-scheduling", "on" if async_scheduling else "off"]
            kind = "async" if async_scheduling else "sync"
            self.name, self.label = f"pagedserve-{kind}", f"pagedserve, {kind} scheduling"
        self.server: ServeProc | None = None
        self.addr = ""
        self.idle_gaps = ""  # the worker's summary of its idle time between steps, after close
        self.log_path: Path | None = None  # where close() writes the server's log, runs marked
        self._marks: list[tuple[int, str]] = []  # (log lines before a run, which run)

    def start(self) -> None:
        self.server = start_serve(self.serve_args, self.model)
        self.addr = self.server.grpc_addr
        self._settle()  # warm-up: first-step costs are not throughput

    async def _generate(self, work: Work) -> list[tuple[list[int], str]]:
        from pagedserve.client import AsyncGenerationClient

        async with AsyncGenerationClient(self.addr) as c:
            # detokenize=False: ids only, as the vLLM peer's SamplingParams(detokenize=False) and HF's ids.
            res = await asyncio.gather(*(c.generate(ids, max_tokens=o, temperature=0.0, ignore_eos=True,
                                                    detokenize=self.text, timeout=3600) for ids, o in work))
        return [(list(r[0]), r[1]) for r in res]

    def pids(self) -> list[int]:
        return [] if self.server is None else [self.server.proc.pid]

    def _settle(self) -> None:
        """A two-token request until one is served: after a pause the frontend
        may hold health at NOT_SERVING for a check that timed out meanwhile."""
        import grpc

        deadline = time.monotonic() + 30
        while True:
            try:
                asyncio.run(self._generate([([1, 2, 3], 2)]))
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def run(self, workload: str) -> RunResult:
        work = self.workloads[workload]
        self._settle()  # not timed
        assert self.server is not None
        self._marks.append((len(self.server.log), f"run {len(self._marks) + 1}: {workload}"))
        t0 = time.perf_counter()
        out = asyncio.run(self._generate(work))
        dt = time.perf_counter() - t0
        ids = [i for i, _ in out]
        _check_lengths(self.name, work, ids)
        return RunResult(dt, ids, [t for _, t in out] if self.text else None)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            time.sleep(0.5)  # the log reader takes the worker's last lines
            # The worker's own account of the time scheduling costs it between steps.
            for line in self.server.log:
                if "idle between consecutive steps" in line:
                    self.idle_gaps = line.strip().split(": ", 1)[-1]
                    print(f"bench peers: {self.name}: {line.strip()}", flush=True)
            if self.log_path is not None:
                self._write_log(self.log_path)

    def _write_log(self, path: Path) -> None:
        """The server's log with a line where each timed run began: its prefix-cache
        hit rate, preemptions and any recovery explain a slow round."""
        assert self.server is not None
        lines = list(self.server.log)
        out: list[str] = []
        marks = iter(self._marks)
        mark = next(marks, None)
        for i in range(len(lines) + 1):
            while mark is not None and mark[0] <= i:  # several runs may begin between two lines
                out.append(f"=== bench peers: {mark[1]}\n")
                mark = next(marks, None)
            if i < len(lines):
                out.append(lines[i].rstrip("\n") + "\n")
        text = "".join(out)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as e:
            print(f"bench peers: {path} not written: {e}")


class HFEngine:
    """transformers' continuous batching (``ContinuousBatchingManager``) in
    process, one persistent manager reused across runs; batched ``generate``
    where this transformers lacks it (and the label says so)."""

    name = "hf"

    def __init__(self, model_dir: str, workloads: dict[str, Work], dtype: str = "float32", text: bool = False) -> None:
        self.model_dir, self.workloads, self.dtype, self.text = model_dir, workloads, dtype, text
        self.model: Any = None
        self.tokenizer: Any = None  # with text only
        self.continuous = False
        self.label = "transformers"

    def start(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, self.dtype)).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir) if self.text else None
        self.continuous = hasattr(self.model, "init_continuous_batching")  # transformers >= 5
        self.label = ("transformers continuous batching" if self.continuous
                      else "transformers generate (static batch)")
        works = list(self.workloads.values())
        max_out = max(o for w in works for _, o in w)
        # eos_token_id -1: no token ends a request, as ignore_eos does for the other engines.
        self.gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_out, eos_token_id=-1,
                                           pad_token_id=0)
        if self.continuous:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
            from transformers.generation.continuous_batching.utils import WorkloadHints

            # Sized for the largest workload.
            self.hints = WorkloadHints(max_prompt_length=max(len(p) for w in works for p, _ in w),
                                       max_generated_length=max_out, num_requests=max(len(w) for w in works))
            # One manager, started once, serves every run. No warmup(): on CPU it runs
            # a dummy batch at the largest sizes (tens of seconds); our warm-up run suffices.
            # The cache holds every request of the largest workload at once (no
            # preemption); its default, 60 % of host memory, takes tens of seconds
            # to set up on CPU and crowds out the other engines.
            page = ContinuousBatchingConfig().page_size
            blocks = max(sum(cdiv(len(p) + o, page) for p, o in w) for w in works) + 2
            self.manager = self.model.init_continuous_batching(
                generation_config=self.gen_config, workload_hints=self.hints,
                continuous_batching_config=ContinuousBatchingConfig(num_blocks=blocks))
            self.manager.start()
            self.counter = 0
        self._run_work([([1, 2, 3], 2), ([4, 5], 2)])  # warm-up

    def _run_work(self, work: Work) -> list[list[int]]:
        if not self.continuous:
            return self._static(work)
        import torch

        m = self.manager
        with torch.no_grad():
            ids = [m.add_request(p, request_id=f"r{self.counter}-{i}", max_new_tokens=o, eos_token_id=-1)
                   for i, (p, o) in enumerate(work)]
            if None in ids:
                raise RuntimeError("hf: the manager refused a request")
            self.counter += 1
            results: dict[str, list[int]] = {}
            while len(results) < len(work):
                r = m.get_result(timeout=1)
                if r is not None and r.is_finished():
                    if r.error:
                        raise RuntimeError(f"hf: request {r.request_id} failed: {r.error}")
                    results[r.request_id] = list(r.generated_tokens)
                elif r is None and not m.is_running():
                    raise RuntimeError("hf: the continuous batching thread stopped")
        return [results[i] for i in ids]

    def _static(self, work: Work) -> list[list[int]]:
        import torch

        width, longest = max(len(p) for p, _ in work), max(o for _, o in work)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in work])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in work])
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                                      min_new_tokens=longest, pad_token_id=0)
        # A static batch runs every row to the longest length; each keeps its own.
        return [out[i, width:width + o].tolist() for i, (_, o) in enumerate(work)]

    def run(self, workload: str) -> RunResult:
        work = self.workloads[workload]
        t0 = time.perf_counter()
        out = self._run_work(work)
        texts = None if self.tokenizer is None else self.tokenizer.batch_decode(out, skip_special_tokens=True)
        dt = time.perf_counter() - t0
        _check_lengths(self.name, work, out)
        return RunResult(dt, out, texts)

    def pids(self) -> list[int]:
        return []  # in the bench's own process (its manager thread waits on a queue)

    def close(self) -> None:
        if getattr(self, "manager", None) is not None:
            self.manager.stop(block=True, timeout=30)
            self.manager = None


class VllmEngine:
    """vLLM's offline ``LLM.generate`` in a child process of ``.venv-peers``,
    kept alive across runs; it times each run itself. JSON lines over its
    stdin/stdout (its own logs go to stderr and to lines without the tag)."""

    name, label = "vllm", "vLLM CPU (offline LLM.generate)"
    TAG = "PEER_RESULT "

    def __init__(self, model_dir: str, workloads: dict[str, Work], max_model_len: int,
                 python: Path = PEERS_VENV / "bin" / "python", dtype: str = "float32", text: bool = False) -> None:
        self.model_dir, self.workloads, self.max_model_len, self.python = model_dir, workloads, max_model_len, python
        self.dtype, self.text = dtype, text
        self.proc: subprocess.Popen[str] | None = None
        self.log: list[str] = []

    @staticmethod
    def available(python: Path = PEERS_VENV / "bin" / "python") -> bool:
        return python.is_file()

    def start(self) -> None:
        cfg = {"model": self.model_dir, "max_model_len": self.max_model_len, "dtype": self.dtype, "text": self.text,
               "max_num_seqs": max(len(w) for w in self.workloads.values()),
               "workloads": {k: {"prompts": [p for p, _ in w], "outputs": [o for _, o in w]}
                             for k, w in self.workloads.items()}}
        fd, self.cfg_path = tempfile.mkstemp(prefix="pagedserve-peers-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(cfg, f)
        env = {**os.environ, **vllm_cpu_env()}
        # -I: the script's folder (bench modules named kernel, memory, ...) stays off sys.path.
        self.proc = subprocess.Popen([str(self.python), "-I", str(VLLM_WORKER), self.cfg_path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=tempfile.gettempdir())
        self._read()  # {"ready": true} once the model is loaded and warmed up

    def _read(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(self.TAG):
                msg: dict[str, Any] = json.loads(line[len(self.TAG):])
                if "error" in msg:
                    raise RuntimeError("vllm: " + msg["error"])
                return msg
            self.log.append(line)
        raise RuntimeError("the vLLM worker exited:\n" + "".join(self.log[-40:]))

    def pids(self) -> list[int]:
        return [] if self.proc is None else [self.proc.pid]

    def run(self, workload: str) -> RunResult:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"run": workload}) + "\n")
        self.proc.stdin.flush()
        msg = self._read()
        out = [list(x) for x in msg["token_ids"]]
        _check_lengths(self.name, self.workloads[workload], out)
        return RunResult(float(msg["seconds"]), out, msg["texts"] if self.text else None)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # EOF: the worker exits its loop
                self.proc.wait(60)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "cfg_path", None):
            os.unlink(self.cfg_path)
            self.cfg_path = ""


def vllm_cpu_env() -> dict[str, str]:
    """vLLM CPU settings for a small shared machine (overridable from the environment)."""
    cpus = sorted(os.sched_getaffinity(0))
    defaults = {
        # GiB of KV cache. Without it vLLM reserves 92 % of the host's memory and
        # refuses to start when other processes hold some of it.
        "VLLM_CPU_KVCACHE_SPACE": "4",
        # Every core: "auto" keeps one back for vLLM's scheduler process (half of
        # a 2-core machine); "nobind" left OpenMP unpinned at 1/3 the speed here.
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    return {k: os.environ.get(k, v) for k, v in defaults.items()}
