"""Every flag of vLLM 0.32's ``vllm serve`` parser, answered by ``pagedserve serve``.

A flag ``serve_args.build_parser`` defines is honoured with vLLM's meaning. Every
other one is in ``IGNORED`` (accepted: one log line says it has no effect here)
or ``REFUSED`` (one stderr line naming it, exit 2, unless its value is harmless:
off, empty, or one listed after ``=``). tests/data/vllm_serve_flags.json is
vLLM's own list; tests/test_vllm_flags.py feeds each flag and checks this table,
the parser and the table in docs/api.md (``markdown_table``) agree.

A spec is the flag's option strings joined by ``|``, then its shape: ``!`` a
boolean with its ``--no-`` form, ``^`` a switch, ``+`` one or more values, ``?``
an optional value, ``*`` repeatable, none: one value."""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any

_CUDA = "CUDA graphs, torch.compile and kernel choice: this engine picks its own kernels (triton on CUDA, C++ on CPU)"
_DIST = "tensor-parallel ranks are the gpuworker's own processes on one machine"
_HTTP = "an HTTP-server (uvicorn/FastAPI) setting without a counterpart in this aiohttp server"
_LOAD = "weights are read from the local folder as this engine reads them; nothing is downloaded"
_MM = "text-only models are served here: nothing multimodal to act on"
_MAMBA = "no Mamba/SSM layers in the architectures served here"
_OBS = "a vLLM logging or profiling knob; this engine's metrics and logs are docs/observability.md's"
_SCHED = "a vLLM scheduler knob; this scheduler's are --max-num-seqs, --max-num-batched-tokens, --kv-watermark"
_DP = "one engine per serve; replicas: `pagedserve ray-serve --num-replicas N` or docs/deployment.md"

IGNORED: tuple[tuple[str, str], ...] = (
    ("one frontend process serves the API here", "--api-server-count|-asc --renderer-num-workers"),
    (_CUDA, "--compilation-config|-cc --optimization-level --cudagraph-capture-sizes+ --max-cudagraph-capture-size "
            "--enable-flashinfer-autotune! --moe-backend --linear-backend --sparse-indexer-topk-backend "
            "--kernel-config --ir-op-priority --attention-config|-ac --gdn-prefill-backend --kda-prefill-backend "
            "--kda-decode-backend --disable-cascade-attn! --performance-mode --use-fp64-gumbel! --enable-dbo! "
            "--dbo-decode-token-threshold --dbo-prefill-token-threshold --ubatch-size --enable-shm-tensor-arena! "
            "--jit-monitor-mode --jit-monitor-verbose! --disable-custom-all-reduce! --mm-encoder-attn-backend"),
    (_DIST, "--distributed-executor-backend --master-addr --master-port --distributed-timeout-seconds "
            "--cpu-distributed-timeout-seconds --worker-cls --ray-workers-use-nsight! --max-parallel-loading-workers "
            "--numa-bind! --numa-bind-nodes+ --numa-bind-cpus+ --enable-hc-sp! --disable-nccl-for-dp-synchronization! "
            "--dp-sync-interval --data-parallel-supervisor-port --dp-supervisor-probe-interval-s "
            "--dp-supervisor-probe-timeout-s --dp-supervisor-probe-failure-threshold"),
    ("components restart on their own here (docs/fault-tolerance.md)",
     "--enable-fault-tolerance! --fault-tolerance-config"),
    (_HTTP, "--disable-fastapi-docs! --enable-offline-docs! --h11-max-incomplete-event-size --h11-max-header-count "
            "--disable-uvicorn-access-log! --disable-access-log-for-endpoints --enable-ssl-refresh! "
            "--sse-keep-alive-interval --enable-server-load-tracking! --enable-per-request-metrics!"),
    ("request logging here is --enable-log-requests' one line per request",
     "--enable-log-outputs! --enable-log-deltas! --max-log-len --log-error-stack!"),
    (_LOAD, "--safetensors-load-strategy --safetensors-prefetch-num-threads --safetensors-prefetch-block-size "
            "--use-tqdm-on-load! --pt-load-map-location --model-loader-extra-config --ignore-patterns+ "
            "--config-format --hf-token? --code-revision --tokenizer-revision --model-impl "
            "--allow-deprecated-quantization!"),
    (_MM, "--limit-mm-per-prompt --enable-mm-embeds! --media-io-kwargs --mm-processor-kwargs --mm-processor-cache-gb "
          "--mm-processor-cache-type --mm-hasher-algorithm --mm-shm-cache-max-object-size-mb --mm-encoder-tp-mode "
          "--mm-encoder-only! --mm-encoder-attn-dtype --mm-encoder-fp8-scale-path --mm-encoder-fp8-scale-save-path "
          "--mm-encoder-fp8-scale-save-margin --interleave-mm-strings! --skip-mm-profiling! --video-pruning-rate "
          "--video-pruning-method --mm-tensor-ipc --mm-processor-device --mm-ipc-gpu-memory-gb "
          "--mm-device-do-normalize! --language-model-only! --allowed-local-media-path --allowed-media-domains+ "
          "--trust-request-mm-kwargs! --disable-chunked-mm-input! --ec-manager-config --enable-flash-late-interaction!"),
    (_MAMBA, "--mamba-backend --mamba-ssu-algorithm --mamba-cache-dtype --mamba-ssm-cache-dtype --mamba-block-size "
             "--mamba-cache-mode --enable-mamba-shared-prefix-checkpoint! --replayssm-buffer-len --use-replayssm! "
             "--enable-mamba-cache-stochastic-rounding! --mamba-cache-philox-rounds --prefix-match-unit"),
    (_OBS, "--show-hidden-metrics-for-version --kv-cache-metrics! --kv-cache-metrics-sample --cudagraph-metrics! "
           "--enable-mfu-metrics! --enable-logging-iteration-details! --custom-histogram-buckets "
           "--per-request-spec-decode-metrics --aggregate-engine-logging^ --logging-config --log-level "
           "--log-config-file --fail-on-environ-validation! --enable-trace-replay! --profiler-config "
           "--enable-layerwise-nvtx-tracing! --fingerprint-mode --fingerprint-value"),
    (_SCHED, "--max-num-scheduled-tokens --max-num-active-seqs --max-num-queued-reqs --max-num-queued-tokens "
             "--long-prefill-token-threshold --long-prefill-token-threshold-adaptive! --scheduler-reserve-full-isl! "
             "--watermark --prefill-schedule-interval --stream-interval --prefix-cache-retention-interval "
             "--kv-cache-dtype-skip-layers+ --kv-sharing-fast-prefill! --swa-bounded-replay! --return-sampling-mask! "
             "--aux-output-config --additional-config"),
    ("tool and reasoning options of vLLM's other APIs (Anthropic, Cohere) or of its strict-tool mode",
     "--exclude-tools-when-tool-choice-none! --tool-strict-level --cohere-is-reasoning-model! --cohere-format "
     "--anthropic-disabled-thinking-effort"),
)

