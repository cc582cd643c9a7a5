"""vLLM's own metric names (``vllm:*``, each with a ``model_name`` label) on
the frontend's registry, so routers written for vLLM (the Gateway API
Inference Extension, llm-d) read pagedserve unchanged.

The engine gauges are read when scraped: ``refresh()`` asks the scheduler for
its current stats (one round trip, well under a millisecond on ipc://) before
the registry is rendered, instead of showing the watchdog's last answer,
which may be ``--health-interval`` seconds old. The request-level series are
the frontend's ``pagedserve:*`` counters and histograms, renamed at scrape
time: nothing extra runs per token.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.common.config import EngineConfig
from pagedserve.common.metrics import PREFIX, FrontendMetrics
from pagedserve.frontend.engine_client import EngineClient, EngineUnavailable

log = logging.getLogger("pagedserve.frontend")

VLLM = "vllm:"
REFRESH_TIMEOUT_S = 1.0
# FrontendMetrics attributes whose series vLLM has under the same base name.
_RENAMED = ("prompt_tokens", "generation_tokens", "request_success", "ttft", "itl", "e2e", "queue_time",
            "prompt_len")


class VllmCollector(Collector):
    def __init__(self, metrics: FrontendMetrics, engine: EngineClient, cfg: EngineConfig, model_name: str) -> None:
        self._metrics = metrics
        self._engine = engine
        self._cfg = cfg
        self._labels = {"model_name": model_name}
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    async def refresh(self) -> None:
        """Fresh engine stats (kept in ``engine.last_stats``); on no answer the last ones stay."""
        if not self._engine.healthy:
            return
        try:
            await self._engine.stats(REFRESH_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineUnavailable):
            log.warning("metrics: the scheduler did not answer a stats query; showing the last stats")

    def _refresh_from_thread(self) -> None:
        # The --metrics-port server scrapes on its own thread: ask through the loop.
        fut = asyncio.run_coroutine_threadsafe(self.refresh(), self._loop)
        try:
            fut.result(REFRESH_TIMEOUT_S + 0.5)
        except Exception:  # noqa: BLE001 - a scrape never fails because of a slow engine
            fut.cancel()

    def _gauge(self, name: str, doc: str, value: float, **labels: str) -> GaugeMetricFamily:
        g = GaugeMetricFamily(VLLM + name, doc, labels=[*self._labels, *labels])
        g.add_metric([*self._labels.values(), *labels.values()], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(VLLM + name, doc, labels=list(self._labels))
        c.add_metric(list(self._labels.values()), value)
        return c

    def collect(self) -> Iterator[Metric]:
        if threading.get_ident() != self._loop_thread:
            self._refresh_from_thread()
        yield from self._engine_series()
        yield from self._renamed()

    def _engine_series(self) -> Iterator[Metric]:
        info, s = self._engine.info, self._engine.last_stats
        if info is None:
            return
        bs = info.block_size
        yield self._gauge("cache_config_info", "Information of the KV cache configuration.", 1.0,
                          block_size=str(bs), cache_dtype=self._cfg.dtype,
                          enable_prefix_caching=str(self._cfg.enable_prefix_caching),
                          gpu_memory_utilization=str(self._cfg.gpu_memory_utilization),
                          num_gpu_blocks=str(info.num_gpu_blocks), num_cpu_blocks=str(info.num_cpu_blocks),
                          swap_space=str(self._cfg.swap_space))
        # No LoRA support: the adapters are always none (routers read the labels).
        yield self._gauge("lora_requests_info", "Running stats on LoRA requests.", time.time(),
                          running_lora_adapters="", waiting_lora_adapters="", max_lora="0")
        if s is None:
            return
        usage = s.kv_usage
        yield self._gauge("num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield self._gauge("num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield self._gauge("num_requests_swapped", "Number of requests swapped to CPU.", s.num_swapped)
        yield self._gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield self._gauge("gpu_cache_usage_perc", "GPU KV-cache usage (vLLM's earlier name).", usage)
        yield self._counter("num_preemptions", "Cumulative number of preemptions.", s.num_preemptions)
        # vLLM counts tokens; the block manager counts full blocks of block_size tokens.
        yield self._counter("prefix_cache_queries", "Prefix cache queries, in tokens.", s.prefix_cache_queries * bs)
        yield self._counter("prefix_cache_hits", "Prefix cache hits, in tokens.", s.prefix_cache_hits * bs)

    def _renamed(self) -> Iterator[Metric]:
        for attr in _RENAMED:
            for fam in getattr(self._metrics, attr).collect():
                out = Metric(VLLM + fam.name.removeprefix(PREFIX), fam.documentation, fam.type)
                for smp in fam.samples:
                    out.add_sample(VLLM + smp.name.removeprefix(PREFIX), {**self._labels, **smp.labels},
                                   smp.value, smp.timestamp, smp.exemplar)
                yield out


def add_vllm_metrics(metrics: FrontendMetrics, engine: EngineClient, cfg: EngineConfig,
                     model_name: str) -> VllmCollector:
    """Registers the ``vllm:*`` series on ``metrics.registry``; call inside the event loop."""
    collector = VllmCollector(metrics, engine, cfg, model_name)
    registry: CollectorRegistry = metrics.registry
    registry.register(collector)
    return collector
