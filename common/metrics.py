"""Prometheus metrics for every component (prometheus-client).

Names follow vLLM's where the meaning matches, with our own ``pagedserve:``
prefix instead of ``vllm:`` (so ``vllm:num_requests_running`` is
``pagedserve:num_requests_running``); docs/api.md lists them. Each component
serves ``/metrics`` on ``--metrics-port`` (default off, or the
``PAGEDSERVE_<COMPONENT>_METRICS_PORT`` environment variable, so the launcher
can hand each child its own port); the frontend also serves it on the HTTP
gateway's port. Every component uses its own registry, plus the process
collector (CPU seconds, resident memory, open fds).
"""
from __future__ import annotations

import argparse
import enum
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from pagedserve.common.env import env, env_int

PREFIX = "pagedserve:"

# Buckets as vLLM 0.32's (vllm/v1/metrics/buckets.py); the first three in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# vLLM's finish reasons, each a request_success label from the start.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def add_metrics_arg(p: argparse.ArgumentParser, component: str) -> None:
    p.add_argument("--metrics-port", type=int, default=env_int(f"{component.upper()}_METRICS_PORT", None),
                   help=f"serve Prometheus /metrics of the {component} on this port (default: off)")
    p.add_argument("--metrics-host", default=env("METRICS_HOST", "127.0.0.1"))


def new_registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    reg.register(_Callback(_dropped_frames))
    return reg


def _dropped_frames() -> Iterator[Metric]:
    """Malformed internal-socket frames this process dropped (common/ipc.py)."""
    from pagedserve.common.ipc import dropped_frames

    m = CounterMetricFamily(PREFIX + "dropped_frames", "Malformed internal-socket frames dropped, by socket.",
                            labels=["socket"])
    for sock, n in sorted(dropped_frames().items()):
        m.add_metric([sock], n)
    yield m


def serve_metrics(port: int | None, registry: CollectorRegistry, host: str = "127.0.0.1") -> Any:
    """Start /metrics on a daemon thread; None (no port) does nothing."""
    if port is None:
        return None
    return start_http_server(port, addr=host, registry=registry)


