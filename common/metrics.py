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
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from pagedserve.common.env import env, env_int

PREFIX = "pagedserve:"

# Buckets as vLLM's (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


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


class FrontendMetrics:
    """Request-level series measured where requests enter and leave, plus
    the engine's state from the scheduler's latest stats."""

    def __init__(self, stats: Callable[[], Any], in_flight: Callable[[], int]) -> None:
        self.registry = reg = new_registry()
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefill tokens processed.", registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generation tokens produced.", registry=reg)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                       ["finished_reason"], registry=reg)
        self.request_rejected = Counter(PREFIX + "request_rejected", "Requests refused before reaching the engine.",
                                        ["reason"], registry=reg)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two tokens of an output.",
                             buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to first scheduled step "
                                    "(reported by the scheduler on a request's first output).",
                                    buckets=LATENCY_BUCKETS, registry=reg)
        self.prompt_len = Histogram(PREFIX + "request_prompt_tokens", "Prompt length of finished requests.",
                                    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000), registry=reg)
        Gauge(PREFIX + "num_requests_in_flight", "Streams open in the frontend.",
              registry=reg).set_function(in_flight)

        def engine() -> Iterator[Metric]:
            s = stats()
            if s is not None:
                yield from engine_stats_metrics(s)

        reg.register(_Callback(engine))


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