REFUSED: tuple[tuple[str, str], ...] = (
    ("LoRA adapters are not supported", "--lora-modules+ --max-loras=1 --max-lora-rank=16 --lora-dtype=auto "
     "--enable-tower-connector-lora! --max-cpu-loras --fully-sharded-loras! --lora-target-modules+ --default-mm-loras "
     "--specialize-active-lora! --enable-mixed-moe-lora-format! --enable-moe-shared-loras! --max-lora-cls-labels"),
    ("speculative decoding is not supported",
     "--speculative-config|-sc --spec-method --spec-model --spec-tokens"),
    ("disaggregated prefill and KV/encoder-cache transfer or offloading are not supported",
     "--kv-transfer-config --ec-transfer-config --kv-offloading-size --kv-offloading-backend=native"),
    ("weight offloading to CPU memory is not supported", "--cpu-offload-gb=0 --cpu-offload-params+ "
     "--offload-backend=auto --offload-group-size=0 --offload-num-in-group=1 --offload-prefetch-step=1 --offload-params+"),
    ("sleep mode is not supported", "--enable-sleep-mode! --sleep-mode-offload-cudagraph! "
     "--sleep-preserve-parameter-names+ --enable-cumem-allocator! --enable-nccl-comm-suspend! --weight-transfer-config"),
    ("context parallelism is not supported", "--decode-context-parallel-size|-dcp=1 --dcp-comm-backend "
     "--dcp-q-replicate! --dcp-kv-cache-interleave-size=1 --cp-kv-cache-interleave-size "
     "--prefill-context-parallel-size|-pcp=1"),
    (_DP, "--headless^ --data-parallel-rank|-dpn --data-parallel-start-rank|-dpr --data-parallel-size-local|-dpl "
          "--data-parallel-address|-dpa --data-parallel-rpc-port|-dpp --data-parallel-backend|-dpb=mp "
          "--data-parallel-hybrid-lb|-dph! --data-parallel-external-lb|-dpe! --data-parallel-multi-port-external-lb|-dpm^ "
          "--nnodes|-n=1 --node-rank|-r=0 --enable-elastic-ep! --elastic-ep-max-dp-size"),
    ("expert parallelism is not supported (experts are sharded with --tensor-parallel-size)",
     "--enable-expert-parallel|-ep! --enable-batch-sharded-sampling! --enable-ep-weight-filter! "
     "--all2all-backend=allgather_reducescatter --enable-eplb! --eplb-config --expert-placement-strategy=linear"),
    ("vLLM's SMG gRPC protocol is not served; this server's gRPC API (pagedserve.v1) listens on --grpc-port",
     "--grpc^"),
    ("pooling, embedding and classification models are not served (generation only)", "--runner=auto,generate "
     "--convert=auto,none --pooler-config --io-processor-plugin"),
    ("plugins and custom Python classes are not loaded", "--tool-parser-plugin= --reasoning-parser-plugin= "
     "--logits-processors+ --model-class-overrides --scheduler-cls --worker-extension-cls= --middleware* "
     "--tool-server"),
    ("not supported here", "--skip-tokenizer-init! --enable-prompt-embeds! --tokens-only! --enable-scale-out! "
     "--enable-return-routed-experts! --enable-tokenizer-info-endpoint! --uds --hf-config-path --quantization-config "
     "--watermark-config --diffusion-config|-dc --engram-config --reasoning-config --device-ids "
     "--disable-sliding-window! --scheduling-policy=fcfs --logprobs-mode=raw_logprobs"),
    ("TLS client verification is not supported (server TLS: --ssl-certfile, --ssl-keyfile)",
     "--ssl-ca-certs --ssl-cert-reqs=0 --ssl-ciphers"),
    ("OpenTelemetry traces are not exported", "--otlp-traces-endpoint --collect-detailed-traces+"),
)
# vLLM spells these honoured flags' other forms too.
ALIASES = {"--device-memory-utilization": "--gpu-memory-utilization"}
NO_FORMS = ("--trust-request-chat-template", "--enable-auto-tool-choice", "--allow-credentials", "--trust-remote-code",
            "--enforce-eager", "--enable-lora", "--disable-hybrid-kv-cache-manager")