class _Callback(Collector):
    def __init__(self, collect: Callable[[], Iterator[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        yield from self._collect()


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


def engine_stats_metrics(s: Any) -> Iterator[Metric]:
    """The scheduler's ``EngineStats`` as vLLM-named series."""
    yield _gauge("num_requests_running", "Requests in the running batch.", s.num_running)
    yield _gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
    yield _gauge("num_requests_swapped", "Requests swapped out to CPU memory.", s.num_swapped)
    yield from block_stats_metrics(s)
    yield _counter("num_preemptions", "Preemptions (recompute or swap) since start.", s.num_preemptions)
    yield _counter("num_steps", "Engine steps since start.", s.num_steps)
    yield _gauge("step_running_seconds", "How long the engine step now running has taken (0 between steps).",
                 s.step_running_s)
    yield _gauge("engine_degraded", "1 while a live engine is slow: a step has run past the degraded "
                 "threshold (it is waited for, up to --step-timeout).", float(s.step_running_s > DEGRADED_AFTER_S))


def block_stats_metrics(s: Any) -> Iterator[Metric]:
    """``s``: an EngineStats or a BlockStats (both name the same counts and kv_usage)."""
    usage = s.kv_usage
    yield _gauge("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", usage)
    yield _gauge("num_gpu_blocks", "KV blocks in the GPU pool.", s.num_gpu_blocks)
    yield _gauge("num_free_gpu_blocks", "Free KV blocks in the GPU pool.", s.num_free_gpu_blocks)
    yield _gauge("num_cpu_blocks", "KV blocks in the CPU swap pool.", s.num_cpu_blocks)
    yield _gauge("num_free_cpu_blocks", "Free KV blocks in the CPU swap pool.", s.num_free_cpu_blocks)
    yield _counter("prefix_cache_queries", "Prefix-cache lookups (blocks) since start.", s.prefix_cache_queries)
    yield _counter("prefix_cache_hits", "Prefix-cache hits (blocks) since start.", s.prefix_cache_hits)


# A step running longer than this is reported as degraded (health stays
# SERVING: the engine is live, only slow).
DEGRADED_AFTER_S = 5.0


@dataclass
class RequestTimes:
    """What one request's stream saw, for the per-request series at its end
    (monotonic seconds; ``arrival`` is when the frontend took the request)."""

    arrival: float
    queue_time_s: float | None = None  # arrival to first scheduled step (the scheduler's)
    num_cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_preemptions: int = 0
    tokens: dict[int, int] = field(default_factory=dict)  # output index -> tokens generated

    def on_tokens(self, t: float, index: int, n: int, replace: bool) -> bool:
        """Records ``n`` new tokens of output ``index``; True for the request's first."""
        first = self.first_token_at is None
        if first:
            self.first_token_at = t
        self.last_token_at = t
        self.tokens[index] = (0 if replace else self.tokens.get(index, 0)) + n
        return first


class TokenHistograms:
    """vLLM's per-request token-count histograms, whose buckets depend on the
    model's length (created once the engine says it)."""

    def __init__(self, reg: CollectorRegistry, max_model_len: int) -> None:
        b = request_tokens_buckets(max_model_len)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=b, registry=reg)

        self.prompt = hist("request_prompt_tokens", "Prompt length of finished requests.")
        self.generation = hist("request_generation_tokens", "Tokens a finished request generated (all its outputs).")
        self.max_generation = hist("request_max_num_generation_tokens",
                                   "Tokens of a finished request's longest output.")
        self.max_tokens = hist("request_params_max_tokens", "The max_tokens request parameter.")
        self.prefill_kv = hist("request_prefill_kv_computed_tokens",
                               "Prompt tokens a finished request computed (not found in the prefix cache).")

    def all(self) -> tuple[Histogram, ...]:
        return self.prompt, self.generation, self.max_generation, self.max_tokens, self.prefill_kv


class FrontendMetrics:
    """Request-level series measured where requests enter and leave, plus
    the engine's state from the scheduler's latest stats."""

    def __init__(self, stats: Callable[[], Any], in_flight: Callable[[], int]) -> None:
        self.registry = reg = new_registry()
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefill tokens processed.", registry=reg)
        self.prompt_tokens_cached = Counter(PREFIX + "prompt_tokens_cached",
                                            "Prompt tokens found in the prefix cache.", registry=reg)
        self.prompt_tokens_by_source = Counter(PREFIX + "prompt_tokens_by_source", "Prompt tokens by source.",
                                               ["source"], registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generation tokens produced.", registry=reg)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                       ["finished_reason"], registry=reg)
        for label, reasons in ((self.prompt_tokens_by_source, PROMPT_SOURCES),
                               (self.request_success, FINISH_REASONS)):
            for r in reasons:
                label.labels(r)  # each at 0 from the start, as vLLM's
        self.request_rejected = Counter(PREFIX + "request_rejected", "Requests refused before reaching the engine.",
                                        ["reason"], registry=reg)

        def hist(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=tuple(buckets), registry=reg)

        self.iteration_tokens = hist("iteration_tokens_total", "Tokens per engine step: prompt tokens computed "
                                     "for the requests it gave a first token, plus the tokens it generated.",
                                     ITERATION_TOKENS_BUCKETS)
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between two tokens of an output.", ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Decode time of a finished request per token after the first (its longest output).",
                         ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.", LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled step "
                               "(reported by the scheduler on a request's first output).", LATENCY_BUCKETS)
        self.inference_time = hist("request_inference_time_seconds",
                                   "First scheduled step to last token (prefill + decode).", LATENCY_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "First scheduled step to first token.",
                                 LATENCY_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS)
        self.num_preemptions = hist("request_num_preemptions", "Times a finished request was preempted.",
                                    PREEMPTIONS_BUCKETS)
        self.params_n = hist("request_params_n", "The n request parameter.", PARAMS_N_BUCKETS)
        self._tokens: TokenHistograms | None = None
        self._tokens_lock = threading.Lock()  # created from the loop or a --metrics-port scrape thread
        Gauge(PREFIX + "num_requests_in_flight", "Streams open in the frontend.",
              registry=reg).set_function(in_flight)

        def engine() -> Iterator[Metric]:
            s = stats()
            if s is not None:
                yield from engine_stats_metrics(s)

        reg.register(_Callback(engine))

    def token_histograms(self, max_model_len: int) -> TokenHistograms:
        with self._tokens_lock:
            if self._tokens is None:
                self._tokens = TokenHistograms(self.registry, max_model_len)
            return self._tokens

    def request_series(self) -> list[Counter | Histogram]:
        """The series vLLM has under the same base name (frontend/core/vllm_metrics.py renames them)."""
        out: list[Counter | Histogram] = [
            self.prompt_tokens, self.prompt_tokens_cached, self.prompt_tokens_by_source, self.generation_tokens,
            self.request_success, self.iteration_tokens, self.ttft, self.itl, self.tpot, self.e2e, self.queue_time,
            self.inference_time, self.prefill_time, self.decode_time, self.num_preemptions, self.params_n]
        if self._tokens is not None:
            out += self._tokens.all()
        return out

    def observe_step(self, deltas: Iterable[Any]) -> None:
        """One scheduler Outputs batch (one engine step), counted as vLLM counts
        an iteration: the prompt tokens computed for the requests whose first
        delta it holds, plus every token generated. A finished beam comes
        whole (``replace``): its steps are not seen here, so it is left out."""
        n = 0
        for d in deltas:
            if d.replace:
                continue
            n += len(d.token_ids)
            if d.queue_time_s is not None:
                n += d.num_prompt_tokens - d.num_cached_tokens
        if n:
            self.iteration_tokens.observe(n)

    def first_token(self, r: RequestTimes, prompt_len: int) -> None:
        assert r.first_token_at is not None
        self.ttft.observe(r.first_token_at - r.arrival)
        cached = min(r.num_cached_tokens, prompt_len)
        self.prompt_tokens.inc(prompt_len)
        self.prompt_tokens_cached.inc(cached)
        self.prompt_tokens_by_source.labels("local_compute").inc(prompt_len - cached)
        self.prompt_tokens_by_source.labels("local_cache_hit").inc(cached)

    def finished(self, r: RequestTimes, now: float, prompt_len: int, n: int, max_tokens: int, reason: str,
                 max_model_len: int) -> None:
        """A request whose every output ended; times as vLLM's (stats.py):
        prefill = first token - first scheduled, decode = last - first token.
        vLLM 0.32 runs an n > 1 request as n child requests and records each child
        as a finished request (request_success and the per-request histograms: n
        observations), but ``request_params_n`` and ``request_max_num_generation_tokens``
        once per parent (ParentRequest.observe_finished_request); so here."""
        outputs = [r.tokens.get(i, 0) for i in range(max(n, 1))]
        # A str enum's str() is its name ("FinishReason.LENGTH"): the label is its value.
        self.request_success.labels(reason.value if isinstance(reason, enum.Enum) else reason).inc(len(outputs))
        self.params_n.observe(n)
        tok = self.token_histograms(max_model_len)
        tok.max_generation.observe(max(outputs))
        # Every histogram counts every finished request: one that got no token has 0 s of each.
        scheduled = r.arrival + (r.queue_time_s or 0.0)
        first = scheduled if r.first_token_at is None else r.first_token_at
        prefill = max(0.0, first - scheduled)
        decode = 0.0 if r.last_token_at is None else r.last_token_at - first
        for generated in outputs:  # the outputs advance together: the request's times are each one's
            self.e2e.observe(now - r.arrival)
            self.queue_time.observe(r.queue_time_s or 0.0)  # at the end, as vLLM: finished requests only
            self.num_preemptions.observe(r.num_preemptions)
            tok.prompt.observe(prompt_len)
            tok.generation.observe(generated)
            tok.max_tokens.observe(max_tokens)
            tok.prefill_kv.observe(prompt_len - min(r.num_cached_tokens, prompt_len))
            self.prefill_time.observe(prefill)
            self.decode_time.observe(decode)
            self.inference_time.observe(prefill + decode)
            self.tpot.observe(decode / (generated - 1) if generated > 1 else 0.0)


def serve_scheduler_metrics(port: int | None, counts: Callable[[], Any], host: str = "127.0.0.1") -> Any:
    """The scheduler's own counts: ``counts()`` returns the immutable snapshot
    the step loop published last (EngineCore.counts), never live state."""
    if port is None:
        return None
    reg = new_registry()

    def collect() -> Iterator[Metric]:
        c = counts()
        yield _gauge("num_requests_running", "Requests in the running batch.", c.num_running)
        yield _gauge("num_requests_waiting", "Requests waiting to be scheduled.", c.num_waiting)
        yield _gauge("num_requests_swapped", "Requests swapped out to CPU memory.", c.num_swapped)
        yield _counter("num_preemptions", "Preemptions (recompute or swap) since start.", c.num_preemptions)
        yield _counter("num_steps", "Engine steps since start.", c.num_steps)
        if c.block_stats is not None:
            yield from block_stats_metrics(c.block_stats)

    reg.register(_Callback(collect))
    return serve_metrics(port, reg, host)


def serve_blockmgr_metrics(port: int | None, manager: Callable[[], Any], host: str = "127.0.0.1") -> Any:
    """The block pools, read at scrape time from ``manager()`` (None before InitRequest)."""
    if port is None:
        return None
    reg = new_registry()

    def collect() -> Iterator[Metric]:
        mgr = manager()
        if mgr is not None:
            yield from block_stats_metrics(mgr.stats())

    reg.register(_Callback(collect))
    return serve_metrics(port, reg, host)


def serve_worker_metrics(port: int | None, runner: Any, host: str = "127.0.0.1") -> Any:
    """Process metrics of the worker, plus its cumulative counters when it keeps them."""
    if port is None:
        return None
    reg = new_registry()

    def collect() -> Iterator[Metric]:
        computed = getattr(runner, "tokens_computed", None)
        if computed is not None:
            yield _counter("worker_tokens_computed", "Tokens the worker ran through the model.", computed)

    reg.register(_Callback(collect))
    return serve_metrics(port, reg, host)
