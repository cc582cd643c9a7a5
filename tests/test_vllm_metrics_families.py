"""Issue 20, acceptance 4: vLLM's metric families on /metrics after a mixed
load (completions, chat, streaming, n > 1, preemptions in a tiny KV pool,
prefix-cache hits, a request aborted mid-stream) on the real four processes
(SIMULATED worker for speed). Every family we export has vLLM's name and
type and the ``engine`` and ``model_name`` labels (model_name = the id
/v1/models reports); the values agree with the load; cache_config_info's
num_gpu_blocks is pagedserve:num_gpu_blocks. With the peer venv, every family
vLLM 0.32's PrometheusStatLogger registers is either exported here (same
type) or in the documented absent list."""
from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e_util import Server, serve, wait_all_free
from models import make_tiny_model
from pagedserve.frontend.core.vllm_metrics import ABSENT, ZERO_COUNTERS

ROOT = Path(__file__).resolve().parent.parent
PEER_PY = ROOT / ".venv-peers" / "bin" / "python"
SERVED = "tiny-llama"
G, C, H = "gauge", "counter", "histogram"
# What we export under vLLM's names (the last two are vLLM's earlier names, kept for older routers).
FAMILIES = {
    "vllm:cache_config_info": G, "vllm:lora_requests_info": G, "vllm:engine_sleep_state": G,
    "vllm:num_requests_running": G, "vllm:num_requests_waiting": G, "vllm:num_requests_waiting_by_reason": G,
    "vllm:kv_cache_usage_perc": G, "vllm:num_preemptions": C, "vllm:prefix_cache_queries": C,
    "vllm:prefix_cache_hits": C, "vllm:prompt_tokens_cached_by_source": C, "vllm:admission_rejections": C,
    "vllm:prompt_tokens": C, "vllm:prompt_tokens_by_source": C, "vllm:prompt_tokens_cached": C,
    "vllm:generation_tokens": C, "vllm:request_success": C,
    "vllm:request_prompt_tokens": H, "vllm:request_generation_tokens": H, "vllm:iteration_tokens_total": H,
    "vllm:request_max_num_generation_tokens": H, "vllm:request_params_n": H, "vllm:request_params_max_tokens": H,
    "vllm:time_to_first_token_seconds": H, "vllm:inter_token_latency_seconds": H,
    "vllm:request_time_per_output_token_seconds": H, "vllm:e2e_request_latency_seconds": H,
    "vllm:request_queue_time_seconds": H, "vllm:request_inference_time_seconds": H,
    "vllm:request_prefill_time_seconds": H, "vllm:request_decode_time_seconds": H,
    "vllm:request_num_preemptions": H, "vllm:request_prefill_kv_computed_tokens": H,
    "vllm:num_requests_swapped": G, "vllm:gpu_cache_usage_perc": G,
    # Registered by vLLM 0.32 by default and 0 for what is served here (vllm_metrics.ZERO_COUNTERS).
    **{f"vllm:{name}": C for name in ZERO_COUNTERS},
}
# prometheus-fastapi-instrumentator's defaults, as vLLM 0.32 instruments its app: family -> (type, labels).
HTTP_FAMILIES = {"http_requests": (C, {"method", "status", "handler"}),  # samples http_requests_total
                 "http_request_size_bytes": ("summary", {"handler"}),
                 "http_response_size_bytes": ("summary", {"handler"}),
                 "http_request_duration_highr_seconds": (H, set()),
                 "http_request_duration_seconds": (H, {"method", "handler"})}
# Per finished request, one observation each (vLLM's FinishedRequestStats).
PER_REQUEST = ["e2e_request_latency_seconds", "request_queue_time_seconds", "request_inference_time_seconds",
               "request_prefill_time_seconds", "request_decode_time_seconds",
               "request_time_per_output_token_seconds", "request_num_preemptions", "request_prompt_tokens",
               "request_generation_tokens", "request_max_num_generation_tokens", "request_params_n",
               "request_params_max_tokens", "request_prefill_kv_computed_tokens"]
Scrape = dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]  # family -> (type, samples)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)
    # 40 blocks of 16 tokens: four 300-token outputs at once need 80, so some are preempted.
    with serve("--model", model_dir, "--worker", "sim", "--num-gpu-blocks", "41", "--max-model-len", "2048",
               "--served-model-name", SERVED, "alias", env={"PAGEDSERVE_HEALTH_INTERVAL": "0.2"}) as s:
        yield s


