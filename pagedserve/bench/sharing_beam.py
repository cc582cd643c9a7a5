"""Blocks saved by beam search on real runs of a model (paper Fig. 15, beam rows).

The engine core runs in-process with the real BlockManager and the real
ModelRunner (by default the embedded SmolLM2-135M-Instruct). Every step each
new beam forks its parent (all blocks shared, copy-on-write on the last one)
and pruned beams are freed; after each step we read ``BlockStats``: blocks in
use and references beyond the first (the blocks a sharing-free allocator
would need on top). Saving = shared refs / (used + shared refs), summed over
steps, as in ``bench sharing`` for parallel sampling.

Prompts are real text cut to the workload's prompt lengths; output lengths
are capped (``--max-output``) so CPU runs stay short, which lowers the
savings against the paper's long ShareGPT outputs: the cap is printed.
"""
from __future__ import annotations

from pagedserve.bench.workloads import RequestLen, sample_lengths
from pagedserve.blockmgr.manager import BlockManager
from pagedserve.common.config import EngineConfig
from pagedserve.common.messages.frontend import AddRequest
from pagedserve.common.messages.types import SamplingParams
from pagedserve.scheduler.engine import EngineCore, InProcessBlockClient, InProcessWorkerClient

_TEXT = ("The paged attention algorithm stores the keys and values of every sequence in fixed-size blocks that "
         "need not be contiguous in memory. A block table maps the logical blocks of a sequence to physical "
         "blocks, so memory is allocated on demand and freed at once, and blocks can be shared between the "
         "samples of one request, between the beams of a beam search and between requests with a common prefix. ")


def prompts_for(tokenizer: object, lens: list[RequestLen]) -> list[list[int]]:
    ids = list(tokenizer(_TEXT * 40).input_ids)  # type: ignore[operator]
    out = []
    for i, r in enumerate(lens):
        start = (i * 37) % (len(ids) - r.prompt_len - 1)
        out.append(ids[start:start + max(2, r.prompt_len)])
    return out


def beam_saving(model: str | None, workload: str, width: int, num_requests: int, max_output: int, seed: int,
                block_size: int = 16) -> dict[str, float]:
    from transformers import AutoTokenizer

    from pagedserve.common.default_model import resolve_model
    from pagedserve.gpuworker.model_runner import ModelRunner

    folder = resolve_model(model)
    reqs = sample_lengths(workload, num_requests, seed)
    prompts = prompts_for(AutoTokenizer.from_pretrained(folder), reqs)
    cfg = EngineConfig(model=folder, block_size=block_size, num_gpu_blocks=2048, max_num_seqs=256,
                       enable_prefix_caching=False)
    blocks = InProcessBlockClient(lambda i: BlockManager(i.num_gpu_blocks, i.num_cpu_blocks, i.block_size,
                                                         i.enable_prefix_caching, i.watermark))
    core = EngineCore(cfg, blocks, InProcessWorkerClient(ModelRunner(cfg)))
    for i, (p, r) in enumerate(zip(prompts, reqs)):
        n_out = max(2, min(r.output_len, max_output))
        core.handle(AddRequest(f"b{i}", p, SamplingParams(max_tokens=n_out, temperature=0.0, beam_width=width,
                                                            n=1), float(i)))
    used = shared = steps = 0
    while core.has_work():
        core.step()
        st = blocks.manager.stats()
        used += st.num_gpu_blocks - st.num_free_gpu_blocks
        shared += st.num_shared_block_refs
        steps += 1
    return {"saving_pct": 100.0 * shared / max(1, used + shared), "steps": steps}
