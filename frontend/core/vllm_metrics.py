"""vLLM's own metric families (``vllm:*``) on the frontend's registry, with
vLLM 0.32's names, types, buckets and labels (``model_name``: the served name,
as /v1/models reports it; ``engine``: "0"), so routers and dashboards written
for vLLM (the Gateway API Inference Extension, llm-d) read pagedserve unchanged.

The engine gauges are read when scraped: ``refresh()`` asks the scheduler for
its current stats (one round trip, well under a millisecond on ipc://) before
the registry is rendered, instead of showing the watchdog's last answer,
which may be ``--health-interval`` seconds old. The request-level series are
the frontend's ``pagedserve:*`` counters and histograms, renamed at scrape
time: nothing extra runs per token. ``ABSENT`` lists vLLM's families that have
no meaning here, and why (docs/api.md shows the same list).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, Summary
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.common.config import EngineConfig
from pagedserve.common.metrics import PREFIX, FrontendMetrics
from pagedserve.frontend.core.engine_client import EngineClient, EngineUnavailable

log = logging.getLogger("pagedserve.frontend")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

VLLM = "vllm:"
REFRESH_TIMEOUT_S = 1.0
ENGINE_INDEX = "0"  # one engine (scheduler) behind this frontend
# The engine counters' `_created` sample, as prometheus_client's own counters (and vLLM's) carry one.
_COUNTERS_CREATED = time.time()
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")  # vLLM's CacheHitSource
# Our admission refusal (generation.py's reason) under vLLM's admission_rejections reasons.
ADMISSION_REASONS = {"max_num_queued_reqs": "queue_full", "max_num_queued_tokens": None}

_CONNECTOR = "needs a KV connector (cross-instance KV transfer or offloading), which pagedserve does not have"
_SPEC = "speculative decoding, which pagedserve does not do"
# vLLM 0.32 registers these by default and they stay 0 for what is served here, so they are
# exported at 0: the KV connector's prefix cache (no connector), the multi-modal cache (text
# models only), and the MFU estimates (counted only with --enable-mfu-metrics, off by default;
# pagedserve has no FLOP cost model, so they stay 0 even with it).
ZERO_COUNTERS: dict[str, str] = {
    "external_prefix_cache_queries": "External prefix cache queries from KV connector cross-instance cache "
                                     "sharing, in terms of number of queried tokens.",
    "external_prefix_cache_hits": "External prefix cache hits from KV connector cross-instance cache sharing, "
                                  "in terms of number of cached tokens.",
    "mm_cache_queries": "Multi-modal cache queries, in terms of number of queried items.",
    "mm_cache_hits": "Multi-modal cache hits, in terms of number of cached items.",
    "estimated_flops_per_gpu": "Estimated number of floating point operations per GPU (for Model Flops "
                               "Utilization calculations).",
    "estimated_read_bytes_per_gpu": "Estimated number of bytes read from memory per GPU (for Model Flops "
                                    "Utilization calculations).",
    "estimated_write_bytes_per_gpu": "Estimated number of bytes written to memory per GPU (for Model Flops "
                                     "Utilization calculations).",
}
ABSENT: dict[str, str] = {
    "vllm:num_requests_kv_fetch_by_stage": _CONNECTOR,
    "vllm:spec_decode_num_drafts": _SPEC,
    "vllm:spec_decode_num_draft_tokens": _SPEC,
    "vllm:spec_decode_num_accepted_tokens": _SPEC,
    "vllm:spec_decode_num_accepted_tokens_per_pos": _SPEC,
    "vllm:diffusion_num_denoising_steps": "diffusion language models, which pagedserve does not serve",
    "vllm:diffusion_num_canvas_positions": "diffusion language models, which pagedserve does not serve",
    "vllm:diffusion_num_committed_tokens": "diffusion language models, which pagedserve does not serve",
    "vllm:corrupted_requests": "only with VLLM_COMPUTE_NANS_IN_LOGITS; pagedserve does not scan logits for NaNs",
    "vllm:watermark_requests": "output watermarking, which pagedserve does not do",
    "vllm:kv_block_lifetime_seconds": "opt-in in vLLM (--kv-cache-metrics); the blockmgr does not time its blocks",
    "vllm:kv_block_idle_before_evict_seconds": "as kv_block_lifetime_seconds",
    "vllm:kv_block_reuse_gap_seconds": "as kv_block_lifetime_seconds",
}


class VllmCollector(Collector):
    def __init__(self, metrics: FrontendMetrics, engine: EngineClient, cfg: EngineConfig,
                 served: list[str] | None) -> None:
        self._metrics = metrics
        self._engine = engine
        self._cfg = cfg
        self._served = served
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    def model_name(self) -> str | None:
        """The name /v1/models reports (http_gateway.Gateway.model_name: the
        first --served-model-name, else the engine's); None before the engine
        says it."""
        if self._served:
            return self._served[0]
        info = self._engine.info
        return None if info is None else info.model.model_name

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

    def collect(self) -> Iterator[Metric]:
        if threading.get_ident() != self._loop_thread:
            self._refresh_from_thread()
        name = self.model_name()
        if name is None:
            return
        labels = {"model_name": name, "engine": ENGINE_INDEX}
        yield from _EngineSeries(labels, self._engine, self._cfg, self._metrics).collect()
        yield from self._renamed(labels)

    def _renamed(self, labels: dict[str, str]) -> Iterator[Metric]:
        info = self._engine.info
        if info is not None:  # the token-count buckets go up to the model's length
            self._metrics.token_histograms(info.model.max_model_len)
        for series in self._metrics.request_series():
            for fam in series.collect():
                out = Metric(VLLM + fam.name.removeprefix(PREFIX), fam.documentation, fam.type)
                for smp in fam.samples:
                    out.add_sample(VLLM + smp.name.removeprefix(PREFIX), {**labels, **smp.labels},
                                   smp.value, smp.timestamp, smp.exemplar)
                yield out


class _EngineSeries:
    """The series read from the scheduler's stats and the engine's info, for one scrape."""

    def __init__(self, labels: dict[str, str], engine: EngineClient, cfg: EngineConfig,
                 metrics: FrontendMetrics) -> None:
        self._labels = labels
        self._engine = engine
        self._cfg = cfg
        self._metrics = metrics

    def _gauge(self, name: str, doc: str, values: dict[str, float], label: str | None = None,
               **extra: str) -> GaugeMetricFamily:
        """One sample per entry of ``values`` (keyed by ``label``'s value; "" without one)."""
        names = [*self._labels, *extra, *([label] if label else [])]
        g = GaugeMetricFamily(VLLM + name, doc, labels=names)
        for key, v in values.items():
            g.add_metric([*self._labels.values(), *extra.values(), *([key] if label else [])], v)
        return g

    def _counter(self, name: str, doc: str, values: dict[str, float], label: str | None = None) -> Metric:
        c = CounterMetricFamily(VLLM + name, doc, labels=[*self._labels, *([label] if label else [])])
        for key, v in values.items():
            c.add_metric([*self._labels.values(), *([key] if label else [])], v, created=_COUNTERS_CREATED)
        return c

    def collect(self) -> Iterator[Metric]:
        info, s = self._engine.info, self._engine.last_stats
        if info is None:
            return
        bs, cfg = info.block_size, self._cfg
        # Usable blocks, as pagedserve:num_gpu_blocks, ServerInfo and kv_cache_usage_perc count them
        # (vLLM's label also counts its reserved null block; num_gpu_blocks_override shows the flag).
        yield self._gauge("cache_config_info", "Information of the LLMEngine CacheConfig", {"": 1.0},
                          block_size=str(bs), cache_dtype=cfg.dtype,
                          enable_prefix_caching=str(cfg.enable_prefix_caching),
                          gpu_memory_utilization=str(cfg.gpu_memory_utilization),
                          num_gpu_blocks=str(info.num_usable_gpu_blocks), num_cpu_blocks=str(info.num_cpu_blocks),
                          num_gpu_blocks_override=str(cfg.num_gpu_blocks), swap_space=str(cfg.swap_space))
        # No LoRA support: the adapters are always none (routers read the labels).
        yield self._gauge("lora_requests_info", "Running stats on lora requests.", {"": time.time()},
                          running_lora_adapters="", waiting_lora_adapters="", max_lora="0")
        yield self._gauge("engine_sleep_state", "Engine sleep state; pagedserve has no sleep mode: always awake.",
                          {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}, "sleep_state")
        rejected = {smp.labels["reason"]: smp.value for fam in self._metrics.request_rejected.collect()
                    for smp in fam.samples if smp.name.endswith("_total")}
        yield self._counter("admission_rejections", "Number of admission attempts rejected by a queue limit, "
                            "by reason.", {r: rejected.get(ours, 0.0) if ours else 0.0
                                           for r, ours in ADMISSION_REASONS.items()}, "reason")
        if s is None:
            return
        usage = s.kv_usage
        yield self._gauge("num_requests_running", "Number of requests in model execution batches.",
                          {"": s.num_running})
        yield self._gauge("num_requests_waiting", "Number of requests waiting to be processed.", {"": s.num_waiting})
        yield self._gauge("num_requests_waiting_by_reason", "Number of waiting requests by reason: 'capacity' = "
                          "waiting for scheduling capacity; 'deferred' = waiting for its grammar to compile.",
                          {"capacity": s.num_waiting - s.num_waiting_deferred, "deferred": s.num_waiting_deferred},
                          "reason")
        yield self._gauge("num_requests_swapped", "Number of requests swapped to CPU.", {"": s.num_swapped})
        yield self._gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", {"": usage})
        yield self._gauge("gpu_cache_usage_perc", "GPU KV-cache usage (vLLM's earlier name).", {"": usage})
        yield self._counter("num_preemptions", "Cumulative number of preemption from the engine.",
                            {"": s.num_preemptions})
        # vLLM counts tokens; the block manager counts full blocks of block_size tokens.
        hits = s.prefix_cache_hits * bs
        yield self._counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                            {"": s.prefix_cache_queries * bs})
        yield self._counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            {"": hits})
        for name, doc in ZERO_COUNTERS.items():
            yield self._counter(name, doc, {"": 0.0})
        yield self._counter("prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache tier that "
                            "supplied them (here always the device's pool).",
                            {src: hits if src == "device" else 0.0 for src in CACHE_HIT_SOURCES}, "source")


