"""A vLLM user changes nothing: `pagedserve serve HuggingFaceTB/SmolLM2-135M-Instruct`
(positional hub id, resolved from a local hub cache made here holding a tiny
random model under that real name) serves the OpenAI API on --port with the
official `openai` client; /v1/models reports the id; vllm:* metrics with
model_name on the serving port, read at scrape time; /tokenize, /detokenize,
/version; echo and batched prompts."""
from __future__ import annotations

import json
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e_util import Server, serve, wait_all_free
from models import make_tiny_model

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPT = "The quick brown fox"
MAX_NUM_SEQS = 2


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tiny = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)
    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / ("models--" + REPO.replace("/", "--"))
    shutil.copytree(tiny, repo / "snapshots" / "5a1e0c2")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("5a1e0c2")
    # A watchdog this slow never refreshes the stats: fresh gauges must come from the scrape.
    env = {"HF_HOME": str(home), "HF_HUB_CACHE": "", "PAGEDSERVE_HEALTH_INTERVAL": "60"}
    with serve(REPO, "--num-gpu-blocks", "128", "--max-num-seqs", str(MAX_NUM_SEQS), env=env) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: Server) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=srv.http + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def post(srv: Server, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(srv.http + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def scrape(srv: Server) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(srv.http + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(m: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    hits = [v for lab, v in m[name] if all(lab.get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (name, labels, m.get(name))
    return hits[0]


def test_hub_id_is_served_under_its_name(srv: Server, client: openai.OpenAI) -> None:
    assert f"serving {REPO}:" in "".join(srv.log)
    assert [m.id for m in client.models.list().data] == [REPO]
    r = client.completions.create(model=REPO, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.model == REPO and r.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=REPO, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.model == REPO and chat.choices[0].message.role == "assistant"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other/model", prompt=PROMPT, max_tokens=2)


def test_vllm_metrics_on_the_serving_port_follow_the_requests_in_flight(srv: Server,
                                                                       client: openai.OpenAI) -> None:
    label = {"model_name": REPO}
    before = scrape(srv)
    tokens = 300
    long_prompt = PROMPT * 10  # full blocks, so the later two hit the prefix cache
    streams = []
    for _ in range(MAX_NUM_SEQS):  # these run ...
        s = client.completions.create(model=REPO, prompt=long_prompt, max_tokens=tokens, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        next(iter(s))
        streams.append(s)
    # ... and this one waits (max-num-seqs): its request reached the engine once the headers came back.
    streams.append(client.completions.create(model=REPO, prompt=long_prompt, max_tokens=tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True}))
    # The state holds for seconds; the best of five scrapes absorbs a busy CI core, not a stale gauge
    # (the watchdog runs every 60 s here, so only a scrape-time read can see these requests).
    # 0.25 s: a scrape that waited on the engine's step loop would take seconds here.
    for _ in range(5):
        t0 = time.monotonic()
        m = scrape(srv)
        scrape_s = time.monotonic() - t0
        assert value(m, "vllm:num_requests_running", **label) == MAX_NUM_SEQS
        assert value(m, "vllm:num_requests_waiting", **label) == 1
        if scrape_s < 0.25:
            break
    assert scrape_s < 0.25, f"a scrape took {scrape_s * 1000:.0f} ms"
    assert value(m, "vllm:kv_cache_usage_perc", **label) > 0
    info = [lab for lab, _ in m["vllm:cache_config_info"]]
    # num_gpu_blocks: the usable ones (the pool less its null block), as pagedserve:num_gpu_blocks says
    assert info == [{**label, "engine": "0", "block_size": "16", "num_gpu_blocks": "127",
                     "num_gpu_blocks_override": "128", "num_cpu_blocks": "0",
                     "enable_prefix_caching": "True", "cache_dtype": "auto", "gpu_memory_utilization": "0.92",
                     "swap_space": "0.0"}]
    assert [lab for lab, _ in m["vllm:lora_requests_info"]] == [
        {**label, "engine": "0", "running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "0"}]
    done = threading.Event()

    def drain() -> None:
        for s in streams:
            for _ in s:
                pass
        done.set()

    threading.Thread(target=drain, daemon=True).start()
    assert done.wait(120)
    m = scrape(srv)  # at once: no watchdog lag
    assert value(m, "vllm:num_requests_running", **label) == 0
    assert value(m, "vllm:num_requests_waiting", **label) == 0
    assert value(m, "vllm:kv_cache_usage_perc", **label) == 0

    def delta(name: str, **lab: str) -> float:
        prev = [v for x, v in before.get(name, []) if all(x.get(k) == y for k, y in {**label, **lab}.items())]
        return value(m, name, **label, **lab) - (prev[0] if prev else 0.0)

    assert delta("vllm:generation_tokens_total") == 3 * tokens
    assert delta("vllm:prompt_tokens_total") == 3 * post(srv, "/tokenize", {"prompt": long_prompt})[1]["count"]
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    for name in ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:inter_token_latency_seconds_count", "vllm:request_queue_time_seconds_count"):
        value(m, name, **label)
    assert delta("vllm:prefix_cache_hits_total") > 0  # the same prompt three times


def test_tokenize_detokenize_version(srv: Server) -> None:
    with srv.client() as c:
        ids = list(c.tokenize(PROMPT))
    code, r = post(srv, "/tokenize", {"model": REPO, "prompt": PROMPT, "return_token_strs": True})
    assert code == 200 and r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == 512
    assert "".join(r["token_strs"]).replace("\u0120", " ") == PROMPT
    code, chat = post(srv, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert code == 200 and chat["count"] > 3 and chat["token_strs"] is None
    code, d = post(srv, "/detokenize", {"model": REPO, "tokens": ids})
    assert code == 200 and d == {"prompt": PROMPT}
    with urllib.request.urlopen(srv.http + "/version") as resp:
        assert json.load(resp) == {"version": metadata.version("pagedserve")}
    for path, body, param in [("/detokenize", {"tokens": [10**6]}, "tokens"), ("/detokenize", {"tokens": "x"}, "tokens"),
                              ("/tokenize", {"prompt": ""}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": "a", "truncate": 3}, "truncate"),
                              ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens")]:
        code, e = post(srv, path, body)
        assert code == 400 and e["error"]["param"] == param, (path, body, e)


def test_echo_prepends_the_prompt(srv: Server, client: openai.OpenAI) -> None:
    plain = client.completions.create(model=REPO, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    echoed = client.completions.create(model=REPO, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=REPO, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == PROMPT + plain
    lp = client.completions.create(model=REPO, prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                   logprobs=1).choices[0].logprobs
    n_prompt = post(srv, "/tokenize", {"prompt": PROMPT})[1]["count"]
    assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + 6
    assert lp.token_logprobs[0] is None and all(v is not None and v <= 0 for v in lp.token_logprobs[1:])


def test_a_batch_of_prompts_gives_one_choice_per_prompt_and_sample(srv: Server, client: openai.OpenAI) -> None:
    prompts = [PROMPT, "Hello there", "What is the capital"]
    singles = [client.completions.create(model=REPO, prompt=p, max_tokens=5, temperature=0).choices[0].text
               for p in prompts]
    # n > 1 samples (vLLM refuses n > 1 with greedy sampling): seeded, each prompt as alone.
    seeded = [[c.text for c in client.completions.create(model=REPO, prompt=p, max_tokens=5, temperature=1.0,
                                                         seed=5, n=2).choices] for p in prompts]
    r = client.completions.create(model=REPO, prompt=prompts, max_tokens=5, temperature=1.0, seed=5, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [t for pair in seeded for t in pair]
    assert 6 <= r.usage.completion_tokens <= 30
    with srv.client() as g:
        id_prompts = [list(g.tokenize(p)) for p in prompts]
    r2 = client.completions.create(model=REPO, prompt=id_prompts, max_tokens=5, temperature=0)
    assert [c.text for c in r2.choices] == singles
    assert r2.usage.prompt_tokens == sum(map(len, id_prompts))
    chunks = list(client.completions.create(model=REPO, prompt=prompts, max_tokens=5, temperature=0, stream=True))
    texts = {i: "".join(c.text for ch in chunks for c in ch.choices if c.index == i) for i in range(3)}
    assert [texts[i] for i in range(3)] == singles
    # One bad prompt refuses the batch and starts nothing.
    for bad in ([PROMPT, [1, 2]], [PROMPT] * 65, [], [[1, 2], [10**6]]):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=REPO, prompt=bad, max_tokens=3)  # type: ignore[arg-type]
        assert e.value.body["param"] == "prompt", bad
    wait_all_free(srv)


# Fields outside vLLM's request models are ignored, vLLM's own accepted, as vLLM 0.32 does:
# tests/test_vllm_extras.py.


def test_serve_from_a_plain_folder_path_reports_that_path(tmp_path: Path) -> None:
    tiny = make_tiny_model(tmp_path, "qwen2", seed=1)
    with serve(tiny, "--num-gpu-blocks", "32", "--served-model-name", "my-model", "alias") as s:
        c = openai.OpenAI(base_url=s.http + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["my-model"]
        assert c.completions.create(model="alias", prompt=PROMPT, max_tokens=2).model == "my-model"
        c.close()


def test_sigterm_waits_for_in_flight_requests_up_to_the_shutdown_timeout(tmp_path: Path) -> None:
    tiny = make_tiny_model(tmp_path, "llama", seed=0)
    # SIMULATED worker: 3000 tokens take seconds, well past the 1 s grace a stop had before.
    with serve(tiny, "--worker", "sim", "--num-gpu-blocks", "512", "--max-model-len", "4096",
               "--shutdown-timeout", "60") as s, s.client() as g:
        stream = g.stream(PROMPT, max_tokens=3000, temperature=0.0, ignore_eos=True)
        got = sum(len(o.token_ids) for o in next(stream).outputs)
        s.proc.send_signal(signal.SIGTERM)  # as `docker stop` / Kubernetes do
        finish = []
        for resp in stream:
            got += sum(len(o.token_ids) for o in resp.outputs)
            finish += [o.finish_reason for o in resp.outputs if o.finish_reason]
        assert got == 3000 and finish == ["length"]  # ran to its end, not cut off
        assert s.proc.wait(60) == 0
        c = openai.OpenAI(base_url=s.http + "/v1", api_key="unused", max_retries=0, timeout=10)
        with pytest.raises(openai.APIConnectionError):  # nothing is accepted after
            c.completions.create(model=tiny, prompt=PROMPT, max_tokens=2)
        c.close()


def test_api_key_flag_guards_both_apis_and_stays_off_the_command_lines(tmp_path: Path) -> None:
    tiny = make_tiny_model(tmp_path, "llama", seed=0)
    key = "k3y-for-the-test-0123"
    with serve(tiny, "--num-gpu-blocks", "32", "--api-key", key) as s:
        for pid in s.pids.values():  # readable by any local user, as `ps` shows them
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert key.encode() not in f.read()
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.http + "/v1", api_key="wrong-key-1234", max_retries=0).models.list()
        c = openai.OpenAI(base_url=s.http + "/v1", api_key=key, max_retries=0)
        assert [m.id for m in c.models.list().data] == [tiny]
        c.close()
        from pagedserve.client import GenerationClient

        with GenerationClient(s.addr, api_key=key) as g:
            assert len(g.tokenize(PROMPT)) > 0
