# Sourced by the scripts/gpu_*.sh checks on a lent GPU machine (no network, no
# pip install of the project): installs the carried wheels (.whl/) into
# /tmp/site and makes the checkout importable as `pagedserve` in this process
# and in every child Python (a sitecustomize preloads the package with the
# same folder mapping as pyproject.toml's package-dir).
ROOT="$(pwd)"
export OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
SHIM="$(mktemp -d)"
cat > "$SHIM/sitecustomize.py" <<'PYEOF'
import importlib.util
import os
import sys

_root = os.environ.get("PAGEDSERVE_ROOT")
if _root and "pagedserve" not in sys.modules:
    _spec = importlib.util.spec_from_file_location(
        "pagedserve", os.path.join(_root, "pagedserve", "__init__.py"),
        submodule_search_locations=[os.path.join(_root, "pagedserve"), _root])
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["pagedserve"] = _mod
    _spec.loader.exec_module(_mod)
PYEOF
export PAGEDSERVE_ROOT="$ROOT"
export PYTHONPATH="$SHIM:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PAGEDSERVE_CACHE="${PAGEDSERVE_CACHE:-/tmp/pagedserve-cache}"
