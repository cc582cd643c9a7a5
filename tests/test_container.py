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
import yaml
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
