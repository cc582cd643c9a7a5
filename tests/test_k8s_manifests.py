"""Issue 22, acceptance 3: the Kubernetes manifests (deploy/k8s/) are valid for
Kubernetes 1.30 and the current release (kubernetes-validate --strict), pass
Pod Security "restricted", and ask for at least the memory each component
was measured to use (docs/results/pod-resources.json, from
`pagedserve bench pod-resources`), the worker's derived from its KV pool."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagedserve.common.config import parse_size
from pagedserve.common.kv_events_config import parse_kv_events_config

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
MEASURED = json.loads((ROOT / "docs" / "results" / "pod-resources.json").read_text())
VERSIONS = ("1.30.0", "1.37.0")  # the oldest supported here, and the current release
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}


def _quantity(q: str | int) -> float:
    """A Kubernetes resource quantity ("3Gi", "500m", 2) as a number (bytes or cores)."""
    s = str(q)
    if s.endswith("m"):
        return int(s[:-1]) / 1000
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i|[kMG])?", s)
    assert m, f"not a quantity: {q!r}"
    return float(m.group(1)) * _UNITS.get(m.group(2) or "", 1)


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _pod(name: str) -> tuple[dict[str, str], dict[str, Any]]:
    docs = _docs(name)
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    return cm["data"], dep["spec"]["template"]["spec"]


def _validator() -> str:
    exe = Path(sys.executable).with_name("kubernetes-validate")
    found = str(exe) if exe.exists() else shutil.which("kubernetes-validate")
    if found is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate: the test extra has it)")
    return found


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_strict(version: str) -> None:
    out = subprocess.run([_validator(), "--strict", "--no-warn", "-k", version, *map(str, MANIFESTS)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    kinds = {d["kind"] for m in MANIFESTS for d in yaml.safe_load_all(m.read_text()) if d}
    passed = out.stdout + out.stderr
    for kind in ("configmap", "deployment", "service", "networkpolicy"):
        assert f"for resource {kind}/" in passed, f"{kind} was not validated"
    assert {"InferencePool", "HTTPRoute"} <= kinds  # CRDs: no schema in kubernetes-validate


@pytest.mark.parametrize("name", ["pagedserve.yaml", "pagedserve-gpu.yaml"])
def test_pod_security_restricted(name: str) -> None:
    _, pod = _pod(name)
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert not any("hostPath" in v for v in volumes.values())
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True, c["name"]
        writable = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"] if not m.get("readOnly")}
        # what the processes write: ipc run dirs and compiler scratch, ~/.cache, the model and kernel cache
        assert {"/tmp", "/home/pagedserve", "/cache"} <= set(writable), c["name"]
        assert all("emptyDir" in v for v in writable.values()), c["name"]


@pytest.mark.parametrize("name", ["pagedserve.yaml", "pagedserve-gpu.yaml"])
def test_resources_cover_the_measured_use(name: str) -> None:
    config, pod = _pod(name)
    peaks = MEASURED["derived"]["peak_rss_bytes"]
    for c in pod["containers"]:
        req, lim = c["resources"]["requests"], c["resources"]["limits"]
        for key in ("cpu", "memory"):
            assert key in req and key in lim, (c["name"], key)
            assert _quantity(lim[key]) >= _quantity(req[key]), (c["name"], key)
        if c["name"] == "gpuworker":
            if "PAGEDSERVE_KV_CACHE_MEMORY" in config:  # CPU: the pool lives in the worker's memory
                need = MEASURED["derived"]["gpuworker_bytes_besides_kv_pool"] + parse_size(
                    config["PAGEDSERVE_KV_CACHE_MEMORY"])
            else:  # CUDA: the pool is on the GPU; the host still holds what the CPU run needed
                need = MEASURED["derived"]["gpuworker_bytes_besides_kv_pool"]
                assert req["nvidia.com/gpu"] == lim["nvidia.com/gpu"] == 1
        else:
            need = peaks[c["name"]]
        assert _quantity(req["memory"]) >= need, f"{c['name']}: request {req['memory']} < measured {need / 2**20:.0f} MiB"


def test_the_measurement_is_of_this_engine() -> None:
    runs = MEASURED["runs"]
    assert len(runs) >= 2 and len({r["kv_cache_memory_bytes"] for r in runs}) == len(runs)
    small, large = sorted(runs, key=lambda r: r["kv_cache_memory_bytes"])[:2]
    grew = large["components"]["gpuworker"]["peak_rss_bytes"] - small["components"]["gpuworker"]["peak_rss_bytes"]
    pool = large["kv_cache_memory_bytes"] - small["kv_cache_memory_bytes"]
    assert 0.8 * pool <= grew <= 1.2 * pool, "the worker's memory grows with its KV pool, byte for byte"


def test_images_are_pinned_to_this_version() -> None:
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)  # type: ignore[union-attr]
    for name, tag in (("pagedserve.yaml", version), ("pagedserve-gpu.yaml", f"{version}-cuda")):
        _, pod = _pod(name)
        assert {c["image"] for c in pod["containers"]} == {f"localhost/pagedserve:{tag}"}, name


def test_gpu_variant_is_generated_from_the_cpu_one() -> None:
    sys.path.insert(0, str(K8S))
    try:
        import gpu_variant
    finally:
        sys.path.remove(str(K8S))
    assert (K8S / "pagedserve-gpu.yaml").read_text() == gpu_variant.render(), "run python deploy/k8s/gpu_variant.py"
    config, pod = _pod("pagedserve-gpu.yaml")
    assert config["PAGEDSERVE_DEVICE"] == "cuda"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_kv_events_reach_the_router_and_only_it() -> None:
    config, pod = _pod("pagedserve.yaml")
    (bm,) = [c for c in pod["containers"] if c["name"] == "blockmgr"]
    env = {e["name"]: e for e in bm["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    cfg = parse_kv_events_config(env["PAGEDSERVE_KV_EVENTS_CONFIG"]["value"].replace("$(POD_IP)", "10.0.0.7"))
    assert cfg.enabled and cfg.topic == "kv@10.0.0.7@SmolLM2-135M-Instruct"  # llm-d's topic shape
    ports = {int(e.rsplit(":", 1)[1]) for e in (cfg.endpoint, cfg.replay_endpoint or "")}
    internal = {int(v.rsplit(":", 1)[1]) for k, v in config.items() if v.startswith("tcp://")}
    assert ports == {5560, 5561} and not ports & internal, "the event ports are not the components' own"
    assert {p["containerPort"] for p in bm["ports"]} >= ports
    policy = [d for d in _docs("inference-pool.yaml") if d["kind"] == "NetworkPolicy"]
    (rule,) = [r for r in policy[0]["spec"]["ingress"] if "from" in r]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"app": "pagedserve-epp"}}}]
    assert {p["port"] for p in rule["ports"]} == ports
    open_ports = {p["port"] for r in policy[0]["spec"]["ingress"] if "from" not in r for p in r["ports"]}
    assert not open_ports & ports
    epp = yaml.safe_load([d for d in _docs("inference-pool.yaml") if d["kind"] == "ConfigMap"][0]["data"][
        "precise-prefix-cache-config.yaml"])
    (scorer,) = [p for p in epp["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    assert scorer["parameters"]["kvEventsConfig"]["podDiscoveryConfig"]["socketPort"] == 5560
    assert scorer["parameters"]["tokenProcessorConfig"]["blockSize"] == int(config["PAGEDSERVE_BLOCK_SIZE"])
    assert scorer["parameters"]["tokenProcessorConfig"]["hashSeed"] == env["PYTHONHASHSEED"]["value"]


def test_podman_render_makes_one_pod_per_replica_with_the_same_spec() -> None:
    """deploy/k8s/podman_kube.py: podman plays one pod per Deployment, so `replicas: N` becomes N
    single-pod Deployments with the manifest's pod spec; only what podman 4.3 cannot take differs
    (host-published ports after the first replica, the status.podIP reference)."""
    sys.path.insert(0, str(K8S))
    try:
        import podman_kube
    finally:
        sys.path.remove(str(K8S))
    docs = _docs("pagedserve.yaml")
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    out = podman_kube.render(docs, 3)
    assert [d["kind"] for d in out] == ["ConfigMap", "Deployment", "Deployment", "Deployment"]  # no Service
    assert podman_kube.pod_names(out) == ["pagedserve-0-pod-0", "pagedserve-1-pod-0", "pagedserve-2-pod-0"]
    assert podman_kube.render(docs, None)[1:] == podman_kube.render(docs, deploy["spec"]["replicas"])[1:]
    original = deploy["spec"]["template"]["spec"]
    for i, d in enumerate(out[1:]):
        assert d["spec"]["replicas"] == 1
        assert d["spec"]["template"]["metadata"]["labels"]["pagedserve/replica"] == str(i)
        spec = d["spec"]["template"]["spec"]
        assert {k: v for k, v in spec.items() if k != "containers"} == \
            {k: v for k, v in original.items() if k != "containers"}
        for c, o in zip(spec["containers"], original["containers"], strict=True):
            assert ("ports" in c) == (i == 0 and "ports" in o), (i, c["name"])
            strip = {"ports", "env"}
            assert {k: v for k, v in c.items() if k not in strip} == {k: v for k, v in o.items() if k not in strip}
            env = {e["name"]: e for e in c.get("env", [])}
            for e in o.get("env", []):
                if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
                    assert env[e["name"]] == {"name": e["name"], "value": f"pagedserve-{i}-pod-0"}
                else:
                    assert env[e["name"]] == e
