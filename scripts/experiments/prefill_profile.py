"""Where a CPU prefill goes: one prompt of N tokens on an in-process worker
(the embedded SmolLM2), three prefills after a first, the time in the linears,
the attention and each fused op (decode_step_profile.py's hooks).

    .venv/bin/python scripts/experiments/prefill_profile.py 2048 bfloat16
"""
import importlib.util
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
spec = importlib.util.spec_from_file_location("dsp", HERE / "decode_step_profile.py")
dsp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dsp)

from linear_layouts import again  # noqa: E402

from pagedserve.bench import kv_fp8  # noqa: E402
from pagedserve.gpuworker import linear as tp_linear  # noqa: E402
from pagedserve.kernels import backend, cpu_ops  # noqa: E402


def main() -> None:
    for name in ("silu_and_mul", "add_rms_norm", "rope_and_cache"):
        setattr(cpu_ops, name, dsp.timed(name, getattr(cpu_ops, name)))
    tp_linear.linear = dsp.timed("linear", tp_linear.linear)
    backend.paged_attention_cpu = dsp.timed("attention", backend.paged_attention_cpu)
    n, dt = int(sys.argv[1]), sys.argv[2]
    runner, first = kv_fp8.batch_runner("auto", [list(range(100, 100 + n))], 1, dt, logprobs=None)
    runner.execute(first)
    dsp.RECORD["on"] = True
    ts = []
    for s in range(1, 4):
        t = time.perf_counter()
        runner.execute(again(first, s))
        ts.append(time.perf_counter() - t)
    print(f"{dt} prefill {n}: {statistics.median(ts) * 1e3:.0f} ms")
    for label, xs in sorted(dsp.CALLS.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {label:<15} {sum(xs) / len(ts) * 1e3:7.1f} ms/prefill {sum(xs) / sum(ts) * 100:5.1f} %")


if __name__ == "__main__":
    main()
