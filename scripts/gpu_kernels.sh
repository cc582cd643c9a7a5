#!/usr/bin/env bash
# Kernel checks for a lent GPU (issue 4): the kernel tests, GPU-marked ones
# included, then `pagedserve bench kernel`. Run from the repository root;
# logs go to $OUT (default ./out). Nothing is installed: scripts/gpu_env.sh
# makes the checkout importable as `pagedserve`. Budget: ~4 minutes.
set -uo pipefail

PY="${PYTHON:-python}"
source scripts/gpu_env.sh  # wheels, the import shim (a sitecustomize), $OUT
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$SHIM/triton-cache}"

{
  echo "== machine"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.is_available())"
  "$PY" -c "pagedserve.kernels as k, pagedserve.bench.kernel as b; print('import ok:', k.__file__, b.__file__)"
} 2>&1 | tee "$OUT/env.log"

echo "== pytest tests/test_kernels.py tests/test_kernels_bench.py" | tee "$OUT/pytest.log"
timeout 170 "$PY" -c "sys, pytest; sys.exit(pytest.main(sys.argv[1:]))" \
  -q -rs -p no:cacheprovider --durations=15 --junitxml="$OUT/junit.xml" \
  tests/test_kernels.py tests/test_kernels_bench.py 2>&1 | tee -a "$OUT/pytest.log"
test_rc=${PIPESTATUS[0]}
echo "pytest exit: $test_rc" | tee -a "$OUT/pytest.log"

echo "== pagedserve bench kernel" | tee "$OUT/bench.log"
timeout 120 "$PY" -c "sys; from pagedserve.cli import main; sys.exit(main(['bench', 'kernel'] + sys.argv[1:]))" \
  2>&1 | tee -a "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "bench exit: $bench_rc" | tee -a "$OUT/bench.log"
grep '^{"bench": "kernel"' "$OUT/bench.log" | tail -1 > "$OUT/bench_kernel.json" || true

rm -rf "$SHIM"
echo "== done: pytest $test_rc, bench $bench_rc (logs in $OUT)"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
