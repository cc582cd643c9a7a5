"""Issue 13, compose: the four services from compose.yaml with podman-compose
(a seeded tiny Llama mounted): greedy tokens over the published gRPC port
equal transformers, the gateway answers, health checks follow readiness, and
a killed component's container comes back with every stream finished.
Opt-in as tests/test_container.py (PAGEDSERVE_CONTAINER_TESTS=1)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
from e2e_util import Server, free_port, wait_all_free
from grpc_health.v1 import health_pb2
from models import make_tiny_model
from container_util import BLOCK, COMPONENTS, ROOT, Built, compose_binary, grpc_health, http_json, podman, wait_serving

pytestmark = [pytest.mark.container, pytest.mark.slow]


# ---------------------------------------------------------------- compose
@pytest.fixture(scope="session")
def tiny_model() -> Iterator[str]:
    """A seeded tiny Llama in a folder the image's user (uid 10001) can read."""
    root = tempfile.mkdtemp(prefix="pagedserve-container-model-", dir="/var/tmp")
    os.chmod(root, 0o755)
    folder = make_tiny_model(root, "llama", seed=7, num_hidden_layers=2)
    for dirpath, _, files in os.walk(root):
        os.chmod(dirpath, 0o755)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o644)
    yield folder
    shutil.rmtree(root, ignore_errors=True)


@dataclass
class Project:
    name: str
    env: dict[str, str]
    files: list[str]
    addr: str
    http: str
    metrics: dict[str, str] = field(default_factory=dict)

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        cmd = [compose_binary(), "-p", self.name]
        for f in self.files:
            cmd += ["-f", f]
        return subprocess.run([*cmd, *args], capture_output=True, text=True, env=self.env, timeout=timeout,
                              cwd=ROOT)

    def container(self, service: str) -> str:
        return f"{self.name}_{service}_1"

    def logs(self, services: tuple[str, ...] = COMPONENTS, tail: int = 40) -> str:
        out = []
        for s in services:
            r = subprocess.run(["podman", "logs", "--tail", str(tail), self.container(s)], capture_output=True,
                               text=True, env=self.env, timeout=30)
            out.append(f"--- {s}\n{r.stdout}{r.stderr}")
        return "\n".join(out)

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=io.podman.compose.project={self.name}"
        names = {
            "containers": podman(self.env, "ps", "-a", "--filter", label, "--format", "{{.Names}}"),
            "pods": podman(self.env, "pod", "ls", "--filter", label, "--format", "{{.Name}}"),
            "volumes": podman(self.env, "volume", "ls", "--format", "{{.Name}}"),
            "networks": podman(self.env, "network", "ls", "--format", "{{.Name}}"),
        }
        names["pods"] += podman(self.env, "pod", "ls", "--format", "{{.Name}}")  # podman-compose's pod_NAME
        return {k: sorted({n for n in v.split() if self.name in n or k == "containers"}) for k, v in names.items()}


