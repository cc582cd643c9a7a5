"""Runs vLLM's offline ``LLM.generate`` for `bench peers`, inside .venv-peers.

Started as ``.venv-peers/bin/python vllm_peer_worker.py CONFIG.json`` (it
imports only the standard library and vLLM, never pagedserve, whose
dependencies differ). It loads the model once, warms up, prints one tagged
JSON line, then for each ``{"run": NAME}`` line on stdin generates that
workload and prints ``{"seconds": ..., "token_ids": [...], "texts": [...]}``
(texts only with ``"text": true`` in the config, detokenized by vLLM inside
the timed run); it exits at EOF.
vLLM spawns processes, hence the ``__main__`` guard.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any

TAG = "PEER_RESULT "


def _emit(msg: dict[str, Any]) -> None:
    sys.stdout.write(TAG + json.dumps(msg) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        cfg = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=cfg["model"], dtype=cfg.get("dtype", "float32"), seed=0, max_model_len=cfg["max_model_len"],
              max_num_seqs=cfg["max_num_seqs"])

    text = bool(cfg.get("text", False))

    def params(o: int) -> Any:
        # detokenize as the other engines do in their timed path (ids only unless "text").
        return SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=text)

    work = {k: ([TokensPrompt(prompt_token_ids=p) for p in w["prompts"]], [params(o) for o in w["outputs"]])
            for k, w in cfg["workloads"].items()}
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params(2), use_tqdm=False)  # warm-up
    _emit({"ready": True, "version": __import__("vllm").__version__})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            prompts, ps = work[json.loads(line)["run"]]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, ps, use_tqdm=False)
            dt = time.perf_counter() - t0
            _emit({"seconds": dt, "token_ids": [list(o.outputs[0].token_ids) for o in outs],
                   "texts": [o.outputs[0].text for o in outs] if text else None})
        except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
            _emit({"error": f"{type(e).__name__}: {e}"})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
