"""Frozen configuration shared by every component.

Each component parses the same flags (so ``pagedserve serve`` can hand its
command line to every child, and compose can set them per service) and builds
one immutable ``EngineConfig``; nothing mutates it afterwards.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import socket
from dataclasses import dataclass
from typing import Any

from pagedserve.common import curve
from pagedserve.common.device import cpu_kv_cache_space, resolve_device
from pagedserve.common.env import env, env_flag, env_int
from pagedserve.common.messages.blockmgr import DEFAULT_WATERMARK
from pagedserve.common.rundir import default_run_dir
from pagedserve.common.kv_events_config import KVEventsConfig, parse_kv_events_config
from pagedserve.common.structured_config import StructuredOutputsConfig, parse_structured_outputs_config

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'512MiB', '2G', '1048576' -> bytes (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class Addresses:
    """ZeroMQ endpoints. The scheduler binds the two frontend-facing queues;
    blockmgr and gpuworker bind their request sockets."""

    scheduler_in: str
    scheduler_out: str
    blockmgr: str
    worker: str


def default_addresses(run_dir: str | None = None) -> Addresses:
    # Not a shared $TMPDIR/pagedserve: a per-user folder, checked private (rundir) before use.
    run_dir = run_dir or env("RUN_DIR") or default_run_dir()
    return Addresses(
        scheduler_in=env("SCHEDULER_IN", f"ipc://{run_dir}/scheduler_in.sock"),
        scheduler_out=env("SCHEDULER_OUT", f"ipc://{run_dir}/scheduler_out.sock"),
        blockmgr=env("BLOCKMGR", f"ipc://{run_dir}/blockmgr.sock"),
        worker=env("WORKER", f"ipc://{run_dir}/worker.sock"),
    )


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    device: str = "cpu"  # the flag's default is auto, resolved by config_from_args (common/device.py)
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    kv_cache_dtype: str = "auto"  # auto: the weights' dtype; fp8 (= fp8_e4m3), fp8_e5m2: kernels/fp8.py
    load_format: str = "auto"  # auto | safetensors | pt | dummy (random weights of the model's shape)
    hf_overrides: str | None = None  # a JSON object applied to the model's config.json on loading
    trust_remote_code: bool = False
    tokenizer: str | None = None  # a folder; None: the model's
    tokenizer_mode: str = "auto"  # auto | hf | slow (use_fast=False)
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes; CPU default below
    gpu_memory_utilization: float = 0.92  # vLLM 0.32's default
    swap_space: float = 0.0  # GiB of CPU swap space
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    enable_chunked_prefill: bool = True  # off: a prompt is prefilled in one step or waits
    # vLLM V0's flag, gone from 0.32; accepted for its command lines. Our scheduler never splits more
    # than one prefill at a time (running sequences take the budget first; a split uses up the rest),
    # so any N >= 1 holds already. None: not given.
    max_num_partial_prefills: int | None = None
    max_model_len: int | None = None  # None: the model's own
    enable_prefix_caching: bool = True
    # vLLM's flag: one block table for every layer even when some slide (no block is freed
    # when it leaves a window); off by default, so hybrid models free them (docs/blockmgr.md)
    disable_hybrid_kv_cache_manager: bool = False
    kv_watermark: float = DEFAULT_WATERMARK  # share of KV blocks kept free when admitting
    preemption_mode: str = "recompute"  # recompute | swap | auto
    # on: plan step N+1 while the worker runs step N; auto: on with CUDA only (on
    # CPU the planning would take cores from the worker's threads: measured slower)
    async_scheduling: str = "auto"  # auto | on | off
    attention_backend: str = "auto"  # auto: triton on CUDA, torch on CPU
    worker: str = "model"  # model | sim (SIMULATED: no model, cost-model step times)
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # no CUDA graphs
    seed: int = 0
    # vLLM's --structured-outputs-config (the worker compiles grammars with it)
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    # vLLM's --kv-events-config (the blockmgr publishes BlockStored/BlockRemoved batches)
    kv_events_config: KVEventsConfig = KVEventsConfig()
    # vLLM's flag, for its command lines (llm-d passes sha256_cbor): KV events always carry
    # sha256_cbor hashes (blockmgr/kv_events.py); the prefix cache's own keys do not change.
    prefix_caching_hash_algo: str = "sha256_cbor"
    # frontend bounds
    max_prompt_chars: int = 1_000_000
    max_stop_ids: int = 64
    shutdown_timeout: float = 0.0  # seconds SIGTERM waits for in-flight requests

    @property
    def use_async_scheduling(self) -> bool:
        return self.async_scheduling == "on" or (self.async_scheduling == "auto" and self.device.startswith("cuda"))

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32, got {self.block_size}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be recompute, swap or auto, got {self.preemption_mode!r}")
        if not 0.0 <= self.kv_watermark < 0.5:
            raise ValueError(f"kv_watermark must be in [0, 0.5), got {self.kv_watermark}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.worker not in ("model", "sim"):
            raise ValueError(f"worker must be model or sim, got {self.worker!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2")
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"async_scheduling must be auto, on or off, got {self.async_scheduling!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype: one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.tokenizer_mode == "mistral":
            raise ValueError("--tokenizer-mode mistral: mistral_common tokenizers are not supported "
                             "(auto, hf or slow)")
        if self.prefix_caching_hash_algo not in ("sha256", "sha256_cbor"):
            raise ValueError(f"--prefix-caching-hash-algo {self.prefix_caching_hash_algo}: only sha256_cbor "
                             "(KV events carry vLLM's sha256_cbor block hashes; sha256 is accepted as the same)")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format: one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.max_num_partial_prefills is not None and not 1 <= self.max_num_partial_prefills <= self.max_num_seqs:
            raise ValueError(f"--max-num-partial-prefills must be in [1, --max-num-seqs {self.max_num_seqs}], "
                             f"got {self.max_num_partial_prefills}")
        if not 0.0 <= self.shutdown_timeout <= 3600.0:
            raise ValueError(f"shutdown_timeout must be in [0, 3600] seconds, got {self.shutdown_timeout}")

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy", "gguf")  # gguf: a .gguf model's blocks kept quantized
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other spellings
MAX_JSON_FLAG_CHARS = 65536  # --hf-overrides, --override-generation-config


def dtype_name(text: str) -> str:
    return DTYPE_ALIASES.get(text.strip().lower(), text.strip().lower())


def json_object(text: str) -> str:
    """A flag's JSON object, checked and normalised (a frozen config holds text, not a dict)."""
    if len(text) > MAX_JSON_FLAG_CHARS:
        raise argparse.ArgumentTypeError(f"at most {MAX_JSON_FLAG_CHARS} characters of JSON, got {len(text)}")
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object {{...}} expected, got {type(value).__name__}")
    return json.dumps(value, sort_keys=True)


DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # the issue's; EngineConfig's 0 stays for components that do not drain


def shutdown_timeout_default() -> str | float:
    """``--shutdown-timeout``'s default where it drains (serve, the frontend): the variable, else 30 s.
    Here, not in serve_args, so the frontend reads it without importing the CLI layer."""
    return env("SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT_S)


# The frontend's exit status when a port it must listen on is taken: ``serve`` then
# adds nothing to the frontend's one line (and restarts nothing).
EXIT_PORT_IN_USE = 3
# The frontend also reports its gRPC health under this name plus its run's token
# (PAGEDSERVE_RUN_TOKEN, set by serve): another server on the same port does not know it.
RUN_HEALTH_PREFIX = "pagedserve.run."


def bind_error(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (taken, or an address not ours), else None.
    SO_REUSEADDR as the servers set it: a closed socket's TIME_WAIT does not count.
    No SO_REUSEPORT: another such listener (gRPC's default) must count as taken."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return f"cannot resolve {host}: {e.strerror or e}"
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as e:
                return (e.strerror or str(e)).lower()
    return None


def step_trace() -> bool:
    """PAGEDSERVE_STEP_TRACE=1: the worker logs every step's batch, wall and CPU time."""
    return bool(env_flag("STEP_TRACE", False))


def worker_adaptive() -> bool:
    """PAGEDSERVE_WORKER_ADAPTIVE=0: the CPU worker keeps every pinned thread
    even while other processes keep its cores busy (gpuworker/cpu_contention.py)."""
    return bool(env_flag("WORKER_ADAPTIVE", True))


def worker_threads() -> int | None:
    """PAGEDSERVE_WORKER_THREADS: threads of the CPU worker (None: one per core).
    Read here for both users: gpuworker/cpu_affinity.py (before torch loads, to
    pin them) and the worker service (torch's thread count)."""
    return env_int("WORKER_THREADS", None)


def helptext(text: str, env_name: str | None) -> str:
    """Help that states the default and the environment variable."""
    tail = f"; env PAGEDSERVE_{env_name}" if env_name else ""
    return f"{text} (default: %(default)s{tail})"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()

    # env_name: a container's setting every component reads (docs/deployment.md's table); most flags have none
    def arg(*flags: str, default: Any, text: str, env_name: str | None = None, **kw: Any) -> None:
        target = kw.pop("group", p)
        # Flag actions get their default already read from the environment (env_flag).
        value = default if "action" in kw or env_name is None else env(env_name, default)
        target.add_argument(*flags, default=value, help=helptext(text, env_name), **kw)

    arg("--model", env_name="MODEL", default=None,
        text="local Hugging Face folder, a .gguf file, or a hub id org/name found in the local Hugging Face cache "
             "($HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub; never downloaded); "
             "none: the embedded SmolLM2-135M-Instruct")
    arg("--device", env_name="DEVICE", default="auto",
        text="auto (cuda when torch sees a GPU, else cpu; logged at start), cpu, cuda or cuda:N")
    arg("--dtype", default=d.dtype, choices=["auto", "float32", "float16", "bfloat16"],
        type=dtype_name, metavar="{auto,half,float16,bfloat16,float,float32}",
        text="weights and KV dtype (half: float16, float: float32); auto: bfloat16 on CUDA, float32 on CPU")
    arg("--kv-cache-dtype", default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
        text="KV cache dtype; auto: the weights' dtype; fp8 (e4m3, as vLLM) or fp8_e5m2: one byte an element, "
             "twice the blocks of a 16-bit pool in the same memory")
    arg("--load-format", default=d.load_format, choices=list(LOAD_FORMATS),
        text="weights: auto (safetensors, else pytorch .bin), safetensors, pt, or dummy (random values of "
             "the model's shapes, for profiling)")
    arg("--hf-overrides", default=None, type=json_object,
        text="JSON object of config.json fields to override when loading, e.g. '{\"max_position_embeddings\": 1024}'")
    arg("--trust-remote-code", default=False,
        action="store_true", text="let transformers run the model folder's own Python code for its config "
                                  "and tokenizer")
    arg("--tokenizer", default=None,
        text="tokenizer folder or cached hub id (chat template, prompts, structured outputs); none: the model's")
    arg("--tokenizer-mode", default=d.tokenizer_mode,
        choices=["auto", "hf", "slow", "mistral"],
        text="auto/hf: the fast tokenizer where there is one; slow: use_fast=False; mistral: refused")
    arg("--block-size", env_name="BLOCK_SIZE", default=d.block_size, type=int, choices=[8, 16, 32],
        text="tokens per KV block")
    mem = p.add_mutually_exclusive_group()
    arg("--num-gpu-blocks", "--num-gpu-blocks-override", dest="num_gpu_blocks", env_name="NUM_GPU_BLOCKS",
        default=None, type=int, group=mem, text="KV blocks in the pool, instead of sizing it from memory")
    arg("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory", env_name="KV_CACHE_MEMORY",
        default=None, type=parse_size, group=mem,
        text="bytes for the KV pool, e.g. 512MiB or 1073741824; none: --gpu-memory-utilization on CUDA, "
             "on CPU $VLLM_CPU_KVCACHE_SPACE GiB (vLLM's variable; it overrides this flag, as in vLLM), else 4 GiB")
    arg("--gpu-memory-utilization", default=d.gpu_memory_utilization,
        type=float, text="share of the GPU's total memory for this engine, as vLLM's: the KV pool gets it less "
                         "the weights, the profiled activation peak and memory outside torch")
    arg("--swap-space", default=d.swap_space, type=float, text="GiB of CPU swap space")
    arg("--max-num-seqs", env_name="MAX_NUM_SEQS", default=d.max_num_seqs, type=int,
        text="sequences in one batch at most")
    arg("--max-num-batched-tokens", default=d.max_num_batched_tokens,
        type=int, text="tokens in one step at most")
    arg("--enable-chunked-prefill", default=d.enable_chunked_prefill, action=argparse.BooleanOptionalAction,
        text="split a long prompt's prefill over steps of --max-num-batched-tokens; off: the step budget "
             "grows to the model's length and a prompt is prefilled whole")
    arg("--max-num-partial-prefills", default=None, type=int,
        text="prompts split over steps at once (vLLM V0's flag); any N >= 1 holds: at most one is split at a time")
    arg("--max-model-len", default=None, type=int,
        text="prompt plus output tokens at most; none: the model's own")
    arg("--enable-prefix-caching", default=d.enable_prefix_caching, action=argparse.BooleanOptionalAction,
        text="share the KV blocks of common prompt prefixes")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="same as --no-enable-prefix-caching")
    arg("--disable-hybrid-kv-cache-manager", default=d.disable_hybrid_kv_cache_manager, action="store_true",
        text="keep every block of sliding-window layers (one table per sequence for all layers) instead of "
             "freeing those outside the window")
    arg("--kv-watermark", default=d.kv_watermark, type=float,
        text="share of KV blocks kept free when admitting new requests")
    arg("--preemption-mode", default=d.preemption_mode,
        choices=["recompute", "swap", "auto"], text="how a preempted request gives back its blocks")
    arg("--async-scheduling", default=d.async_scheduling, nargs="?", const="on",
        choices=["auto", "on", "off"],
        text="plan the next step while the worker runs this one (the same tokens as without); "
             "auto: on with CUDA, off on CPU, where it would take cores from the worker")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_const", const="off",
                   help="same as --async-scheduling off")
    arg("--attention-backend", default=d.attention_backend,
        choices=["auto", "torch", "triton"], text="auto: triton on CUDA, torch on CPU")
    arg("--seed", default=d.seed, type=int, text="seed of the sampler's generators")
    arg("--structured-outputs-config", default=d.structured_outputs_config,
        type=parse_structured_outputs_config, metavar="JSON",
        text='vLLM\'s structured-output settings, e.g. \'{"disable_any_whitespace": true}\' (compact JSON '
             'outputs); backend auto or xgrammar')
    arg("--kv-events-config", env_name="KV_EVENTS_CONFIG", default=d.kv_events_config,
        type=parse_kv_events_config, metavar="JSON",
        text='vLLM\'s KV cache events, e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
             '"replay_endpoint": "tcp://*:5558"}\': the blockmgr publishes BlockStored/BlockRemoved/'
             'AllBlocksCleared batches as vLLM does (msgpack over ZeroMQ PUB); default endpoint loopback')
    arg("--prefix-caching-hash-algo", default=d.prefix_caching_hash_algo,
        text="vLLM's flag: KV events carry vLLM's sha256_cbor block hashes (seeded by $PYTHONHASHSEED, as "
             "vLLM's); sha256 is accepted as the same, xxhash refused")
    arg("--enforce-eager", default=False,
        action="store_true", text="never capture CUDA graphs")
    arg("--tensor-parallel-size", "-tp", default=d.tensor_parallel_size,
        type=int, text="GPUs one model is sharded over")
    # Not PAGEDSERVE_WORKER: that is the worker's address (default_addresses, compose).
    arg("--worker", env_name="WORKER_KIND", default=d.worker, choices=["model", "sim"],
        text="sim: a SIMULATED worker (no model; step times from a cost model)")
    arg("--shutdown-timeout", env_name="SHUTDOWN_TIMEOUT", default=d.shutdown_timeout, type=float,
        text="seconds SIGTERM waits for in-flight requests to finish before stopping")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None or k == "model"}
    values["device"] = resolve_device(values.get("device", "auto"))[0]
    space = cpu_kv_cache_space() if values["device"] == "cpu" and values.get("num_gpu_blocks") is None else None
    # vLLM's CPU platform: the variable sets kv_cache_memory_bytes
    return EngineConfig(**{**values, **({"kv_cache_memory": space} if space is not None else {})})


