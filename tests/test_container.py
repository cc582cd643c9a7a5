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
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_util import free_port
from container_util import COMPONENTS, ROOT, Built, http_json, podman, wait_serving

pytestmark = [pytest.mark.container, pytest.mark.slow]


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


# The CPU image was 2.83 GB with Triton (1.0 GB), torch's headers and a base with Python's headers
# (docs/deployment.md, before/after); what it must stay below without them.
MAX_CPU_IMAGE_BYTES = 1_900_000_000


def test_cpu_image_is_small_and_leaves_no_build_stage(podman_env: dict[str, str], image: Built) -> None:
    """Issue 22: no Triton (it has no CPU backend), no build tools or headers in the final stage
    (g++ stays: the CPU kernels are compiled for the host's CPU at first start), and the build
    leaves none of its untagged stages behind."""
    size = int(podman(podman_env, "image", "inspect", "--format", "{{.Size}}", image.image).strip())
    print(f"\nimage {image.image}: {size / 1e9:.2f} GB")
    assert size <= MAX_CPU_IMAGE_BYTES, f"{size / 1e9:.2f} GB"
    out = podman(podman_env, "run", "--rm", "--entrypoint", "/bin/sh", image.image, "-c",
                 "python -c 'import importlib.util as u; print(*(u.find_spec(m) is None for m in "
                 "(\"triton\", \"setuptools\", \"grpc_tools\")))'; "
                 "ls /usr/include/python3*/Python.h 2>/dev/null | wc -l; "
                 "ls -d /opt/pagedserve/lib/python3*/site-packages/torch/include 2>/dev/null | wc -l; "
                 "command -v g++ >/dev/null && echo g++")
    absent, python_h, torch_include, gxx = out.strip().splitlines()
    assert absent == "True True True", "triton, setuptools and grpc_tools are not in the CPU image"
    assert python_h == "0" and torch_include == "0", "no C headers for Python or torch"
    assert gxx == "g++"
    if image.build_s:  # built by this session: build-image.sh removed its own untagged stages
        left = podman(podman_env, "images", "-q", "--filter", "dangling=true",
                      "--filter", "label=org.pagedserve.built-by=build-image.sh").split()
        assert left == [], f"untagged build stages left: {left}"


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
def test_kube_play_manifests_answer(podman_env: dict[str, str], image: Built) -> None:
    """`deploy/k8s/podman_kube.py up --replicas 2`: `podman kube play` of the Secret from
    make-curve-secret.sh and deploy/k8s/pagedserve.yaml's pod spec as two pods (podman plays one pod
    per Deployment). Both serve the embedded SmolLM2 (converted inside each pod) with greedy tokens
    equal to transformers; `down` then leaves no pod, container, volume, secret or network that was
    not there before."""
    from test_e2e import hf_greedy, tokenize

    from pagedserve.client import GenerationClient
    from pagedserve.common.default_model import resolve_model

    folder = resolve_model(None)
    prompt = "The capital of France is"
    expected = hf_greedy(folder, tokenize(folder, prompt), 8)
    # Replica 0 publishes its containerPorts on the host (podman 4.3 publishes every one).
    busy = []
    for port in (50051, 8000, 9090, 9091, 9092, 9093, 5560, 5561):
        with socket.socket() as sk:
            if sk.connect_ex(("127.0.0.1", port)) == 0:
                busy.append(port)
    if busy:
        pytest.skip(f"host ports {busy} are in use: podman kube play publishes the first pod's containerPorts there")
    kinds = {"pods": ("pod", "ls"), "containers": ("ps", "-a"), "volumes": ("volume", "ls"),
             "secrets": ("secret", "ls"), "networks": ("network", "ls")}

    def objects() -> dict[str, list[str]]:
        return {k: sorted(podman(podman_env, *cmd, "--format", "{{.Name}}" if k != "containers" else "{{.Names}}")
                          .split()) for k, cmd in kinds.items()}

    script = [sys.executable, str(ROOT / "deploy" / "k8s" / "podman_kube.py")]
    env = {**podman_env, "PAGEDSERVE_IMAGE": image.image,
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    before = objects()
    try:
        r = subprocess.run([*script, "up", "--replicas", "2", "--image", image.image], capture_output=True,
                           text=True, env=env, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        pods = r.stdout.split()
        assert pods == ["pagedserve-0-pod-0", "pagedserve-1-pod-0"], r.stdout
        during = objects()
        assert set(pods) <= set(during["pods"]) and "pagedserve-curve-keys" in during["secrets"]
        t0 = time.monotonic()
        for pod in pods:
            infra = json.loads(podman(podman_env, "pod", "inspect", pod))
            infra = infra[0] if isinstance(infra, list) else infra
            nets = json.loads(podman(podman_env, "inspect", infra["InfraContainerID"]))[0]["NetworkSettings"]["Networks"]
            ip = next(iter(nets.values()))["IPAddress"]
            assert ip, f"{pod} has no address on the podman network: {nets}"

            def logs(pod: str = pod) -> str:
                return "\n".join(f"--- {s}\n" + podman(podman_env, "logs", "--tail", "30", f"{pod}-{s}", check=False)
                                 for s in COMPONENTS)

            wait_serving(f"{ip}:50051", 900, logs)
            print(f"\nkube play: {pod} SERVING {time.monotonic() - t0:.1f} s after play (model converted in the pod)")
            with GenerationClient(f"{ip}:50051") as c:
                ids, text, _ = c.generate(prompt, max_tokens=8, temperature=0.0, timeout=120)
            assert ids == expected, (pod, text)
            status, body = http_json(f"http://{ip}:8000/v1/completions", {"prompt": prompt, "max_tokens": 8,
                                                                          "temperature": 0})
            assert status == 200 and body["choices"][0]["text"] == text
            _, metrics = http_json(f"http://{ip}:8000/metrics")
            assert "vllm:num_requests_waiting{" in metrics
            for s in COMPONENTS:
                hc = subprocess.run(["podman", "healthcheck", "run", f"{pod}-{s}"], capture_output=True, text=True,
                                    env=podman_env, timeout=60)
                assert hc.returncode == 0, f"{pod} {s} liveness probe: {hc.stdout}{hc.stderr}"
        # The first replica's ports are published on the host, as `kube play` does for one pod.
        status, body = http_json("http://127.0.0.1:8000/v1/completions", {"prompt": prompt, "max_tokens": 8,
                                                                          "temperature": 0})
        assert status == 200 and body["choices"][0]["text"] == text
    finally:
        r = subprocess.run([*script, "down"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert objects() == before
