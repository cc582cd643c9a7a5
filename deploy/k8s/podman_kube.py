"""Runs deploy/k8s/pagedserve.yaml with ``podman kube play``, replicas included,
and takes down everything it made.

Podman (4.3 here) plays one pod per Deployment whatever its ``replicas``, and
publishes every ``containerPort`` on the host, so two pods of one Deployment
would clash. This renders the Deployment into ``replicas`` single-pod
Deployments ``pagedserve-0 .. N-1`` with the same pod spec; only the first
keeps its ports published on the host (the others are reached at their pod
address on podman's network). The Service is left out (podman has no Services).
Podman 4.3 has no ``status.podIP`` field reference, so an env var taken from it
(``POD_IP``, in the KV-event topic) is set to the pod's name instead.

``podman kube down`` alone leaves the Secret's volume, the Secret and the
network ``podman-default-kube-network``; ``down`` removes them too, so a
play and a down leave no object (tests/test_container.py lists them before
and after).

    python deploy/k8s/podman_kube.py up [--replicas 2] [--manifest FILE]
    python deploy/k8s/podman_kube.py addresses             # each pod's address: NAME IP
    python deploy/k8s/podman_kube.py down
    python deploy/k8s/podman_kube.py render --replicas 2   # the YAML it plays
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "pagedserve.yaml"
SECRET = "pagedserve-curve-keys"
NETWORK = "podman-default-kube-network"
STATE = Path(os.environ.get("PAGEDSERVE_KUBE_STATE", "/var/tmp/pagedserve-kube"))  # what `up` played


def render(docs: list[dict[str, Any]], replicas: int | None,
           config: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The manifest's ConfigMaps (with ``config``'s keys set in each), each Deployment as
    ``replicas`` (default its own) single-pod Deployments; Services dropped."""
    out: list[dict[str, Any]] = []
    for doc in docs:
        if doc["kind"] == "Service":
            continue
        if doc["kind"] != "Deployment":
            if doc["kind"] == "ConfigMap" and config:
                doc = copy.deepcopy(doc)
                doc.setdefault("data", {}).update(config)
            out.append(doc)
            continue
        n = doc["spec"].get("replicas", 1) if replicas is None else replicas
        for i in range(n):
            d = copy.deepcopy(doc)
            d["metadata"]["name"] = f"{doc['metadata']['name']}-{i}"
            d["spec"]["replicas"] = 1
            d["spec"]["template"]["metadata"]["labels"]["pagedserve/replica"] = str(i)
            for c in d["spec"]["template"]["spec"]["containers"]:
                if i > 0:
                    c.pop("ports", None)
                for e in c.get("env", []):
                    if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
                        e.pop("valueFrom")
                        e["value"] = f"{d['metadata']['name']}-pod-0"
            out.append(d)
    return out


def pod_names(docs: list[dict[str, Any]]) -> list[str]:
    return [f"{d['metadata']['name']}-pod-0" for d in docs if d["kind"] == "Deployment"]


def pod_addresses(pods: list[str]) -> dict[str, str]:
    """Each pod's address on podman's kube network (its infra container's)."""
    out: dict[str, str] = {}
    for pod in pods:
        info = json.loads(_podman("pod", "inspect", pod))
        info = info[0] if isinstance(info, list) else info
        nets = json.loads(_podman("inspect", info["InfraContainerID"]))[0]["NetworkSettings"]["Networks"]
        out[pod] = next(iter(nets.values()))["IPAddress"]
    return out