def add_address_args(p: argparse.ArgumentParser) -> None:
    d = default_addresses()
    p.add_argument("--scheduler-in", default=d.scheduler_in)
    p.add_argument("--scheduler-out", default=d.scheduler_out)
    p.add_argument("--blockmgr-addr", default=d.blockmgr)
    p.add_argument("--worker-addr", default=d.worker)
    p.add_argument("--insecure-internal-tcp", action=curve.AllowInsecureAction, nargs=0, default=False,
                   help="allow tcp:// internal sockets without CurveZMQ keys (any host that reaches the ports "
                        "can command the engine); env PAGEDSERVE_INSECURE_INTERNAL_TCP=1")


def addresses_from_args(args: argparse.Namespace) -> Addresses:
    return Addresses(args.scheduler_in, args.scheduler_out, args.blockmgr_addr, args.worker_addr)


# The addresses each component opens (the others may be set, e.g. by compose, and are not checked).
_OPENS = {"frontend": ("scheduler_in", "scheduler_out"), "blockmgr": ("blockmgr",), "gpuworker": ("worker",),
          "scheduler": ("scheduler_in", "scheduler_out", "blockmgr", "worker")}


def check_addresses(addrs: Addresses, role: str) -> None:
    """Right after argument parsing, before anything loads (issue 19): the
    addresses ``role`` opens parse, and tcp:// ones have usable CurveZMQ keys
    or the explicit opt-out. Raises curve.InsecureTransport (a BadInternalConfig
    for a malformed address or key file), which the CLI prints as one line."""
    curve.check_security(getattr(addrs, name) for name in _OPENS[role])


def engine_argv(cfg: EngineConfig) -> list[str]:
    """The command-line flags that rebuild ``cfg`` in a child process."""
    out: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        v = getattr(cfg, f.name)
        if f.name in ("max_prompt_chars", "max_stop_ids") or v is None:
            continue
        if f.name == "enable_prefix_caching":
            if not v:
                out.append("--no-prefix-caching")
            continue
        if f.name == "enable_chunked_prefill":
            if not v:
                out.append("--no-enable-chunked-prefill")
            continue
        if f.name in ("enforce_eager", "trust_remote_code", "disable_hybrid_kv_cache_manager"):
            if v:
                out.append("--" + f.name.replace("_", "-"))
            continue
        out += ["--" + f.name.replace("_", "-"), str(v)]
    return out
