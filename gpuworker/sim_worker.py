"""A SIMULATED worker: the worker protocol with no model.

Its "KV pool" stores, in every slot, the token id written there. Every
scheduled token first writes its slot through the block table, then "attends"
by reading the sequence's whole context back through the block table and
checking it equals the sequence's tokens; so any wrong block table,
copy-on-write, swap or prefix-cache hit is caught at once. The next token is
a deterministic function of the context read back.

Used by scheduler tests and load experiments; anything it produces is
labelled simulated.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.common.config import EngineConfig
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.types import ModelInfo

_EMPTY = -1  # never-written slot; internal to the simulation


class SimulationError(AssertionError):
    pass


@dataclass
class _SeqState:
    token_ids: list[int]
    block_table: list[int]
    num_computed: int
    num_prompt: int
    seed: int | None = None
    outputs: list[int] = field(default_factory=list)


def next_token(context: list[int], vocab_size: int, seed: int | None = None) -> int:
    """The simulated model: a fixed function of the last few tokens and the length."""
    h = (len(context) * 1_000_003 + (seed or 0)) & 0xFFFFFFFF
    for t in context[-8:]:
        h = (h * 2_654_435_761 + t + 1) & 0xFFFFFFFF
    return h % vocab_size


class SimWorker:
    def __init__(self, num_gpu_blocks: int, block_size: int, num_cpu_blocks: int = 0, vocab_size: int = 1000,
                 max_model_len: int = 4096, eos_token_ids: tuple[int, ...] = (), validate: bool = True) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.validate = validate
        self.gpu = [[_EMPTY] * block_size for _ in range(num_gpu_blocks)]
        self.cpu = [[_EMPTY] * block_size for _ in range(num_cpu_blocks)]
        self.seqs: dict[int, _SeqState] = {}
        self.tokens_computed = 0

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "SimWorker":
        """The process form (``pagedserve gpuworker --worker sim``). Without
        --num-gpu-blocks it takes the paper's OPT-13B budget on one A100-40GB:
        15.7K token slots."""
        num_blocks = cfg.num_gpu_blocks or 15_700 // cfg.block_size + 1
        return cls(num_blocks, cfg.block_size, vocab_size=50_272, max_model_len=cfg.max_model_len or 2048,
                   validate=False)

    def init(self) -> wk.WorkerReady:
        info = ModelInfo("simulated", self.vocab_size, self.max_model_len, self.eos_token_ids, 1, 1, 1,
                         "none", "sim")
        return wk.WorkerReady(info, self.num_gpu_blocks, self.num_cpu_blocks, self.block_size)

    def reset(self) -> None:
        self.seqs.clear()

    def execute(self, step: wk.ExecuteStep) -> wk.StepResult:
        for sid in step.finished:
            self.seqs.pop(sid, None)
        # The order the blockmgr documents: a block released by an earlier op
        # of the step may be the destination of a later one.
        for gpu, cpu in step.swap_out:
            self.cpu[cpu] = list(self.gpu[gpu])
        for cpu, gpu in step.swap_in:
            self.gpu[gpu] = list(self.cpu[cpu])
        for src, dst in step.copies:
            self.gpu[dst] = list(self.gpu[src])
        for ns in step.new_seqs:
            if ns.seq_id in self.seqs:
                raise SimulationError(f"seq {ns.seq_id} sent twice as new")
            self.seqs[ns.seq_id] = _SeqState(list(ns.token_ids), list(ns.block_ids), ns.num_computed_tokens,
                                             ns.num_prompt_tokens, ns.params.seed)
        for d in step.block_diffs:
            st = self.seqs[d.seq_id]
            del st.block_table[d.table_start:]
            st.block_table += d.block_ids
        bs = self.block_size
        # Write every scheduled token's slot first (as a forward pass does per layer) ...
        for sch in step.scheduled:
            st = self.seqs[sch.seq_id]
            end = st.num_computed + sch.num_tokens
            if end > len(st.token_ids):
                raise SimulationError(f"seq {sch.seq_id}: scheduled past its known tokens")
            if end > len(st.block_table) * bs:
                raise SimulationError(f"seq {sch.seq_id}: {end} tokens but {len(st.block_table)} blocks")
            for pos in range(st.num_computed, end):
                self.gpu[st.block_table[pos // bs]][pos % bs] = st.token_ids[pos]
        # ... then read each context back through the block table.
        sampled: list[wk.SampledToken] = []
        for sch in step.scheduled:
            st = self.seqs[sch.seq_id]
            end = st.num_computed + sch.num_tokens
            if self.validate:
                seen = [self.gpu[st.block_table[p // bs]][p % bs] for p in range(end)]
                if seen != st.token_ids[:end]:
                    bad = next(p for p in range(end) if seen[p] != st.token_ids[p])
                    raise SimulationError(f"seq {sch.seq_id}: position {bad} reads token {seen[bad]}, "
                                          f"expected {st.token_ids[bad]} (block {st.block_table[bad // bs]})")
            st.num_computed = end
            self.tokens_computed += sch.num_tokens
            if end == len(st.token_ids):
                tok = next_token(st.token_ids, self.vocab_size, st.seed)
                st.token_ids.append(tok)
                sampled.append(wk.SampledToken(sch.seq_id, tok))
        return wk.StepResult(step.step_id, sampled)


def expected_output(prompt: list[int], max_tokens: int, vocab_size: int, seed: int | None = None,
                    eos_token_ids: tuple[int, ...] = ()) -> list[int]:
    """What an unconstrained run produces for one request (the oracle for tests)."""
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        t = next_token(tokens, vocab_size, seed)
        tokens.append(t)
        out.append(t)
        if t in eos_token_ids:
            break
    return out