def _podman(*args: str, check: bool = True, input: str | None = None, timeout: float = 300) -> str:
    # Run in STATE: podman 4.3's conmon leaves an empty `oom` file in its working directory.
    r = subprocess.run(["podman", *args], capture_output=True, text=True, input=input, timeout=timeout, cwd=STATE)
    if check and r.returncode != 0:
        raise SystemExit(f"podman {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def _secret_yaml() -> str:
    r = subprocess.run([str(HERE / "make-curve-secret.sh"), SECRET], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"make-curve-secret.sh: {r.stderr.strip()}")
    return r.stdout


def up(manifest: Path, replicas: int | None, image: str, config: dict[str, str] | None = None) -> list[str]:
    docs = render(list(yaml.safe_load_all(manifest.read_text())), replicas, config)
    played = STATE / "played.yaml"
    played.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    secret_yaml = _secret_yaml()
    secret = STATE / "secret.yaml"  # kube play reads a file; the keys then live in podman's store only
    secret.write_text(secret_yaml)
    try:
        _podman("kube", "play", str(secret))
    finally:
        secret.unlink()
    # Podman 4.3 mounts a Secret volume as the named volume of the Secret's name, empty for
    # stringData: fill it with the Secret's files (Kubernetes mounts the Secret itself).
    _podman("volume", "create", SECRET)
    for fname, text in yaml.safe_load(secret_yaml)["stringData"].items():
        _podman("run", "--rm", "-i", "-v", f"{SECRET}:/keys", "--entrypoint", "/bin/sh", image,
                "-c", f"umask 077; cat > /keys/{fname}", input=text)
    try:
        _podman("kube", "play", str(played), timeout=600)
    except SystemExit:
        down()  # a pod podman made before it failed would block the next play
        raise
    return pod_names(docs)


def down() -> None:
    """Everything ``up`` made: the pods (with their containers and emptyDir volumes), the
    Secret, its volume and podman's kube network, once nothing else uses it."""
    played = STATE / "played.yaml"
    if played.exists():
        _podman("kube", "down", str(played), check=False, timeout=300)
        # `kube down` passes over a pod whose play failed half-way (state Created).
        for pod in pod_names(list(yaml.safe_load_all(played.read_text()))):
            _podman("pod", "rm", "-f", "--ignore", pod, check=False, timeout=300)
        played.unlink()
    _podman("secret", "rm", SECRET, check=False)
    _podman("volume", "rm", SECRET, check=False)
    if not _podman("ps", "-a", "--filter", f"network={NETWORK}", "--format", "{{.ID}}", check=False).strip():
        _podman("network", "rm", NETWORK, check=False)
    (STATE / "oom").unlink(missing_ok=True)  # conmon's (see _podman)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["up", "down", "render", "addresses"])
    ap.add_argument("--replicas", type=int, default=None, help="default: the Deployment's own")
    ap.add_argument("--manifest", type=Path, default=MANIFEST)
    ap.add_argument("--image", default=os.environ.get("PAGEDSERVE_IMAGE", "localhost/pagedserve:0.1.0"),
                    help="the image that writes the keys into the Secret's volume")
    ap.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                    help="set a PAGEDSERVE_* key in the ConfigMap (e.g. PAGEDSERVE_NUM_GPU_BLOCKS=1024)")
    args = ap.parse_args(argv)
    config = dict(kv.split("=", 1) for kv in args.config if "=" in kv)
    if len(config) != len(args.config) or any(not k.startswith("PAGEDSERVE_") for k in config):
        ap.error("--config: KEY=VALUE with a PAGEDSERVE_* key")
    if args.replicas is not None and not 1 <= args.replicas <= 16:
        ap.error("--replicas: 1 to 16")
    STATE.mkdir(mode=0o700, parents=True, exist_ok=True)
    if args.action == "render":
        docs = render(list(yaml.safe_load_all(args.manifest.read_text())), args.replicas, config)
        sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=False))
    elif args.action == "up":
        print("\n".join(up(args.manifest, args.replicas, args.image, config)))
    elif args.action == "addresses":  # of the pods `up` played: NAME ADDRESS per line
        played = STATE / "played.yaml"
        pods = pod_names(list(yaml.safe_load_all(played.read_text()))) if played.exists() else []
        print("\n".join(f"{p} {ip}" for p, ip in pod_addresses(pods).items()))
    else:
        down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