def scrape(srv: Server) -> Scrape:
    with urllib.request.urlopen(srv.http + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {f.name: (f.type, [(s.name, s.labels, s.value) for s in f.samples])
            for f in text_string_to_metric_families(text)}


def val(m: Scrape, sample: str, **labels: str) -> float:
    fam = re.sub(r"(_total|_sum|_count|_bucket)$", "", sample)
    if fam not in m:
        fam = sample.removesuffix("_sum").removesuffix("_count")  # iteration_tokens_total keeps its _total
    hits = [v for n, lab, v in m[fam][1] if n == sample and all(lab.get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (sample, labels, m.get(fam))
    return hits[0]


def run_load(client: openai.OpenAI) -> dict[str, int]:
    """Finished requests, all ending by length (ignore_eos): what their
    responses say (usage) and what they asked (n, max_tokens)."""
    # finished: requests; outputs: vLLM's finished (child) requests, n per request;
    # prompt_per_output / max_tokens_per_output: what vLLM's per-child histograms sum.
    totals = {"finished": 0, "n": 0, "max_tokens": 0, "prompt": 0, "completion": 0, "outputs": 0,
              "prompt_per_output": 0, "max_tokens_per_output": 0}
    extra = {"ignore_eos": True}

    def count(n: int, max_tokens: int, usage: Any) -> None:
        totals["finished"] += 1
        totals["outputs"] += n
        totals["prompt_per_output"] += n * usage.prompt_tokens
        totals["max_tokens_per_output"] += n * max_tokens
        totals["n"] += n
        totals["max_tokens"] += max_tokens
        totals["prompt"] += usage.prompt_tokens
        totals["completion"] += usage.completion_tokens
        assert usage.completion_tokens == n * max_tokens

    r = client.completions.create(model=SERVED, prompt="The quick brown fox", max_tokens=7, extra_body=extra)
    count(1, 7, r.usage)
    r = client.completions.create(model="alias", prompt="Hello there", max_tokens=5, n=3, temperature=0.8,
                                  seed=1, extra_body=extra)
    count(3, 5, r.usage)
    chat = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=6, extra_body=extra)
    count(1, 6, chat.usage)
    usage = None
    for chunk in client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Stream"}],
                                                max_tokens=9, stream=True, stream_options={"include_usage": True},
                                                extra_body=extra):
        usage = chunk.usage or usage
    count(1, 9, usage)
    # The same long prompt again: its full blocks come from the prefix cache.
    long_prompt = "A paged KV cache stores keys and values in fixed-size blocks. " * 4
    for _ in range(2):
        r = client.completions.create(model=SERVED, prompt=long_prompt, max_tokens=4, extra_body=extra)
        count(1, 4, r.usage)

    def long_one(i: int) -> Any:
        return client.completions.create(model=SERVED, prompt=f"Request {i} runs long", max_tokens=300,
                                         extra_body=extra).usage

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for u in pool.map(long_one, range(4)):
            count(1, 300, u)
    return totals


def test_vllm_families_after_a_mixed_load(srv: Server) -> None:
    client = openai.OpenAI(base_url=srv.http + "/v1", api_key="unused", max_retries=0, timeout=300)
    model_id = client.models.list().data[0].id
    assert model_id == SERVED
    try:
        t = run_load(client)
    except openai.APIError:
        print("".join(srv.log[-60:]))
        raise
    wait_all_free(srv)
    m = scrape(srv)

    # Values the load fixes (no request aborted yet).
    # vLLM 0.32 runs an n > 1 request as n child requests, each one finished request
    # (output_processor._update_stats_from_finished), params_n and the longest output once per parent.
    assert val(m, "vllm:request_success_total", finished_reason="length") == t["outputs"] > t["finished"]
    for reason in ("stop", "abort", "error", "repetition"):
        assert val(m, "vllm:request_success_total", finished_reason=reason) == 0
    for name in PER_REQUEST:
        per_parent = name in ("request_params_n", "request_max_num_generation_tokens")
        assert val(m, f"vllm:{name}_count") == t["finished" if per_parent else "outputs"], name
    assert val(m, "vllm:request_params_n_sum") == t["n"]
    assert val(m, "vllm:request_params_max_tokens_sum") == t["max_tokens_per_output"]
    assert val(m, "vllm:request_generation_tokens_sum") == t["completion"] == val(m, "vllm:generation_tokens_total")
    assert val(m, "vllm:request_max_num_generation_tokens_sum") == t["max_tokens"]  # each output ran to max_tokens
    assert val(m, "vllm:request_prompt_tokens_sum") == t["prompt_per_output"]
    assert val(m, "vllm:prompt_tokens_total") == t["prompt"]  # computed once for all n outputs here
    cached = val(m, "vllm:prompt_tokens_cached_total")
    assert cached >= 16 and cached == val(m, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    assert val(m, "vllm:prompt_tokens_by_source_total", source="local_compute") == t["prompt"] - cached
    assert val(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert val(m, "vllm:request_prefill_kv_computed_tokens_sum") == t["prompt_per_output"] - cached
    # Tokens per engine step, summed over the steps: every prompt token computed, every token generated.
    assert val(m, "vllm:iteration_tokens_total_sum") == t["prompt"] - cached + t["completion"]
    assert val(m, "vllm:iteration_tokens_total_count") >= 300  # at least one step per token of the long ones
    preemptions = val(m, "vllm:num_preemptions_total")
    assert preemptions > 0
    assert val(m, "vllm:request_num_preemptions_sum") == preemptions  # every preempted request finished
    assert val(m, "vllm:time_to_first_token_seconds_count") == t["finished"]
    assert val(m, "vllm:inter_token_latency_seconds_count") == t["completion"] - t["n"]
    prefill, decode = val(m, "vllm:request_prefill_time_seconds_sum"), val(m, "vllm:request_decode_time_seconds_sum")
    assert decode > 0 and abs(val(m, "vllm:request_inference_time_seconds_sum") - (prefill + decode)) < 1e-6
    assert val(m, "vllm:e2e_request_latency_seconds_sum") >= prefill + decode
    assert 0 < val(m, "vllm:request_time_per_output_token_seconds_sum") < decode
    assert val(m, "vllm:prompt_tokens_cached_by_source_total", source="device") == val(
        m, "vllm:prefix_cache_hits_total") > 0
    for source in ("host", "p2p", "disk", "external_unspecified"):
        assert val(m, "vllm:prompt_tokens_cached_by_source_total", source=source) == 0
    assert val(m, "vllm:engine_sleep_state", sleep_state="awake") == 1
    waiting = val(m, "vllm:num_requests_waiting")
    assert waiting == 0 == val(m, "vllm:num_requests_waiting_by_reason", reason="capacity") + val(
        m, "vllm:num_requests_waiting_by_reason", reason="deferred")
    assert val(m, "vllm:admission_rejections_total", reason="max_num_queued_reqs") == 0
    for name in ZERO_COUNTERS:
        assert val(m, f"vllm:{name}_total") == 0, name
    # vLLM's HTTP families: every completion and chat request counted once, by route template;
    # /metrics and /health left out as vLLM's instrumentator leaves them out.
    assert val(m, "http_requests_total", method="POST", status="2xx", handler="/v1/completions") == 2 + 2 + 4
    assert val(m, "http_requests_total", method="POST", status="2xx", handler="/v1/chat/completions") == 2
    assert val(m, "http_request_duration_seconds_count", method="POST", handler="/v1/chat/completions") == 2
    assert val(m, "http_request_size_bytes_count", handler="/v1/completions") == 8
    assert val(m, "http_request_size_bytes_sum", handler="/v1/completions") > 8 * 20
    assert val(m, "http_response_size_bytes_sum", handler="/v1/completions") > 0
    assert val(m, "http_request_duration_highr_seconds_count") >= 11  # /v1/models too
    assert not [lab for _, lab, _ in m["http_requests"][1] if lab.get("handler") in ("/metrics", "/health")]
    for name, (typ, labels) in HTTP_FAMILIES.items():
        assert m[name][0] == typ, name
        for smp, lab, _ in m[name][1]:
            assert set(lab) - {"le", "quantile"} == labels, (name, lab)

    # A stream the client drops: counted as an abort, and in none of the finished requests' histograms.
    stream = client.completions.create(model=SERVED, prompt="Abort me", max_tokens=1000, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 20
    while val(m := scrape(srv), "vllm:request_success_total", finished_reason="abort") == 0:
        assert time.monotonic() < deadline, "the dropped stream was not counted as an abort"
        time.sleep(0.1)
    wait_all_free(srv)
    m = scrape(srv)
    assert val(m, "vllm:e2e_request_latency_seconds_count") == t["outputs"]
    assert val(m, "vllm:time_to_first_token_seconds_count") == t["finished"] + 1
    assert val(m, "vllm:generation_tokens_total") > t["completion"]

    # Every family, with vLLM's type, the engine label and /v1/models' id on every sample.
    # (prometheus_client's *_created gauges beside each counter and histogram, as vLLM's, left aside)
    vllm = {name: typ for name, (typ, _) in m.items() if name.startswith("vllm:") and not name.endswith("_created")}
    assert vllm == FAMILIES
    for name in FAMILIES:
        samples = m[name][1]
        assert samples, name
        for _, labels, _ in samples:
            assert labels.get("engine") == "0" and labels.get("model_name") == model_id, (name, labels)
    info = m["vllm:cache_config_info"][1][0][1]
    assert int(info["num_gpu_blocks"]) == val(m, "pagedserve:num_gpu_blocks") == 40
    assert info["num_gpu_blocks_override"] == "41" and info["block_size"] == "16"
    buckets = [float(lab["le"]) for n, lab, _ in m["vllm:request_prompt_tokens"][1] if n.endswith("_bucket")]
    assert buckets[:-1] == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]  # vLLM's, up to max_model_len
    client.close()


_PEER_FAMILIES = r"""
import json, pathlib, re, types
import prometheus_client
import vllm
from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import PrometheusStatLogger

cfg = VllmConfig()
cfg.model_config = types.SimpleNamespace(served_model_name="m", max_model_len=2048, is_diffusion=False)
PrometheusStatLogger(cfg, [0]).log_engine_initialized()
registered = {m.name: m.type for m in prometheus_client.REGISTRY.collect() if m.name.startswith("vllm:")}
# The families it registers only under options (LoRA, KV connector, NaN checks, speculative decoding, ...).
root = pathlib.Path(vllm.__file__).parent
named = set()
for f in ("v1/metrics/loggers.py", "v1/spec_decode/metrics.py", "v1/metrics/perf.py"):
    named |= set(re.findall(r'"(vllm:[a-z_]+)"', (root / f).read_text()))
# vLLM's HTTP families: prometheus-fastapi-instrumentator's defaults (serve/instrumentator/metrics.py).
from prometheus_fastapi_instrumentator import metrics as pfi
reg = prometheus_client.CollectorRegistry()
pfi.default(registry=reg)
http = {}
for collector, names in reg._collector_to_names.items():
    fam = next(iter(collector.describe()))
    http[fam.name] = [fam.type, sorted(getattr(collector, "_labelnames", ()))]
print(json.dumps({"registered": registered, "named": sorted(named), "http": http}))
"""


def test_every_vllm_family_is_exported_or_documented_absent() -> None:
    if not PEER_PY.exists():
        pytest.skip("no peer venv (.venv-peers, scripts/setup-peers.sh): vLLM 0.32's families unknown")
    out = subprocess.run([str(PEER_PY), "-c", _PEER_FAMILIES], capture_output=True, text=True, timeout=600,
                         cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    peer = json.loads(out.stdout.strip().splitlines()[-1])
    docs = (ROOT / "docs" / "api.md").read_text()
    assert not set(ABSENT) & set(FAMILIES)
    for name in ABSENT:
        assert f"`{name.removeprefix('vllm:')}`" in docs, f"{name} is not in docs/api.md's absent list"
    for name, typ in peer["registered"].items():
        if name in FAMILIES:
            assert FAMILIES[name] == typ, (name, typ)
        else:
            assert name in ABSENT, f"vLLM 0.32 registers {name} ({typ}): neither exported nor documented absent"
    assert peer["http"] == {name: [typ, sorted(labels)] for name, (typ, labels) in HTTP_FAMILIES.items()}
    for name in peer["named"]:
        # A counter's source name may carry the _total its family name drops.
        assert {name, name.removesuffix("_total")} & (set(FAMILIES) | set(ABSENT)), name
