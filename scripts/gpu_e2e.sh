#!/usr/bin/env bash
# End-to-end checks on a lent GPU: the four real processes with --device cuda.
# Carry: .whl (msgspec, pyzmq, grpcio*, protobuf wheels) and pagedserve/v1 (generated stubs).
#  1. greedy over gRPC on CUDA (fp32, Triton attention) equals transformers' greedy on CUDA;
#  2. bench throughput: engine vs transformers generate on a SmolLM2-shaped random-weight model
#     (the real SmolLM2 GGUF is 98 MB, over the carry limit), bf16.
set -uo pipefail
source scripts/gpu_env.sh
{
python3 - <<'PYEOF'
import sys, time, torch
sys.path.insert(0, "tests")
from models import make_tiny_model
from pagedserve.client import GenerationClient
from pagedserve.bench.throughput import run_engine
import subprocess, signal
from pagedserve.launcher import wait_healthy
from pagedserve.bench.throughput import _free_port
from transformers import AutoModelForCausalLM, AutoTokenizer

d = make_tiny_model("/tmp/gpu-models", "llama", seed=0)
tok = AutoTokenizer.from_pretrained(d)
port = _free_port()
proc = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", "--model", d, "--device", "cuda",
                         "--dtype", "float32", "--num-gpu-blocks", "256", "--grpc-port", str(port),
                         "--port", str(_free_port())])
ok = True
try:
    assert wait_healthy(f"127.0.0.1:{port}", 300, lambda: proc.poll() is None), "server did not start"
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()
    with GenerationClient(f"127.0.0.1:{port}") as c:
        for prompt in ["The quick brown fox", "What is the capital of France? Paris is", "Hello"]:
            ids = tok(prompt).input_ids
            got, _, _ = c.generate(ids, max_tokens=12, temperature=0.0, ignore_eos=True)
            with torch.no_grad():
                ref = hf.generate(torch.tensor([ids]).cuda(), max_new_tokens=12, min_new_tokens=12,
                                  do_sample=False)[0, len(ids):].tolist()
            same = got == ref
            ok &= same
            print(f"cuda e2e greedy {'OK ' if same else 'MISMATCH'} {prompt!r}: {got} vs {ref}")
        info = c.server_info()
        print("server info:", info.num_gpu_blocks, info.num_free_gpu_blocks, info.device)
finally:
    proc.send_signal(signal.SIGINT); proc.wait(30)
print("E2E_CUDA", "PASS" if ok else "FAIL")
PYEOF
} 2>&1 | tee -a "$OUT/e2e_cuda.log"

{
python3 - <<'PYEOF'
import sys
sys.path.insert(0, "tests")
from models import make_tiny_model
# SmolLM2-135M's shape, random weights (labelled as such).
d = make_tiny_model("/tmp/gpu-models", "llama", seed=1, hidden_size=576, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, intermediate_size=1536, num_hidden_layers=30,
                    vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True)
print(d)
with open("/tmp/smol-shape-dir", "w") as f:
    f.write(d)
PYEOF
for n in 128; do
  python3 -m pagedserve bench throughput --model "$(cat /tmp/smol-shape-dir)" --device cuda \
     --num-requests $n --max-tokens 128
done
} 2>&1 | tee -a "$OUT/e2e_cuda.log"
