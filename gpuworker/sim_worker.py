"""A SIMULATED worker: the worker protocol with no model.

Its "KV pool" stores, in every slot, the token id written there. Every
scheduled token first writes its slot through the block table, then "attends"
by reading the sequence's whole context back through the block table and
checking it equals the sequence's tokens; so any wrong block table,
copy-on-write, swap or prefix-cache hit is caught at once. The next token is
a deterministic function of the context read back.

With a ``CostModel`` each ``StepResult.forward_time_s`` carries the step's
MODELLED time on the paper's hardware (weights and KV read over HBM
bandwidth, plus matmul compute, plus a fixed overhead); the worker never
sleeps, so benchmarks run a simulated clock on it.

Used by scheduler tests and load experiments; anything it produces is
labelled simulated.
"""
from __future__ import annotations

import time
from array import array
from dataclasses import dataclass

from pagedserve.common.config import EngineConfig, env
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.types import ModelInfo
from pagedserve.gpuworker.seq_state import SeqStates

_EMPTY = -1  # never-written slot; internal to the simulation


class SimulationError(AssertionError):
    pass


@dataclass(frozen=True)
class CostModel:
    """SIMULATED step time of one forward pass.

        t = overhead + (weight bytes + KV bytes read and written) / (HBM bw * eff)
            + (2 * params * tokens + attention FLOPs) / (peak FLOP/s * eff)
            + swap bytes / PCIe bw + copy-on-write bytes * 2 / (HBM bw * eff)

    Memory time and compute time are added, not overlapped: an upper bound
    that overestimates a decode step by its matmul FLOPs term (``roofline``
    takes the max for the linear layers instead).
    """

    name: str
    num_params: float  # matmul parameters (2 FLOPs per parameter per token)
    weight_bytes: float  # read once per step
    kv_bytes_per_token: float  # K and V of one token, all layers
    num_layers: int
    hidden_size: int
    hbm_bytes_per_s: float  # peak
    hbm_efficiency: float  # achieved share of peak on streaming reads
    peak_flops: float  # dense fp16 tensor-core peak
    flops_efficiency: float  # achieved share on large GEMMs
    pcie_bytes_per_s: float  # effective host<->device, for swaps
    step_overhead_s: float  # launch + sampling + host work per step
    kv_slots: int  # the KV pool the paper could fit (Table 1)
    # Multiplies the time of attention's KV reads: 1.0 is a kernel at the
    # bandwidth roofline; the paper measured its paged kernel 20-26 % slower
    # than FasterTransformer's contiguous one (Fig. 18a).
    attention_kv_factor: float = 1.0
    # False (default): weight reads and matmul FLOPs add up, as specified.
    # True: the linear layers take max(weight read, matmul compute), a
    # roofline that hides a small batch's FLOPs under its weight read.
    roofline: bool = False

    @classmethod
    def opt13b_a100(cls) -> "CostModel":
        """OPT-13B in fp16 on one A100-40GB, as in the paper's Table 1:
        26 GB of weights, 800 KiB of KV per token (2 x 5120 x 40 layers x
        2 bytes), 12 GiB of KV = 15,728 slots. HBM2e peak 1.555 TB/s at 90 %
        (1.40 TB/s); 312 TFLOP/s fp16 at 60 %; PCIe 4.0 x16 at 25 GB/s;
        2 ms fixed per step."""
        return cls("opt-13b/a100-40gb", num_params=13e9, weight_bytes=26e9, kv_bytes_per_token=2 * 5120 * 40 * 2,
                   num_layers=40, hidden_size=5120, hbm_bytes_per_s=1.555e12, hbm_efficiency=0.90,
                   peak_flops=312e12, flops_efficiency=0.60, pcie_bytes_per_s=25e9, step_overhead_s=2e-3,
                   kv_slots=12 * 2**30 // (800 * 2**10))

    def step_time(self, seqs: list[tuple[int, int]], block_size: int, num_swapped_blocks: int = 0,
                  num_copied_blocks: int = 0) -> float:
        """``seqs``: (tokens already in the pool, tokens computed now) per
        scheduled sequence."""
        if not seqs and not num_swapped_blocks and not num_copied_blocks:
            return 0.0  # a step that only drops finished sequences runs nothing
        hbm = self.hbm_bytes_per_s * self.hbm_efficiency
        t = self.step_overhead_s
        t += num_swapped_blocks * block_size * self.kv_bytes_per_token / self.pcie_bytes_per_s
        t += 2 * num_copied_blocks * block_size * self.kv_bytes_per_token / hbm
        if not seqs:
            return t
        tokens = kv_read = 0
        attn_pairs = 0.0  # (query, key) pairs over all layers' attention
        for ctx, k in seqs:
            tokens += k
            kv_read += ctx + k  # the context's and the new tokens' K/V (the new ones are also written)
            attn_pairs += k * (ctx + (k + 1) / 2)
        flops_per_s = self.peak_flops * self.flops_efficiency
        linear_mem = self.weight_bytes / hbm
        linear_flops = 2 * self.num_params * tokens / flops_per_s
        kv_bytes = (kv_read * self.attention_kv_factor + tokens) * self.kv_bytes_per_token
        attention = kv_bytes / hbm + 4 * self.num_layers * self.hidden_size * attn_pairs / flops_per_s
        if self.roofline:
            return t + max(linear_mem, linear_flops) + attention
        return t + linear_mem + linear_flops + attention


COST_MODELS = {"opt13b-a100": CostModel.opt13b_a100}


class _SlotPool:
    """The simulated pool: every slot (block * block_size + offset) holds the
    token id written there. Flat arrays: cheap to build and invisible to the
    garbage collector, even at 100K+ blocks."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
        self.num_gpu_blocks, self.block_size = num_gpu_blocks, block_size
        self.gpu = array("q", [_EMPTY]) * (num_gpu_blocks * block_size)
        self.cpu = array("q", [_EMPTY]) * (num_cpu_blocks * block_size)

    @staticmethod
    def _copy(pairs: list[tuple[int, int]], src: array, dst: array, bs: int) -> None:
        for a, b in pairs:
            dst[b * bs:(b + 1) * bs] = src[a * bs:(a + 1) * bs]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._copy(pairs, self.gpu, self.cpu, self.block_size)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._copy(pairs, self.cpu, self.gpu, self.block_size)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        self._copy(pairs, self.gpu, self.gpu, self.block_size)


def next_token(context: list[int], vocab_size: int, seed: int | None = None) -> int:
    """The simulated model: a fixed function of the last few tokens and the length."""
    h = (len(context) * 1_000_003 + (seed or 0)) & 0xFFFFFFFF
    for t in context[-8:]:
        h = (h * 2_654_435_761 + t + 1) & 0xFFFFFFFF
    return h % vocab_size


class SimWorker:
    def __init__(self, num_gpu_blocks: int, block_size: int, num_cpu_blocks: int = 0, vocab_size: int = 1000,
                 max_model_len: int = 4096, eos_token_ids: tuple[int, ...] = (), validate: bool = True,
                 cost_model: CostModel | None = None, time_scale: float = 0.0,
                 kv_group_windows: tuple[int, ...] = ()) -> None:
        """``kv_group_windows``: simulate a hybrid KV cache (one table per group,
        0 for a full group, else its window; ``num_gpu_blocks`` is then the pool
        of group blocks): every group's table is written, and read back over
        what its layers attend to (a sliding group: the window of each query)."""
        self.num_gpu_blocks = num_gpu_blocks
        self.kv_group_windows = tuple(kv_group_windows)
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.validate = validate
        self.cost_model = cost_model
        self.time_scale = time_scale
        self.simulated_time_s = 0.0  # sum of modelled step times
        self.pool = _SlotPool(num_gpu_blocks, num_cpu_blocks, block_size)
        self.states = SeqStates(len(self.kv_group_windows) or 1)
        self.tokens_computed = 0

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "SimWorker":
        """The process form (``pagedserve gpuworker --worker sim``). Step
        times come from the OPT-13B / A100-40GB cost model (environment
        PAGEDSERVE_SIM_COST_MODEL=none for zero step times); without
        --num-gpu-blocks the pool is the paper's 15.7K token slots (12 GiB at
        800 KiB per token) plus the null block. --swap-space sizes the CPU
        pool at 800 KiB per token, as for the model it simulates.
        PAGEDSERVE_SIM_TIME_SCALE=F > 0 makes each step last F times its
        modelled time in real time (the default 0: never sleeps)."""
        name = env("SIM_COST_MODEL", "opt13b-a100")
        scale = float(env("SIM_TIME_SCALE", "0"))
        if not 0.0 <= scale <= 100.0:
            raise ValueError(f"PAGEDSERVE_SIM_TIME_SCALE={scale}: in [0, 100]")
        if name != "none" and name not in COST_MODELS:
            raise ValueError(f"PAGEDSERVE_SIM_COST_MODEL={name!r}: choose none or one of {sorted(COST_MODELS)}")
        cost = None if name == "none" else COST_MODELS[name]()
        paper = CostModel.opt13b_a100()
        num_blocks = cfg.num_gpu_blocks or paper.kv_slots // cfg.block_size + 1
        block_bytes = cfg.block_size * paper.kv_bytes_per_token
        num_cpu_blocks = int(cfg.swap_space * 2**30 // block_bytes)
        return cls(num_blocks, cfg.block_size, num_cpu_blocks, vocab_size=50_272,
                   max_model_len=cfg.max_model_len or 2048, validate=False, cost_model=cost, time_scale=scale)

    def init(self) -> wk.WorkerReady:
        name = f"simulated:{self.cost_model.name}" if self.cost_model else "simulated"
        info = ModelInfo(name, self.vocab_size, self.max_model_len, self.eos_token_ids, 1, 1, 1,
                         "none", "sim")
        return wk.WorkerReady(info, self.num_gpu_blocks, self.num_cpu_blocks, self.block_size,
                              list(self.kv_group_windows))

    def reset(self) -> None:
        self.states.clear()

    def execute(self, step: wk.ExecuteStep) -> wk.StepResult:
        for ns in step.new_seqs:
            if ns.params.structured is not None:  # its random tokens cannot follow a grammar: say so
                raise SimulationError(f"seq {ns.seq_id}: structured outputs need the model worker, not --worker sim")
        scheduled = self.states.apply(step, self.pool)
        bs = self.block_size
        pool = self.pool.gpu
        cost_seqs: list[tuple[int, int]] = []
        # Write every scheduled token's slot first (as a forward pass does per layer) ...
        for st, n in scheduled:
            end = st.num_computed_tokens + n
            if end > len(st.token_ids):
                raise SimulationError(f"seq {st.seq_id}: scheduled past its known tokens")
            if end > len(st.block_ids) * bs:
                raise SimulationError(f"seq {st.seq_id}: {end} tokens but {len(st.block_ids)} blocks")
            toks = st.token_ids
            for table in st.group_tables or [st.block_ids]:
                if end > len(table) * bs:
                    raise SimulationError(f"seq {st.seq_id}: {end} tokens but {len(table)} blocks in a KV cache group")
                for pos in range(st.num_computed_tokens, end):
                    pool[table[pos // bs] * bs + pos % bs] = toks[pos]
            cost_seqs.append((st.num_computed_tokens, n))
        # ... then read each context back through the block table.
        sampled: list[wk.SampledToken] = []
        for st, n in scheduled:
            end = st.num_computed_tokens + n
            if self.validate:
                for g, table in enumerate(st.group_tables or [st.block_ids]):
                    w = self.kv_group_windows[g] if st.group_tables else 0
                    lo = max(0, st.num_computed_tokens - w + 1) if w else 0  # the first query's window
                    seen = [pool[table[p // bs] * bs + p % bs] for p in range(lo, end)]
                    if seen != st.token_ids[lo:end]:
                        bad = lo + next(i for i in range(end - lo) if seen[i] != st.token_ids[lo + i])
                        raise SimulationError(f"seq {st.seq_id}: position {bad} reads token {seen[bad - lo]}, "
                                              f"expected {st.token_ids[bad]} (group {g}, block {table[bad // bs]})")
            self.tokens_computed += n
            if end == len(st.token_ids):
                sampled.append(wk.SampledToken(st.seq_id, next_token(st.token_ids, self.vocab_size, st.params.seed)))
        self.states.finish_step(scheduled, sampled)
        t = 0.0
        if self.cost_model is not None:
            t = self.cost_model.step_time(cost_seqs, bs, len(step.swap_in) + len(step.swap_out), len(step.copies))
            self.simulated_time_s += t
            if self.time_scale > 0:  # real time: end-to-end latencies (TTFT, ITL) follow the cost model
                time.sleep(t * self.time_scale)
        # Its random tokens cannot follow a grammar: every asked one fails, so its requests do.
        refused = [wk.GrammarStatus(spec, "structured outputs need the model worker, not --worker sim")
                   for spec in step.compile]
        return wk.StepResult(step.step_id, sampled, forward_time_s=t, grammars=refused)


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
