"""Issue 13: the real deployment. The image is built with podman
(scripts/build-image.sh: a debootstrap'd base, then the Dockerfile), the four
services start from compose.yaml with podman-compose, and the Kubernetes
manifests run with ``podman kube play``:

- a gRPC client on the host gets greedy tokens equal to transformers through
  the published port, and the OpenAI gateway answers the same text;
- a component's container killed with SIGKILL mid-stream is brought back by
  its restart policy and every in-flight stream finishes with exactly the
  tokens of an undisturbed run;
- ``podman kube play deploy/k8s/...`` starts the pod and answers (SmolLM2,
  greedy tokens equal transformers);
- tear-down leaves no container, pod, volume, network or secret behind.

Opt-in (it builds an image and starts containers: about 5-10 minutes on two
cores): ``PAGEDSERVE_CONTAINER_TESTS=1`` (``PAGEDSERVE_BUILD_REF=HEAD`` builds the
last commit instead of the working tree; ``PAGEDSERVE_CONTAINER_NO_BUILD=1`` reuses
an existing image), with podman usable (as root; on hosts
where crun fails on setrlimit, runc is used when installed) and podman-compose
installed (``pip install podman-compose``). Otherwise every test is skipped
with the reason, which ``scripts/test`` (-rs) prints in its summary.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from e2e_util import Server, free_port, wait_all_free
from grpc_health.v1 import health_pb2, health_pb2_grpc
from models import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
OPT_IN = "PAGEDSERVE_CONTAINER_TESTS"
IMAGE = os.environ.get("PAGEDSERVE_IMAGE", "localhost/pagedserve:latest")
COMPONENTS = ("blockmgr", "gpuworker", "scheduler", "frontend")
BLOCK = 8

pytestmark = [pytest.mark.container, pytest.mark.slow]


# ---------------------------------------------------------------- podman helpers
def _skip_reason() -> str | None:
    if os.environ.get(OPT_IN) != "1":
        return (f"container tests are opt-in: {OPT_IN}=1 (builds the image with podman and starts the "
                "compose services and the Kubernetes manifests; about 5 min)")
    if shutil.which("podman") is None:
        return "podman is not installed (scripts/build-image.sh installs it with apt-get)"
    if os.geteuid() != 0:
        return "the container tests run podman as root (rootless podman is not set up here)"
    return None


@pytest.fixture(scope="session")
def podman_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    # Debian's podman as root on this kind of host: crun fails on setrlimit and hybrid
    # cgroups, runc works; the default nofile/nproc limits are refused, 4096 is not.
    lines = ["[containers]", 'default_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]']
    if shutil.which("runc"):
        lines += ["[engine]", 'runtime = "runc"']
    conf.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    info = subprocess.run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"], capture_output=True,
                          text=True, env=env, timeout=60)
    if info.returncode != 0:
        pytest.skip(f"podman is not usable here: {info.stderr.strip()[-300:]}")
    return env


def podman(env: dict[str, str], *args: str, check: bool = True, timeout: float = 120) -> str:
    r = subprocess.run(["podman", *args], capture_output=True, text=True, env=env, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def compose_binary() -> str:
    exe = Path(sys.executable).with_name("podman-compose")
    found = str(exe) if exe.exists() else shutil.which("podman-compose")
    if found is None:
        pytest.skip("podman-compose is not installed (pip install podman-compose)")
    return found


def grpc_health(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        try:
            return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3).status)
        except grpc.RpcError:
            return -1


def wait_serving(addr: str, timeout_s: float, logs: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while grpc_health(addr) != health_pb2.HealthCheckResponse.SERVING:
        if time.monotonic() > deadline:
            raise AssertionError(f"{addr} not SERVING after {timeout_s:.0f} s\n{logs() if logs else ''}")
        time.sleep(1.0)


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - our own server
        raw = r.read()
        return r.status, (json.loads(raw) if r.headers.get_content_type() == "application/json" else raw.decode())


# ---------------------------------------------------------------- the image
@dataclass
class Built:
    image: str
    build_s: float
    size_bytes: int


@pytest.fixture(scope="session")
def image(podman_env: dict[str, str]) -> Built:
    """scripts/build-image.sh (cached layers are reused; a source change rebuilds the last ones)."""
    if os.environ.get("PAGEDSERVE_CONTAINER_NO_BUILD") == "1" and \
            subprocess.run(["podman", "image", "exists", IMAGE], env=podman_env).returncode == 0:
        size = int(podman(podman_env, "image", "inspect", "--format", "{{.Size}}", IMAGE).strip())
        print(f"\nimage {IMAGE}: not rebuilt (PAGEDSERVE_CONTAINER_NO_BUILD=1)")
        return Built(IMAGE, 0.0, size)
    t0 = time.monotonic()
    r = subprocess.run(["nice", "-n", "10", str(ROOT / "scripts" / "build-image.sh")], capture_output=True,
                       text=True, env={**podman_env, "PAGEDSERVE_IMAGE": IMAGE}, timeout=3600, cwd=ROOT)
    assert r.returncode == 0, f"image build failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    built = Built(IMAGE, time.monotonic() - t0,
                  int(podman(podman_env, "image", "inspect", "--format", "{{.Size}}", IMAGE).strip()))
    print(f"\nimage {IMAGE}: built in {built.build_s:.0f} s, {built.size_bytes / 1e9:.2f} GB")
    return built


def test_image_is_production_shaped(podman_env: dict[str, str], image: Built) -> None:
    cfg = json.loads(podman(podman_env, "image", "inspect", image.image))[0]["Config"]
    assert cfg["User"] in ("10001:10001", "10001"), cfg["User"]
    assert cfg["Entrypoint"] == ["pagedserve"]
    assert {"50051/tcp", "8000/tcp", "9090/tcp", "9091/tcp", "9092/tcp", "9093/tcp"} <= set(cfg["ExposedPorts"])
    hc = json.loads(podman(podman_env, "image", "inspect", "--format", "{{json .HealthCheck}}", image.image))
    assert hc and hc["Test"] == ["CMD", "pagedserve", "healthcheck"], hc
    out = podman(podman_env, "run", "--rm", "--entrypoint", "/bin/sh", image.image, "-c",
                 "id -u; g++ --version | head -1; pagedserve --version; ls -A /keys | wc -l; "
                 "ls -d /src /app /opt/pagedserve/.git 2>/dev/null | wc -l; "
                 "python -c 'import pagedserve.v1; from pagedserve.common.default_model import gguf_path; gguf_path()' "
                 "2>&1 | grep -c Error || true")
    uid, gxx, version, keys, src, import_errors = out.strip().splitlines()
    assert uid == "10001" and gxx.startswith("g++") and version.startswith("pagedserve ")
    assert keys == "0", "no keys are baked into the image"
    assert src == "0", "the runtime image holds the installed package only, no source tree or .git"
    assert import_errors == "0"


def test_image_default_command_serves_and_stops_cleanly(podman_env: dict[str, str], image: Built) -> None:
    """`podman run IMAGE`: the default command (`serve --host 0.0.0.0`, all four components
    over ipc:// in one container) serves the embedded SmolLM2, the image's own health check
    (role `serve`: gRPC health) passes, and SIGTERM stops it with exit status 0."""
    name, port = f"pstest-serve-{os.getpid()}", free_port()
    podman(podman_env, "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", image.image)
    try:
        deadline = time.monotonic() + 300
        while subprocess.run(["podman", "healthcheck", "run", name], capture_output=True, env=podman_env,
                             timeout=60).returncode != 0:
            assert time.monotonic() < deadline, podman(podman_env, "logs", "--tail", "40", name, check=False)
            time.sleep(2)
        status, body = http_json(f"http://127.0.0.1:{port}/v1/completions",
                                 {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0})
        assert status == 200 and "Paris" in body["choices"][0]["text"], body
        podman(podman_env, "stop", "-t", "60", name, timeout=120)
        state = json.loads(podman(podman_env, "inspect", name))[0]["State"]
        assert state["ExitCode"] == 0, podman(podman_env, "logs", "--tail", "40", name, check=False)
    finally:
        podman(podman_env, "rm", "-f", name, check=False)
    assert name not in podman(podman_env, "ps", "-a", "--format", "{{.Names}}").split()


# ---------------------------------------------------------------- Kubernetes manifests
def test_kube_play_manifests_answer(podman_env: dict[str, str], image: Built,
                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """`podman kube play` of deploy/k8s/pagedserve.yaml (ConfigMap, Deployment of one pod with
    the four containers, Service) with the Secret from make-curve-secret.sh; the embedded
    SmolLM2 (converted inside the pod) answers greedy tokens equal to transformers."""
    from test_e2e import hf_greedy, tokenize

    from pagedserve.client import GenerationClient
    from pagedserve.common.default_model import resolve_model

    manifest = ROOT / "deploy" / "k8s" / "pagedserve.yaml"
    secret = tmp_path_factory.mktemp("kube") / "curve-keys.yaml"
    r = subprocess.run([str(ROOT / "deploy" / "k8s" / "make-curve-secret.sh")], capture_output=True, text=True,
                       env={**podman_env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}, timeout=120)
    assert r.returncode == 0, r.stderr
    secret.write_text(r.stdout)
    folder = resolve_model(None)
    prompt = "The capital of France is"
    expected = hf_greedy(folder, tokenize(folder, prompt), 8)
    pod, keys = "pagedserve-pod-0", "pagedserve-curve-keys"
    # podman 4.3 kube play publishes every containerPort on the host (HostPort = containerPort).
    busy = []
    for port in (50051, 8000, 9090, 9091, 9092, 9093):
        with socket.socket() as sk:
            if sk.connect_ex(("127.0.0.1", port)) == 0:
                busy.append(port)
    if busy:
        pytest.skip(f"host ports {busy} are in use: podman kube play publishes the pod's containerPorts there")
    before = {k: set(podman(podman_env, k, "ls", "--format", "{{.Name}}").split()) for k in ("volume", "network")}
    try:
        podman(podman_env, "kube", "play", str(secret))
        # podman 4.3.1 mounts a Secret volume as the named volume of the Secret's name, empty for
        # stringData (and with the base64 text undecoded for data): fill that volume with the
        # Secret's keys first. Kubernetes mounts the Secret itself.
        data = yaml.safe_load(secret.read_text())["stringData"]
        podman(podman_env, "volume", "create", keys)
        for fname, text in data.items():
            r = subprocess.run(["podman", "run", "--rm", "-i", "-v", f"{keys}:/keys", "--entrypoint", "/bin/sh",
                                image.image, "-c", f"umask 077; cat > /keys/{fname}"], input=text, text=True,
                               capture_output=True, env=podman_env, timeout=120)
            assert r.returncode == 0, r.stderr
        podman(podman_env, "kube", "play", str(manifest), timeout=300)
        infra = json.loads(podman(podman_env, "pod", "inspect", pod))
        infra = infra[0] if isinstance(infra, list) else infra
        nets = json.loads(podman(podman_env, "inspect", infra["InfraContainerID"]))[0]["NetworkSettings"]["Networks"]
        ip = next(iter(nets.values()))["IPAddress"]
        assert ip, f"the pod has no address on the podman network: {nets}"

        def logs() -> str:
            return "\n".join(f"--- {s}\n" + podman(podman_env, "logs", "--tail", "30", f"{pod}-{s}", check=False)
                             for s in COMPONENTS)

        t0 = time.monotonic()
        wait_serving(f"{ip}:50051", 900, logs)
        print(f"\nkube play: SERVING {time.monotonic() - t0:.1f} s after play (model converted in the pod)")
        with GenerationClient(f"{ip}:50051") as c:
            ids, text, _ = c.generate(prompt, max_tokens=8, temperature=0.0, timeout=120)
        assert ids == expected, text
        status, body = http_json(f"http://{ip}:8000/v1/completions", {"prompt": prompt, "max_tokens": 8,
                                                                      "temperature": 0})
        assert status == 200 and body["choices"][0]["text"] == text
        _, metrics = http_json(f"http://{ip}:8000/metrics")
        assert "vllm:num_requests_waiting{" in metrics
        for s in COMPONENTS:
            hc = subprocess.run(["podman", "healthcheck", "run", f"{pod}-{s}"], capture_output=True, text=True,
                                env=podman_env, timeout=60)
            assert hc.returncode == 0, f"{s} liveness probe: {hc.stdout}{hc.stderr}"
    finally:
        podman(podman_env, "kube", "down", str(manifest), check=False, timeout=180)
        podman(podman_env, "kube", "down", str(secret), check=False)
        podman(podman_env, "secret", "rm", keys, check=False)
        podman(podman_env, "volume", "rm", keys, check=False)
        for net in set(podman(podman_env, "network", "ls", "--format", "{{.Name}}").split()) - before["network"]:
            podman(podman_env, "network", "rm", net, check=False)  # the kube network, if play made it
    left = {
        "pods": [p for p in podman(podman_env, "pod", "ls", "--format", "{{.Name}}").split() if p.startswith("pagedserve")],
        "containers": [n for n in podman(podman_env, "ps", "-a", "--format", "{{.Names}}").split()
                       if n.startswith("pagedserve-pod")],
        "volumes": sorted(set(podman(podman_env, "volume", "ls", "--format", "{{.Name}}").split()) - before["volume"]),
        "secrets": [s for s in podman(podman_env, "secret", "ls", "--format", "{{.Name}}").split()
                    if s.startswith("pagedserve")],
    }
    assert left == {"pods": [], "containers": [], "volumes": [], "secrets": []}, left


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
        # Two steps, as docs/deployment.md says for podman < 4.6: the keys first, then the four
        # components without podman's --requires links (with them, podman refuses to restart a
        # component whose dependency, the one-shot keygen, has exited: the restart policy fails).
        r = p.compose("up", "-d", "keygen")
        assert r.returncode == 0, r.stderr[-3000:]
        podman(env, "wait", p.container("keygen"), timeout=120)
        r = p.compose("up", "-d", "--no-deps", *COMPONENTS)
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

    old = os.environ.get(cpu_build.DISABLE_ENV)
    os.environ[cpu_build.DISABLE_ENV] = "0"
    cpu_build.load.cache_clear()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(cpu_build.DISABLE_ENV, None)
        else:
            os.environ[cpu_build.DISABLE_ENV] = old
        cpu_build.load.cache_clear()


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
