#!/usr/bin/env bash
# Worker checks for a lent GPU (issue 6), one prepared call of ~4 minutes on
# an H200. Run from the repository root with the ignored wheel folder carried
# along (run tool: carry [".whl"]); logs go to $OUT (default ./out), 7 files:
#
#   env.log              machine, versions, imports
#   pytest.log           tests/test_worker_gpu.py: CUDA forward + pinned swap vs
#   junit.xml              transformers, decode CUDA graphs vs eager and
#                          transformers, graphs optional, pool sizing (acceptance 4:
#                          "POOL-SIZING" lines, blocks vs the profiled budget)
#   bench_smollm2.log    bench worker, SmolLM2-135M's shape with RANDOM weights
#   bench_smollm2.json     (its GGUF is too big to carry), bf16
#   bench_llama8b.log    bench worker, Llama-3.1-8B's shape with RANDOM weights, bf16
#   bench_llama8b.json
#
# Nothing of the repository is installed: the carried wheels (.whl/) and the
# import shim come from scripts/gpu_env.sh.
set -uo pipefail

PY="${PYTHON:-python3}"
source scripts/gpu_env.sh  # wheels, the import shim (a sitecustomize), $OUT
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$SHIM/triton-cache}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

{
  echo "== machine"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  nproc
  "$PY" -c "import sys, torch, triton, transformers, msgspec, zmq; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'msgspec', msgspec.__version__, 'pyzmq', zmq.__version__, 'gpu', torch.cuda.is_available())"
  "$PY" -c "pagedserve.gpuworker.model_runner as m, pagedserve.bench.worker as b; print('import ok:', m.__file__, b.__file__)"
} 2>&1 | tee "$OUT/env.log"

echo "== pytest tests/test_worker_gpu.py" | tee "$OUT/pytest.log"
timeout 170 "$PY" -c "sys, pytest; sys.exit(pytest.main(sys.argv[1:]))" \
  -q -s -rs -p no:cacheprovider --durations=10 --junitxml="$OUT/junit.xml" \
  tests/test_worker_gpu.py 2>&1 | tee -a "$OUT/pytest.log"
test_rc=${PIPESTATUS[0]}
echo "pytest exit: $test_rc" | tee -a "$OUT/pytest.log"

bench() {  # name timeout args...
  local name=$1 limit=$2
  shift 2
  echo "== pagedserve bench worker $*" | tee "$OUT/bench_$name.log"
  timeout "$limit" "$PY" -c "sys; from pagedserve.cli import main; sys.exit(main(['bench', 'worker'] + sys.argv[1:]))" \
    "$@" 2>&1 | tee -a "$OUT/bench_$name.log"
  local rc=${PIPESTATUS[0]}
  echo "bench exit: $rc" | tee -a "$OUT/bench_$name.log"
  grep '^{"bench": "worker"' "$OUT/bench_$name.log" | tail -1 > "$OUT/bench_$name.json" || true
  return "$rc"
}
bench smollm2 100 --random-weights smollm2-135m --dtype bfloat16 --steps 30
small_rc=$?
bench llama8b 170 --random-weights llama-8b --dtype bfloat16 --steps 20
big_rc=$?

rm -rf "$SHIM"
echo "== done: pytest $test_rc, bench smollm2 $small_rc, bench llama8b $big_rc (logs in $OUT)"
[ "$test_rc" -eq 0 ] && [ "$small_rc" -eq 0 ] && [ "$big_rc" -eq 0 ]
