"""The worker's core, with no sockets: it owns the model, the KV pools and each
sequence's state, and turns one ``ExecuteStep`` into one ``StepResult``.

State is incremental (vLLM v1 style): a sequence arrives once as ``NewSeq``;
afterwards the scheduler sends only block-table diffs and how many tokens to
compute. The runner appends every token it samples, so it always knows the
whole sequence; it samples only when the scheduled tokens reach its end.

Tensor parallelism: every rank runs a ModelRunner over its shard of the
model and its own KV pool (its heads only). Rank 0 gets each request from the
scheduler and broadcasts it (``execute``/``reset``/``shutdown``); the other
ranks run ``follow``. All ranks build the same batch from the same state, so
they meet in the same collectives; rank 0 samples and broadcasts the token
ids so every rank appends the same tokens.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.common.config import EngineConfig, env_flag, step_trace
from pagedserve.common.default_model import DEFAULT_MODEL_NAME, cache_dir, gguf_source, is_gguf, resolve_model
from pagedserve.common.messages.types import ModelInfo
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.worker import (
    ExecuteStep,
    NewSeq,
    PromptLogprobs,
    SampledToken,
    StepResult,
    WorkerReady,
)
from pagedserve.gpuworker.cache_engine import CacheEngine, bytes_per_block
from pagedserve.gpuworker.cpu_gemm import pack_model
from pagedserve.gpuworker.cuda_graph import DecodeGraphs
from pagedserve.gpuworker.gguf_weights import (
    GGUF_DEQUANTIZE_ENV,
    gguf_tensor_bytes,
    iter_gguf_weights,
    release_freed_heap,
    weight_bytes,
)
from pagedserve.gpuworker.distributed import SINGLE, TPGroup, rank_device
from pagedserve.gpuworker.kv_groups import KVGroups, kv_groups
from pagedserve.gpuworker.inputs import PromptLogprobPlan, prepare_batch
from pagedserve.gpuworker.layers import PagedAttention
from pagedserve.gpuworker.loader import context_limit, eos_token_ids, iter_weights, load_hf_config
from pagedserve.gpuworker.models import build_model
from pagedserve.gpuworker.pool_sizing import pool_blocks, profile_free_bytes
from pagedserve.gpuworker.sampler import Sampler
from pagedserve.gpuworker.seq_state import SeqStates
from pagedserve.gpuworker.step_gaps import StepGaps
from pagedserve.gpuworker.grammar_compiler import IDLE_WAIT_S, AsyncCompiles
from pagedserve.gpuworker.structured import StructuredDecoding
from pagedserve.kernels import cpu_build, get_attention_backend, quant_cpu
from pagedserve.kernels.fp8 import kv_cache_dtype, unit_scale


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CUDA_GRAPHS_ENV = "CUDA_GRAPHS"  # PAGEDSERVE_CUDA_GRAPHS=0 disables decode CUDA graphs


@dataclass(frozen=True)
class ModelSource:
    """A model that is not a folder on disk (benchmarks: random weights of a
    given shape). ``weights`` is called once and yields (name, tensor)."""

    hf_config: Any
    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]
    name: str
    eos_token_ids: tuple[int, ...] = ()


def cuda_graphs_wanted(flag: bool | None) -> bool:
    if flag is not None:
        return flag
    return bool(env_flag(CUDA_GRAPHS_ENV, True))


def configure_kernels() -> None:
    """The kernels read no configuration (issue 21): they get the cache folder and the
    PAGEDSERVE_CPU_KERNEL switch from the worker, before their first load."""
    cpu_build.configure(cache_dir() / "kernels", enabled=bool(env_flag(cpu_build.ENV, True)))


class ModelRunner:
    def __init__(
        self,
        cfg: EngineConfig,
        tp: TPGroup = SINGLE,
        source: ModelSource | None = None,
        cuda_graphs: bool | None = None,
        keep_logits: bool = False,
        hybrid_kv: bool = False,
    ) -> None:
        """``cuda_graphs``: None follows $PAGEDSERVE_CUDA_GRAPHS (default on);
        graphs are used only on CUDA, with the Triton backend, on one rank.
        ``keep_logits``: keep the last step's logits in ``last_logits`` (tests
        compare them; serving must not hold them past the step).
        ``hybrid_kv``: the driver speaks per-group block tables (the scheduler
        does; the gpuworker service sets it): a hybrid model then gets KV cache
        groups (kv_groups.py), unless --disable-hybrid-kv-cache-manager. Off, every
        model keeps one table per sequence for all layers."""
        self.cfg, self.tp, self.source = cfg, tp, source
        self.gguf_file: str | None = None  # the GGUF file the weights came from, blocks kept
        self.weight_bytes: dict[str, int] = {}  # resident weights by kind (gguf_weights.weight_bytes)
        configure_kernels()
        self.device = rank_device(cfg.device, tp.rank)
        self.dtype = _DTYPES[cfg.torch_dtype_name]
        self.want_graphs = cuda_graphs_wanted(cuda_graphs) and not cfg.enforce_eager
        self.graphs: DecodeGraphs | None = None
        self.states = SeqStates()  # every sequence's tokens, block table and progress
        self.keep_logits = keep_logits
        self.hybrid_kv = hybrid_kv and not cfg.disable_hybrid_kv_cache_manager
        self.kv_groups: KVGroups | None = None  # set by init
        self.last_logits: dict[int, torch.Tensor] = {}  # seq_id -> float32 [vocab], with keep_logits
        self.ready: WorkerReady | None = None
        self.profile: dict[str, int] = {}  # CUDA memory profile (bytes), when the pool was sized from it
        self.tokens_computed = 0  # cumulative, read by the --metrics-port hook
        # Idle time between steps (the cost of scheduling between them); per-step lines when asked.
        self.gaps = StepGaps(trace=sys.stderr if step_trace() else None)
        self.structured = StructuredDecoding(None, 0, ())  # grammar matchers (rank 0), set up by init
        # Grammars compiled off the step path (rank 0); the cache stays the structured decoder's.
        self.compiles = AsyncCompiles(lambda: self.structured.compiler(),
                                      lambda compiler, spec: self.structured.build(compiler, spec),
                                      lambda spec: self.structured.has(spec),
                                      lambda spec, compiled: self.structured.keep(spec, compiled))

    # ---- start-up -------------------------------------------------------
    def init(self) -> WorkerReady:
        """Load the model, size and allocate the KV pools (idempotent)."""
        if self.ready is not None:
            return self.ready
        cfg, tp = self.cfg, self.tp
        if self.source is not None:
            hf, weights, name, eos = self.source.hf_config, self.source.weights(), self.source.name, self.source.eos_token_ids
        else:
            folder = resolve_model(cfg.model)
            hf = load_hf_config(folder, cfg.hf_overrides, cfg.trust_remote_code)
            # A GGUF file named as the model (vLLM's way): its quantized blocks kept as they are. The
            # embedded default model and a converted folder serve the dequantized weights, exact
            # against transformers (int8 activations flip near ties: SmolLM2's "The"/"L'" at 0.09).
            # serve sets --load-format gguf (vLLM's name) for a .gguf model before handing children its folder.
            kept = cfg.load_format == "gguf" or (cfg.load_format == "auto" and cfg.model is not None and is_gguf(cfg.model))
            self.gguf_file = gguf_source(folder) if kept and not env_flag(GGUF_DEQUANTIZE_ENV, False) else None
            weights = (iter_gguf_weights(self.gguf_file, hf) if self.gguf_file else
                       iter_weights(folder, progress=tp.is_driver, load_format="auto" if cfg.load_format == "gguf" else cfg.load_format,
                                    hf_config=hf))
            name = DEFAULT_MODEL_NAME if cfg.model is None else os.path.basename(os.path.normpath(folder))
            eos = eos_token_ids(folder, hf)
        self.hf_config = hf
        model_max = context_limit(hf)  # sliding windows are masked in attention: no cap of their own
        if cfg.max_model_len is not None and cfg.max_model_len > model_max:
            raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's max_position_embeddings {model_max}")
        self.max_model_len = cfg.max_model_len or model_max
        t0 = time.monotonic()
        self.model = build_model(hf, weights, self.dtype, self.device, max(model_max, self.max_model_len), tp)
        load_s = time.monotonic() - t0
        if self.device.type == "cpu":
            pack_model(self.model, cfg.max_num_seqs)  # after loading: packs the loaded weights
            release_freed_heap()
        self.weight_bytes = weight_bytes(self.model)
        self.backend = get_attention_backend(cfg.attention_backend, self.device)
        for m in self.model.modules():
            if isinstance(m, PagedAttention):
                m.backend = self.backend
                m.k_scale, m.v_scale = unit_scale(self.device), unit_scale(self.device)  # fp8 pools: vLLM's default 1.0
        self.num_layers = self.model.num_layers
        self.num_kv_heads, self.head_dim = self.model.num_kv_heads, self.model.head_dim  # this rank's heads
        self.vocab_size = hf.vocab_size
        self.sampler = Sampler(cfg.seed, eos)  # before sizing: the CUDA profile runs it
        tok_dir = resolve_model(cfg.tokenizer or cfg.model)  # --tokenizer's vocabulary for the grammars
        self.structured = StructuredDecoding(None if self.source else tok_dir, self.vocab_size, eos,
                                             cfg.structured_outputs_config.disable_any_whitespace)
        self.kv_dtype = kv_cache_dtype(cfg.kv_cache_dtype, self.dtype)  # fp8: one byte an element, more blocks
        per_block = bytes_per_block(self.num_layers, cfg.block_size, self.num_kv_heads, self.head_dim, self.kv_dtype)
        # Each rank sizes its own pool from its own memory; the block ids are
        # shared, so the group agrees on the smallest count.
        num_gpu_blocks = tp.all_reduce_min(pool_blocks(cfg, self.device, self.max_model_len, per_block, self._profile))
        num_cpu_blocks = int(cfg.swap_space * (1 << 30)) // per_block
        # A hybrid model (sliding and full layers) gets KV cache groups (kv_groups.py): the pool
        # is one group's layers deep, with G times the blocks in the same memory (block 0 stays
        # the one null block), so --num-gpu-blocks names the same memory as for one table.
        attns = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self.kv_groups = kv_groups([m.sliding_window for m in attns], cfg.block_size, self.max_model_len,
                                   not self.hybrid_kv) if len(attns) == self.num_layers else None
        pool_layers = self.num_layers
        if self.kv_groups is not None:
            G = self.kv_groups.num_groups
            for m, g in zip(attns, self.kv_groups.layer_group):
                m.kv_group = g
            pool_layers = self.kv_groups.group_size
            num_gpu_blocks = (num_gpu_blocks - 1) * G + 1
            num_cpu_blocks *= G
            per_block //= G
        self.states = SeqStates(self.kv_groups.num_groups if self.kv_groups is not None else 1)
        self.cache = CacheEngine(
            pool_layers, num_gpu_blocks, num_cpu_blocks, cfg.block_size,
            self.num_kv_heads, self.head_dim, self.kv_dtype, self.device, self.backend,
        )
        # The pool pair each layer reads (layer i of every group: pair i); one list, so its identity is stable.
        self.layer_caches = (self.cache.gpu if self.kv_groups is None
                             else [self.cache.gpu[slot] for slot in self.kv_groups.layer_slot])
        info = ModelInfo(
            model_name=name, vocab_size=self.vocab_size, max_model_len=self.max_model_len, eos_token_ids=eos,
            num_layers=self.num_layers, num_kv_heads=self.model.total_kv_heads, head_dim=self.head_dim,
            dtype=cfg.torch_dtype_name, device=str(self.device),
        )
        if tp.is_driver:
            shard = f", tensor parallel {tp.size} ({self.num_kv_heads} of {self.model.total_kv_heads} KV heads per rank)" if tp.size > 1 else ""
            print(
                f"pagedserve gpuworker: {name} ({type(self.model).__name__}, {cfg.torch_dtype_name}, {self.device}, "
                f"attention={self.backend.name}{shard}) loaded in {load_s:.1f} s; {self._weights_line()}; KV pool {num_gpu_blocks} blocks x "
                f"{cfg.block_size} = {num_gpu_blocks * cfg.block_size} tokens ({num_gpu_blocks * per_block / 2**20:.0f} MiB of {str(self.kv_dtype)[6:]}"
                f"{' per rank' if tp.size > 1 else ''}), swap {num_cpu_blocks} blocks"
                + ("" if self.kv_groups is None else
                   f"; hybrid KV cache: {self.kv_groups.num_groups} groups of {self.kv_groups.group_size} layers, "
                   f"windows {list(self.kv_groups.windows)}"),
                file=sys.stderr, flush=True,
            )
        if (self.device.type == "cuda" and self.want_graphs and self.backend.name == "triton" and tp.size == 1
                and self.kv_groups is None):  # decode graphs capture one block table per sequence
            self.graphs = DecodeGraphs(self._forward, min(cfg.max_num_seqs, num_gpu_blocks), self.max_model_len,
                                       cfg.block_size, self.device)
            self.graphs.capture()
        self.ready = WorkerReady(model=info, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                                 block_size=cfg.block_size,
                                 kv_group_windows=[] if self.kv_groups is None else list(self.kv_groups.windows))
        return self.ready

    def _weights_line(self) -> str:
        total = sum(self.weight_bytes.values())
        line = f"weights {total / 2**20:.0f} MiB"
        if self.gguf_file:
            file_bytes = gguf_tensor_bytes(self.gguf_file)
            line += (f" ({total / file_bytes:.2f}x the {file_bytes / 2**20:.0f} MiB of tensors in "
                     f"{os.path.basename(self.gguf_file)}; quantized blocks kept)")
        return line

    def _profile(self) -> int:
        free, self.profile = profile_free_bytes(self)
        return free

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        return self.model(input_ids, positions, self.layer_caches, meta)

    # ---- steps ----------------------------------------------------------
    def reset(self) -> None:
        if self.tp.size > 1 and self.tp.is_driver:
            self.tp.send_request(wk.ResetWorker())
        self._reset()

    def _reset(self) -> None:
        self.states.clear()
        self.last_logits.clear()
        self.structured.clear()
        self.compiles.clear()
        self.sampler.seeded.clear()

    def execute(self, step: ExecuteStep) -> StepResult:
        if self.ready is None:
            raise RuntimeError("worker not initialised (send InitWorker first)")
        if self.tp.size > 1 and self.tp.is_driver:
            self.tp.send_request(step)
        self.gaps.begin()
        try:
            return self._execute(step)
        finally:
            self.gaps.end(len(step.scheduled), sum(s.num_tokens for s in step.scheduled))

    def follow(self) -> None:
        """Ranks > 0: run rank 0's requests until it shuts the group down. A
        failing step fails identically on rank 0, which reports it."""
        while True:
            msg = self.tp.recv_request()
            if isinstance(msg, wk.Shutdown):
                break
            try:
                if isinstance(msg, wk.ExecuteStep):
                    self._execute(msg)
                elif isinstance(msg, wk.ResetWorker):
                    self._reset()
            except ValueError:
                pass  # a rejected step (validation happens before any collective)

    def shutdown(self) -> None:
        """Rank 0: release the other ranks from ``follow`` (harmless on one rank)."""
        if self.tp.size > 1 and self.tp.is_driver:
            self.tp.send_request(wk.Shutdown())

    @torch.inference_mode()
    def _execute(self, step: ExecuteStep) -> StepResult:
        t0 = time.perf_counter()
        if step.compile and self.tp.is_driver:
            self.compiles.start(step.compile)
        for seq_id in step.finished:
            self.structured.drop(seq_id)
            self.sampler.drop(seq_id)
        for new in step.new_seqs:
            self._check_new(new)
        scheduled = self.states.apply(step, self.cache)
        self.last_logits.clear()
        if not scheduled:  # a step only for compiles waits briefly for one: it paces the scheduler's asks
            grammars = self.compiles.finished(IDLE_WAIT_S) if self.tp.is_driver else []
            return StepResult(step.step_id, [], time.perf_counter() - t0, grammars=grammars)
        batch = prepare_batch(scheduled, self.cfg.block_size, self.max_model_len, self.device)
        if self.gguf_file and self.device.type == "cpu":  # prompts on bf16 panels, decodes on int8 (quant_cpu)
            quant_cpu.prompt_step(not batch.decode_only)
        if self.graphs is not None and batch.decode_only and len(scheduled) <= self.graphs.max_batch:
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.layer_caches, batch.meta)
        # Collectives in the same order on every rank; what only rank 0 does
        # (scoring, sampling) is guarded, and its outcome travels with the
        # token ids, so a failure fails the step on every rank at one point.
        error: Exception | None = None
        prompt_lps: list[PromptLogprobs] = []
        for plan in batch.prompt_logprobs:
            scored = self._prompt_logprobs(hidden, plan)
            if scored is not None:
                prompt_lps.append(PromptLogprobs(plan.seq_id, plan.start, *scored))
        seqs = [scheduled[r][0] for r in batch.sample_rows]
        token_ids: list[int] = [0] * len(seqs)
        logprobs: list[float | None] = [None] * len(seqs)
        tops: list[list[tuple[int, float]]] = [[] for _ in seqs]
        logits = None
        if seqs:
            logits = self.model.compute_logits(hidden[batch.sample_token_idx]).float()
            if self.tp.is_driver:
                try:
                    self.structured.apply(logits, seqs)  # grammar masks, one batched bitmask
                    out = self.sampler(logits, seqs)
                    token_ids, logprobs, tops = out.token_ids, out.logprobs, out.top_logprobs
                except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks hear of it
                    error = e
        if self.tp.size > 1:  # every rank appends rank 0's tokens, or fails with it
            status = torch.tensor([int(error is not None), *token_ids], dtype=torch.int64, device=self.device)
            failed, *token_ids = self.tp.broadcast(status).tolist()
            if failed and error is None:
                raise ValueError(f"step {step.step_id} failed on rank 0")
        if error is not None:
            raise error
        sampled = [SampledToken(seq.seq_id, token_ids[i], logprobs[i], tops[i]) for i, seq in enumerate(seqs)]
        if logits is not None and self.keep_logits:
            self.last_logits = {seq.seq_id: logits[i] for i, seq in enumerate(seqs)}
        self.states.finish_step(scheduled, sampled)
        self.tokens_computed += len(batch.input_ids)
        self.structured.advance([(t.seq_id, t.token_id) for t in sampled])
        grammars = self.compiles.finished() if self.tp.is_driver else []
        return StepResult(step.step_id, sampled, time.perf_counter() - t0, prompt_lps, grammars)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, plan: PromptLogprobPlan
    ) -> tuple[list[tuple[float, list[tuple[int, float]]]], list[int]] | None:
        """log_softmax of the raw logits at each scored position: the prompt
        token's logprob, the top-k and the token's rank as vLLM counts it (the
        logprobs >= its own). Rank 0 only; None elsewhere. Chunked to
        max_num_seqs rows, the logits size the memory profile accounted for."""
        entries: list[tuple[float, list[tuple[int, float]]]] = []
        ranks: list[int] = []
        chunk = max(1, self.cfg.max_num_seqs)
        k = min(plan.top_k, self.vocab_size)
        for lo in range(0, len(plan.rows), chunk):
            rows = torch.tensor(plan.rows[lo : lo + chunk], dtype=torch.long, device=self.device)
            lp = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)  # collective
            if not self.tp.is_driver:
                continue
            targets = torch.tensor(plan.targets[lo : lo + chunk], dtype=torch.long, device=self.device)
            chosen_t = lp.gather(1, targets[:, None])
            ranks += (lp >= chosen_t).sum(-1).tolist()
            chosen = chosen_t.squeeze(1).tolist()
            top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
            for c, ids, vals in zip(chosen, top_i.tolist(), top_v.tolist()):
                entries.append((c, list(zip(ids, vals))))
        return (entries, ranks) if self.tp.is_driver else None

    def _check_new(self, new: NewSeq) -> None:
        """What only a model worker checks of a new sequence (``SeqStates`` checks the rest)."""
        bad = [t for t in new.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"seq {new.seq_id}: token ids outside the vocabulary of {self.vocab_size}: {bad[:5]}")
        if self.tp.is_driver:  # rank 0 samples: its matcher replays what was generated already
            if new.params.structured is not None:
                self.compiles.settle(new.params.structured)  # a compile of it in flight: wait for that one
            self.structured.add(new.seq_id, new.params, new.token_ids[new.num_prompt_tokens:])