# vLLM 0.32's tool-call parsers (tests/data/vllm_serve_flags.json); those in tool_parsers.PARSERS work.
VLLM_TOOL_CALL_PARSERS = (
    "apertus cohere_command3 cohere_command4 deepseek_v3 deepseek_v31 deepseek_v32 deepseek_v4 deepseek_v41 dots "
    "ernie45 functiongemma gemma4 gigachat3 glm45 glm47 granite granite-20b-fc granite4 hermes hf hunyuan_a13b hy_v3 "
    "hy_v4 inkling internlm jamba k2_horizon kimi_k2 kimi_k3 lfm2 ling3 llama3_json llama4_json llama4_pythonic "
    "longcat mimo minicpm5 minimax_m2 minimax_m3 mistral muse_glimmer olmo3 openai phi4_mini_json plamo3 poolside_v1 "
    "pythonic qwen3_coder qwen3_json qwen3_xml seed_oss step3 step3p5 xlam").split()


@dataclass(frozen=True)
class Flag:
    options: tuple[str, ...]  # vLLM's option strings, the --no- form included
    shape: str  # "!" "^" "+" "?" "*" or "" (see the module's docstring)
    harmless: tuple[str, ...]  # values that are accepted without a word (REFUSED only)
    refused: bool
    reason: str

    @property
    def name(self) -> str:
        return self.options[0]

    @property
    def dest(self) -> str:
        return "vllm_" + self.name.lstrip("-").replace("-", "_")


def _parse(spec: str, reason: str, refused: bool) -> Flag:
    m = re.fullmatch(r"([^=!^+?*]+)(?:=([^!^+?*]*))?([!^+?*]?)", spec)
    assert m, spec
    opts, harmless, shape = m.group(1).split("|"), m.group(2), m.group(3)
    if shape == "!":
        opts.insert(1, "--no-" + opts[0][2:])
    return Flag(tuple(opts), shape, tuple(harmless.split(",")) if harmless is not None else (), refused, reason)


FLAGS: tuple[Flag, ...] = tuple(_parse(spec, reason, refused) for refused, table in ((False, IGNORED), (True, REFUSED))
                                for reason, specs in table for spec in specs.split())
_SHAPES: dict[str, dict[str, Any]] = {"!": {"action": argparse.BooleanOptionalAction}, "^": {"action": "store_true"},
                                      "+": {"nargs": "+"}, "?": {"nargs": "?", "const": ""}, "*": {"action": "append"},
                                      "": {}}


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """Adds the vLLM flags ``p`` does not define, and vLLM's other spellings of those it does."""
    known = p._option_string_actions
    for alias, flag in ALIASES.items():
        if alias not in known:
            a = known[flag]
            p.add_argument(alias, dest=a.dest, type=a.type, help=argparse.SUPPRESS)
    for flag in NO_FORMS:
        if flag in known and "--no-" + flag[2:] not in known:
            p.add_argument("--no-" + flag[2:], dest=known[flag].dest, action="store_false", help=argparse.SUPPRESS)
    g = p.add_argument_group("vLLM's other flags: accepted without effect (one log line), or refused (docs/api.md)")
    for f in FLAGS:
        if f.name in known:
            continue  # defined (honoured) by the parser itself
        opts = [o for o in f.options if not o.startswith("--no-")] if f.shape == "!" else list(f.options)
        word = "refused" if f.refused else "no effect"
        g.add_argument(*opts, dest=f.dest, default=None, help=f"{word}: {f.reason}", **_SHAPES[f.shape])