def add_vllm_metrics(metrics: FrontendMetrics, engine: EngineClient, cfg: EngineConfig,
                     served: list[str] | None) -> VllmCollector:
    """Registers the ``vllm:*`` series on ``metrics.registry`` and counts each
    engine step's outputs (vllm:iteration_tokens_total); call inside the event loop.
    ``served``: the --served-model-name list (None: the engine's model name)."""
    collector = VllmCollector(metrics, engine, cfg, served)
    registry: CollectorRegistry = metrics.registry
    registry.register(collector)
    engine.on_outputs = metrics.observe_step
    return collector


# ------------------------------------------------------------------ HTTP families
# vLLM 0.32 instruments its FastAPI app with prometheus-fastapi-instrumentator's defaults
# (serve/instrumentator/metrics.py): these five families, unprefixed, status grouped as
# "2xx", handler the route's template ("none" when no route matched), and its excluded routes.
HTTP_EXCLUDED = frozenset({"/metrics", "/health", "/load", "/ping", "/version", "/server_info"})
HTTP_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5,
                      10, 30, 60)
HTTP_LOWR_BUCKETS = (0.1, 0.5, 1)
_HTTP: dict[int, "HttpMetrics"] = {}  # one set per registry (an app may be built twice on one)


class HttpMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.total = Counter("http_requests_total", "Total number of requests by method, status and handler.",
                             ["method", "status", "handler"], registry=registry)
        self.in_size = Summary("http_request_size_bytes", "Content length of incoming requests by handler. "
                               "Only value of header is respected. Otherwise ignored. No percentile calculated. ",
                               ["handler"], registry=registry)
        self.out_size = Summary("http_response_size_bytes", "Content length of outgoing responses by handler. "
                                "Only value of header is respected. Otherwise ignored. No percentile calculated. ",
                                ["handler"], registry=registry)
        self.highr = Histogram("http_request_duration_highr_seconds", "Latency with many buckets but no API "
                               "specific labels. Made for more accurate percentile calculations. ",
                               buckets=HTTP_HIGHR_BUCKETS, registry=registry)
        self.lowr = Histogram("http_request_duration_seconds", "Latency with only few buckets by handler. Made "
                              "to be only used if aggregation by handler is important. ",
                              ["method", "handler"], buckets=HTTP_LOWR_BUCKETS, registry=registry)

    @classmethod
    def on(cls, registry: CollectorRegistry) -> "HttpMetrics":
        if id(registry) not in _HTTP:
            _HTTP[id(registry)] = cls(registry)
        return _HTTP[id(registry)]

    @staticmethod
    def handler_of(request: web.Request) -> str:
        route = request.match_info.route
        resource = getattr(route, "resource", None)
        if resource is None or isinstance(request.match_info.http_exception, web.HTTPNotFound):
            return "none"
        return resource.canonical

    def observe(self, request: web.Request, status: int, out_bytes: int, seconds: float) -> None:
        handler = self.handler_of(request)
        if handler in HTTP_EXCLUDED:
            return
        self.total.labels(request.method, f"{str(status)[0]}xx", handler).inc()
        self.in_size.labels(handler).observe(int(request.headers.get("Content-Length", 0) or 0))
        self.out_size.labels(handler).observe(out_bytes)
        self.highr.observe(seconds)
        self.lowr.labels(request.method, handler).observe(seconds)

    @web.middleware
    async def middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        t0 = time.perf_counter()
        status, size = 500, 0
        try:
            resp = await handler(request)
            # The instrumentator reads the Content-Length header: a stream has none (0).
            status, size = resp.status, (resp.content_length or 0) if isinstance(resp, web.Response) else 0
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            self.observe(request, status, size, time.perf_counter() - t0)
