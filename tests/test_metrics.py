"""Prometheus /metrics on every component of a real server (tiny-Llama
tokenizer, SIMULATED worker for speed): the listed vLLM-named series exist,
and their values move as the traffic says they must."""
from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e_util import Server, free_port, serve
from models import make_tiny_model

COMPONENTS = ("frontend", "scheduler", "blockmgr", "gpuworker")
LISTED = ["num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
          "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total",
          "generation_tokens_total", "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
          "e2e_request_latency_seconds_count", "request_queue_time_seconds_count"]


@pytest.fixture(scope="module")
def ms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, int]]]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)
    ports = {c: free_port() for c in COMPONENTS}
    env = {f"PAGEDSERVE_{c.upper()}_METRICS_PORT": str(p) for c, p in ports.items()}
    env["PAGEDSERVE_HEALTH_INTERVAL"] = "0.2"
    with serve("--model", model_dir, "--worker", "sim", "--num-gpu-blocks", "1024", "--max-model-len", "8192",
               env=env) as s:
        yield s, ports


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("" if not s.labels else "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                                                 if k != "le") + "}")
            if "le" not in s.labels:
                out[key] = s.value
    return out


def test_every_listed_series_is_exposed(ms: tuple[Server, dict[str, int]]) -> None:
    # The engine's series appear once the frontend has the engine's first stats
    # (the health watch asks every 0.2 s here); a scrape at start-up can come first.
    deadline = time.monotonic() + 10
    while "pagedserve:num_requests_running" not in (m := scrape(ms[1]["frontend"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    for name in LISTED:
        assert "pagedserve:" + name in m, name
        # vLLM's name too, labelled with the served name (here: the folder given)
        assert any(k.startswith(f"vllm:{name}{{") and "model_name=" in k for k in m), name
    sched = scrape(ms[1]["scheduler"])
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "num_preemptions_total"):
        assert "pagedserve:" + name in sched
    blk = scrape(ms[1]["blockmgr"])
    assert blk["pagedserve:num_gpu_blocks"] == 1023 and "pagedserve:prefix_cache_hits_total" in blk
    assert "process_resident_memory_bytes" in scrape(ms[1]["gpuworker"])


def test_counters_and_histograms_move_with_traffic(ms: tuple[Server, dict[str, int]]) -> None:
    server, ports = ms
    before = scrape(ports["frontend"])
    worker_before = scrape(ports["gpuworker"])["pagedserve:worker_tokens_computed_total"]
    prompts = ["Hello there", "The quick brown fox jumps", "A paged KV cache stores keys"]
    streamed = 0
    prompt_tokens = 0
    with server.client() as c:
        for i, p in enumerate(prompts):
            prompt_tokens += len(c.tokenize(p))
            for resp in c.stream(p, max_tokens=5 + i, temperature=0.0, ignore_eos=True):
                streamed += sum(len(o.token_ids) for o in resp.outputs)
    after = scrape(ports["frontend"])
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert streamed == 5 + 6 + 7
    assert d["pagedserve:generation_tokens_total"] == streamed
    assert d["pagedserve:prompt_tokens_total"] == prompt_tokens
    assert d["pagedserve:time_to_first_token_seconds_count"] == 3
    assert d["pagedserve:e2e_request_latency_seconds_count"] == 3
    assert d["pagedserve:request_queue_time_seconds_count"] == 3
    assert 0 <= d["pagedserve:request_queue_time_seconds_sum"] <= d["pagedserve:time_to_first_token_seconds_sum"]
    assert d["pagedserve:inter_token_latency_seconds_count"] == streamed - 3  # a gap per token after the first
    assert d["pagedserve:request_success_total{finished_reason=length}"] == 3
    assert d["pagedserve:e2e_request_latency_seconds_sum"] >= d["pagedserve:time_to_first_token_seconds_sum"] > 0
    worker_after = scrape(ports["gpuworker"])["pagedserve:worker_tokens_computed_total"]
    assert worker_after - worker_before == prompt_tokens + streamed - 3  # last token of each is sampled, not run


def test_engine_gauges_follow_a_running_request(ms: tuple[Server, dict[str, int]]) -> None:
    server, ports = ms
    prompt = "A paged KV cache stores keys and values in fixed-size blocks " * 3
    with server.client() as c:
        hits0 = scrape(ports["blockmgr"])["pagedserve:prefix_cache_hits_total"]
        # Long enough (SIMULATED steps take ~ms) to still run while we look.
        stream = c.stream(prompt, max_tokens=8000, temperature=0.0, ignore_eos=True)
        next(stream)
        deadline = time.monotonic() + 10
        while True:
            fe, sch, blk = (scrape(ports[k]) for k in ("frontend", "scheduler", "blockmgr"))
            if fe["pagedserve:num_requests_running"] == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert fe["pagedserve:num_requests_running"] == 1 and fe["pagedserve:kv_cache_usage_perc"] > 0
        assert fe["pagedserve:num_requests_in_flight"] == 1
        assert sch["pagedserve:num_requests_running"] == 1
        assert blk["pagedserve:num_free_gpu_blocks"] < blk["pagedserve:num_gpu_blocks"]
        # The same prompt again: its full blocks come from the prefix cache.
        c.generate(prompt, max_tokens=2, temperature=0.0)
        assert scrape(ports["blockmgr"])["pagedserve:prefix_cache_hits_total"] > hits0
        stream.cancel()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            fe = scrape(ports["frontend"])
            if fe["pagedserve:num_requests_running"] == 0 and fe["pagedserve:kv_cache_usage_perc"] == 0:
                break
            time.sleep(0.1)
        assert fe["pagedserve:num_requests_running"] == 0 and fe["pagedserve:kv_cache_usage_perc"] == 0
        assert fe["pagedserve:request_success_total{finished_reason=abort}"] >= 1