@pytest.fixture(scope="module")
def project(podman_env: dict[str, str], image: Built, tiny_model: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    compose_binary()
    name = f"pstest{os.getpid()}"
    override = tmp_path_factory.mktemp("compose") / "model.override.yaml"
    # The tiny model mounted read-only into every component (compose merges the volume lists).
    mount = f"      - {tiny_model}:/models/tiny:ro\n"
    override.write_text("services:\n" + "".join(f"  {s}:\n    volumes:\n{mount}" for s in COMPONENTS))
    from test_chaos import workload

    need = sum(-(-(len(p) + s["max_tokens"]) // BLOCK) for p, s in workload())
    ports = {k: free_port() for k in ("grpc", "http", "fe", "sched", "bm", "wk")}
    env = {**podman_env, "PAGEDSERVE_IMAGE": image.image, "PAGEDSERVE_MODEL": "/models/tiny",
           "PAGEDSERVE_BLOCK_SIZE": str(BLOCK), "PAGEDSERVE_NUM_GPU_BLOCKS": str(need // 3 + 1),
           "PAGEDSERVE_MAX_NUM_SEQS": "32",
           "PAGEDSERVE_PUBLISH_GRPC": f"127.0.0.1:{ports['grpc']}", "PAGEDSERVE_PUBLISH_HTTP": f"127.0.0.1:{ports['http']}",
           "PAGEDSERVE_PUBLISH_FRONTEND_METRICS": f"127.0.0.1:{ports['fe']}",
           "PAGEDSERVE_PUBLISH_SCHEDULER_METRICS": f"127.0.0.1:{ports['sched']}",
           "PAGEDSERVE_PUBLISH_BLOCKMGR_METRICS": f"127.0.0.1:{ports['bm']}",
           "PAGEDSERVE_PUBLISH_GPUWORKER_METRICS": f"127.0.0.1:{ports['wk']}"}
    p = Project(name, env, [str(ROOT / "compose.yaml"), str(override)], f"127.0.0.1:{ports['grpc']}",
                f"http://127.0.0.1:{ports['http']}",
                {"frontend": f"http://127.0.0.1:{ports['fe']}/metrics",
                 "scheduler": f"http://127.0.0.1:{ports['sched']}/metrics",
                 "blockmgr": f"http://127.0.0.1:{ports['bm']}/metrics",
                 "gpuworker": f"http://127.0.0.1:{ports['wk']}/metrics"})
    try:
        # One `up`, as docs/deployment.md says: keygen starts beside the four, which wait for its keys
        # (the restart tests below fail if a component depends on the exited keygen).
        r = p.compose("up", "-d")
        assert r.returncode == 0, r.stderr[-3000:]
        t0 = time.monotonic()
        wait_serving(p.addr, 900, p.logs)
        print(f"\ncompose: SERVING {time.monotonic() - t0:.1f} s after `up`")
        yield p
    finally:
        r = p.compose("down", "-v", "-t", "20")
        left = p.leftovers()
        assert r.returncode == 0, r.stderr[-3000:]
        assert left == {"containers": [], "pods": [], "volumes": [], "networks": []}, left


def test_compose_greedy_over_published_grpc_equals_transformers(project: Project, tiny_model: str) -> None:
    from test_e2e import hf_greedy, tokenize

    from pagedserve.client import GenerationClient

    prompts = ["The quick brown fox", "Paris is the capital of", "Once upon a time, a small model"]
    with GenerationClient(project.addr) as c:
        got = [c.generate(p, max_tokens=12, temperature=0.0, timeout=120) for p in prompts]
        assert c.model_info().model_name
    for p, (ids, _, _) in zip(prompts, got):
        assert ids == hf_greedy(tiny_model, tokenize(tiny_model, p), 12), p
    # The OpenAI gateway on the published HTTP port: the same greedy text.
    for p, (_, text, _) in zip(prompts, got):
        status, body = http_json(f"{project.http}/v1/completions",
                                 {"prompt": p, "max_tokens": 12, "temperature": 0})
        assert status == 200 and body["choices"][0]["text"] == text, body
    status, body = http_json(f"{project.http}/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    status, _ = http_json(f"{project.http}/health")
    assert status == 200
    _, metrics = http_json(f"{project.http}/metrics")
    assert "vllm:num_requests_running{" in metrics and "vllm:kv_cache_usage_perc{" in metrics
    for name, url in project.metrics.items():  # each component's /metrics on its published port
        status, text = http_json(url)
        assert status == 200 and "pagedserve:" in text, name


def test_compose_health_checks_reflect_readiness(project: Project) -> None:
    for s in COMPONENTS:
        c = project.container(s)
        r = subprocess.run(["podman", "healthcheck", "run", c], capture_output=True, text=True, env=project.env,
                           timeout=60)
        assert r.returncode == 0, f"{s}: {r.stdout}{r.stderr}"
        # The image's own HEALTHCHECK (no arguments: the role read from PID 1) agrees.
        r = subprocess.run(["podman", "exec", c, "pagedserve", "healthcheck"], capture_output=True, text=True,
                           env=project.env, timeout=60)
        assert r.returncode == 0, f"{s}: {r.stdout}{r.stderr}"
        cfg = json.loads(podman(project.env, "inspect", c))[0]
        assert cfg["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped", s
        assert cfg["Config"]["User"].startswith("10001"), s
    # Readiness, not liveness: with the scheduler stopped the frontend is NOT_SERVING and its
    # check fails; once the scheduler is back it passes again.
    podman(project.env, "stop", "-t", "10", project.container("scheduler"))
    try:
        deadline = time.monotonic() + 60
        while grpc_health(project.addr) == health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "frontend still SERVING without a scheduler"
            time.sleep(0.5)
        r = subprocess.run(["podman", "healthcheck", "run", project.container("frontend")], capture_output=True,
                           text=True, env=project.env, timeout=60)
        assert r.returncode != 0, r.stdout
    finally:
        podman(project.env, "start", project.container("scheduler"))
    wait_serving(project.addr, 300, project.logs)


@contextmanager
def torch_cpu_path() -> Iterator[None]:
    """The in-process reference on the torch ops, not the compiled CPU kernel: independent
    of the image's code path, and of a kernel being edited in this working tree meanwhile."""
    from pagedserve.kernels import cpu_build

    old, saved = os.environ.get(cpu_build.DISABLE_ENV), cpu_build.settings()
    os.environ[cpu_build.DISABLE_ENV] = "0"  # read by the in-process ModelRunner (configure_kernels)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(cpu_build.DISABLE_ENV, None)
        else:
            os.environ[cpu_build.DISABLE_ENV] = old
        cpu_build.configure(*saved)  # the runner's switch stays in the kernels otherwise


@pytest.mark.parametrize("victim", ["gpuworker", "blockmgr", "scheduler"])
def test_compose_killed_container_restarts_and_streams_finish(project: Project, tiny_model: str,
                                                              victim: str) -> None:
    """SIGKILL to the component's process (a crash, not `podman stop`): the restart policy
    starts the container again, and every in-flight stream ends with the tokens of an
    undisturbed in-process run."""
    from test_chaos import kill_midway, longest_stall, reference, run_streams, wait_for, workload  # noqa: F401

    jobs = workload()
    with torch_cpu_path():
        expected = reference(tiny_model, jobs)
    server = Server(None, project.addr, {}, [])  # type: ignore[arg-type]  # what the helpers read
    c = project.container(victim)
    before = json.loads(podman(project.env, "inspect", c))[0]
    restarts = int(before.get("RestartCount", 0))
    streams, threads = run_streams(server, jobs)
    total = sum(s["max_tokens"] for _, s in jobs)
    wait_for(lambda: sum(len(s.tokens) for s in streams) >= total // 5, 120, "a fifth of the tokens")
    assert sum(len(s.tokens) for s in streams) < total, "the workload finished before the kill"
    os.kill(int(before["State"]["Pid"]), signal.SIGKILL)
    t_kill = time.monotonic()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "streams still open 300 s after the kill\n" + project.logs()
    after = json.loads(podman(project.env, "inspect", c))[0]
    print(f"\n{victim} container killed: restarted by its policy (restart count {restarts} -> "
          f"{after.get('RestartCount')}), longest stream stall {longest_stall(streams, t_kill):.1f} s")
    assert int(after.get("RestartCount", 0)) > restarts, f"{victim} was not restarted\n{project.logs((victim,))}"
    assert after["State"]["Status"] == "running" and after["State"]["Pid"] != before["State"]["Pid"]
    assert [s.error for s in streams] == [None] * len(jobs), project.logs()
    assert [s.tokens for s in streams] == expected
    wait_serving(project.addr, 120, project.logs)
    wait_all_free(server)