def _shown(f: Flag, value: Any) -> str:
    if f.shape == "!":
        return f.name if value else "--no-" + f.name[2:]
    if f.shape == "^":
        return f.name
    return f"{f.name} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def _harmless(f: Flag, value: Any) -> bool:
    if value is False or value == [] or value == "":
        return True
    if f.shape == "!" and value is False:
        return True
    return str(value) in f.harmless


def answer_vllm_flags(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """(the refusal, or None; the log lines of the flags accepted without effect)."""
    notes: list[str] = []
    for f in FLAGS:
        value = getattr(args, f.dest, None)
        if value is None:
            continue
        if f.refused and not _harmless(f, value):
            return f"{_shown(f, value)}: {f.reason}", notes
        notes.append(f"{_shown(f, value)}: accepted, without effect here: {f.reason}")
    return None, notes


# The test that shows each honoured flag at work (a file under tests/); the rest: tests/test_vllm_flags.py.
HONOURED_TESTS = {
    "test_serve_flags.py": "--chat-template --trust-request-chat-template --response-role --enable-auto-tool-choice "
                           "--tool-call-parser --uvicorn-log-level --allow-credentials --allowed-origins "
                           "--allowed-methods --allowed-headers --api-key --ssl-keyfile --ssl-certfile --root-path "
                           "--tokenizer --tokenizer-mode --trust-remote-code --revision --quantization --max-logprobs "
                           "--hf-overrides --generation-config --override-generation-config --load-format "
                           "--pipeline-parallel-size --data-parallel-size --kv-cache-dtype --prefix-caching-hash-algo "
                           "--enable-lora --enable-chunked-prefill --disable-log-stats --enable-log-requests",
    "test_serve_cli.py": "--served-model-name --kv-cache-memory-bytes --num-gpu-blocks-override "
                         "--enable-prefix-caching --async-scheduling --shutdown-timeout --port --grpc-port",
    "test_config.py": "--dtype --enforce-eager",
    "test_e2e.py": "--attention-backend",
    "test_refusal.py": "--tensor-parallel-size",
    "test_e2e_families.py": "--max-num-batched-tokens --model",
    "test_e2e_hybrid_kv.py": "--disable-hybrid-kv-cache-manager",
    "test_chaos.py": "--block-size --max-num-seqs",
    "test_drain.py": "--max-model-len",
    "test_kv_events.py": "--kv-events-config",
    "test_structured_vllm.py": "--structured-outputs-config",
    "test_frontend_sim.py": "--seed",
}
_TEST_OF = {flag: f"tests/{test}" for test, flags in HONOURED_TESTS.items() for flag in flags.split()}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown_table(vllm_flags: list[dict[str, Any]], parser: argparse.ArgumentParser) -> str:
    """docs/api.md's table: each of vLLM's flags (``vllm_flags``: tests/data/vllm_serve_flags.json's),
    what it does here, and the test that shows it."""
    ours = {f.name: f for f in FLAGS}
    rows = ["| vLLM flag | here | what it does here | test |", "|---|---|---|---|"]
    for v in vllm_flags:
        names = ", ".join(f"`{o}`" for o in v["options"] if not o.startswith("--no-"))
        a = parser._option_string_actions.get(v["options"][0])
        f = ours.get(v["options"][0])
        if a is not None and not a.dest.startswith("vllm_"):
            what = (a.help or "").split(" (default:")[0].replace("%%", "%")
            rows.append(f"| {names} | honoured | {_cell(what)} | {_TEST_OF.get(v['options'][0], 'tests/test_vllm_flags.py')} |")
        elif f is not None:
            ok = f" (accepted without effect when {' or '.join(f.harmless)})" if f.harmless and f.harmless != ("",) else ""
            verdict = "refused" if f.refused else "no effect"
            rows.append(f"| {names} | {verdict} | {_cell(f.reason + ok)} | tests/test_vllm_flags.py |")
        else:
            rows.append(f"| {names} | unknown | not in this table: an unrecognized argument | - |")
    return "\n".join(rows) + "\n"
