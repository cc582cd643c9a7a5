"""Outside load testers and eval harnesses run against a real `pagedserve
serve` with their own defaults (issue 20, acceptance 6): guidellm (which always
sends stream_options.continuous_usage_stats), lm-evaluation-harness's
local-completions (loglikelihood through echo + logprobs, checked against the
model run here in transformers) and local-chat-completions, NVIDIA's aiperf and
kubernetes-sigs' inference-perf (Python >= 3.12). vLLM's `vllm bench serve` has its own test (test_vllm_bench_client.py).

Each tool gets its own venv under PAGEDSERVE_OUTSIDE_CACHE (default
~/.cache/pagedserve-outside/<tool>), installed from PyPI once and reused while
its pinned requirements are unchanged. Opt-in, since the installs take minutes
and gigabytes: without PAGEDSERVE_OUTSIDE_CLIENTS=1 every test skips with that
reason, and a failed install (offline) skips with pip's last lines."""
from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e_util import Server, serve
from models import make_tiny_model

NAME = "tiny"
CACHE = Path(os.environ.get("PAGEDSERVE_OUTSIDE_CACHE") or Path.home() / ".cache" / "pagedserve-outside")
INSTALL_TIMEOUT_S = 1800.0
RUN_TIMEOUT_S = 600.0
PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS = 16, 8, 6

pytestmark = pytest.mark.skipif(
    os.environ.get("PAGEDSERVE_OUTSIDE_CLIENTS") != "1",
    reason="opt-in: PAGEDSERVE_OUTSIDE_CLIENTS=1 installs guidellm, lm-eval, aiperf and inference-perf from PyPI "
           "(minutes, GBs)")


def _same_as_ours(dist: str) -> str:
    """``dist==X.Y.Z`` as installed here, without a local label (+cpu), so pip
    reuses a local CPU wheel where there is one and PyPI's otherwise."""
    from importlib import metadata

    return f"{dist}=={metadata.version(dist).split('+')[0]}"


def _requirements(tool: str) -> list[str]:
    # guidellm pulls torch, unpinned: ours keeps it off a multi-GB CUDA build where a CPU wheel is at hand.
    return {"guidellm": ["guidellm==0.8.1", _same_as_ours("torch")],
            "lm-eval": ["lm-eval[api]==0.4.13", _same_as_ours("transformers")],
            "aiperf": ["aiperf==0.13.0"], "inference-perf": ["inference-perf==0.7.0"]}[tool]


def _python(tool: str) -> str:
    """inference-perf needs Python 3.12 or later; the others run on ours."""
    if tool != "inference-perf" or sys.version_info >= (3, 12):
        return sys.executable
    # A pyenv shim is on PATH even for a version that is not enabled, and then exits 127: take the
    # first candidate that runs.
    candidates = [shutil.which(n) for n in ("python3.13", "python3.12")]
    candidates += [str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.1[23]*/bin/python3"), reverse=True)]
    for found in filter(None, candidates):
        if subprocess.run([found, "-c", "pass"], capture_output=True, timeout=60).returncode == 0:
            return found
    pytest.skip("inference-perf needs Python >= 3.12: no python3.12 or python3.13 that runs "
                f"(tried {[c for c in candidates if c]})")


def tool_bin(tool: str) -> Path:
    """The bin folder of the tool's venv, installed if its stamp differs."""
    reqs = _requirements(tool)
    home = CACHE / tool
    stamp = home / "pagedserve-requirements.txt"
    want = "\n".join(reqs) + "\n"
    if stamp.exists() and stamp.read_text() == want:
        return home / "bin"
    made = subprocess.run([_python(tool), "-m", "venv", "--clear", str(home)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    try:
        r = subprocess.run([str(home / "bin" / "python"), "-m", "pip", "install", "-q", *reqs],
                           capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"{tool}: pip install {' '.join(reqs)} took over {INSTALL_TIMEOUT_S:g}s")
    if r.returncode != 0:
        pytest.skip(f"{tool}: pip install {' '.join(reqs)} failed (offline?):\n{(r.stdout + r.stderr)[-1500:]}")
    stamp.write_text(want)
    return home / "bin"


def run_tool(argv: list[str], cwd: Path, offline: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs an outside tool with nothing of ours on its path; hub access off (all is local)
    unless ``offline`` is False: aiperf 0.13 then fails to load a tokenizer folder.
    Its temporary files go to a short folder removed after (aiperf's IPC socket paths must
    fit in 107 bytes, and it leaves its /tmp/aiperf_mmap_* behind)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(NO_COLOR="1", COLUMNS="200", **({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"} if offline else {}))
    with tempfile.TemporaryDirectory(prefix="psout-") as tmp:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=cwd,
                           env={**env, "TMPDIR": tmp})
    (cwd / "tool.log").write_text(r.stdout + r.stderr)
    return r


def _tail(r: subprocess.CompletedProcess[str]) -> str:
    return (r.stdout + r.stderr)[-4000:]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)


@pytest.fixture(scope="module")
def srv(model: str) -> Iterator[Server]:
    with serve("--model", model, "--served-model-name", NAME, "--kv-cache-memory", "8MiB") as s:
        yield s


# Installed before the server starts (a test asks for these first), so an offline skip starts nothing.
@pytest.fixture(scope="module")
def guidellm() -> Path:
    return tool_bin("guidellm")


@pytest.fixture(scope="module")
def lmeval() -> Path:
    return tool_bin("lm-eval")


@pytest.fixture(scope="module")
def aiperf() -> Path:
    return tool_bin("aiperf")


@pytest.fixture(scope="module")
def inference_perf() -> Path:
    return tool_bin("inference-perf")


# --- guidellm -------------------------------------------------------------------------------

@pytest.mark.parametrize("request_format", [None, "/v1/completions"], ids=["chat-default", "completions"])
def test_guidellm_run_with_its_defaults(guidellm: Path, srv: Server, tmp_path: Path, model: str,
                                       request_format: str | None) -> None:
    """guidellm's own request bodies (stream, include_usage plus continuous_usage_stats,
    ignore_eos, content parts on chat): every request succeeds with the asked-for tokens."""
    backend = f"kind=openai_http,target={srv.http}" + (f",request_format={request_format}" if request_format else "")
    out = tmp_path / "benchmarks.json"
    r = run_tool([str(guidellm / "guidellm"), "run", "--backend", backend, "--profile", "kind=concurrent,streams=2",
                  "--constraint", f"kind=max_requests,count={REQUESTS}",
                  "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
                  "--tokenizer", f"kind=hf_auto,model={model}", "--output", f"kind=json,path={out}",
                  "--disable-console"], tmp_path)
    assert r.returncode == 0 and out.exists(), _tail(r)
    bench = json.loads(out.read_text())["benchmarks"][0]
    errored = [q["info"].get("error") for q in bench["requests"]["errored"]]
    assert bench["metrics"]["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                                                  "total": REQUESTS}, errored[:3]
    for q in bench["requests"]["successful"]:
        assert q["output_tokens"] == OUTPUT_TOKENS, q  # guidellm sends ignore_eos
        assert q["prompt_tokens"] > 0 and q["output"], q
        assert 0 < q["time_to_first_token_ms"] < q["request_latency"] * 1000, q  # streamed, not all at the end


# --- lm-evaluation-harness ------------------------------------------------------------------

GEN_DOCS = [{"question": f"Count: {i} {i + 1} {i + 2}", "answer": f" {i + 3}"} for i in range(6)]
MC_DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "Tokyo"], "label": 0},
    {"question": "The quick brown fox jumps over the lazy", "choices": ["dog", "cat", "river"], "label": 0},
    {"question": "Hello,", "choices": ["world!", "river", "cache"], "label": 0},
    {"question": "Numbers: 0 1 2", "choices": ["3", "x", "Paris"], "label": 0},
]


def write_tasks(folder: Path) -> Path:
    """Two custom lm-eval tasks from local JSONL (nothing from the hub): generate_until and multiple_choice."""
    folder.mkdir()
    for name, docs in (("gen", GEN_DOCS), ("mc", MC_DOCS)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder}/{{n}}.jsonl\n"
              "test_split: test\ndoc_to_text: \"{{{{question}}}}\"\n")
    (folder / "gen.yaml").write_text(
        "task: pagedserve_gen\n" + common.format(n="gen") + "output_type: generate_until\n"
        "doc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    (folder / "mc.yaml").write_text(
        "task: pagedserve_mc\n" + common.format(n="mc") + "output_type: multiple_choice\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return folder


def lm_eval(bin_dir: Path, tmp_path: Path, model_kind: str, url: str, model: str, tasks: str,
            *extra: str) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Runs `lm-eval run`; returns its results file and its logged samples by task."""
    out = tmp_path / "out"
    r = run_tool([str(bin_dir / "lm-eval"), "run", "--model", model_kind,
                  "--model_args", f"model={NAME},base_url={url},tokenizer={model}", "--tasks", tasks,
                  "--include_path", str(write_tasks(tmp_path / "tasks")), "--output_path", str(out),
                  "--log_samples", *extra], tmp_path)
    results = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    assert r.returncode == 0 and len(results) == 1, _tail(r)
    samples: dict[str, list[dict[str, Any]]] = {}
    for task in tasks.split(","):
        (path,) = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        samples[task] = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return json.loads(Path(results[0]).read_text()), samples


@functools.cache
def _load(model: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(model), AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def reference_loglikelihood(model: str, context: str, continuation: str) -> tuple[float, bool]:
    """What lm-eval computes from echo + logprobs, from the checkpoint in transformers:
    its token split (trailing context spaces move to the continuation; the
    continuation is the whole text's tokens past the context's), summed log-probs,
    and whether every continuation token is the argmax."""
    import torch

    tok, lm = _load(model)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    ids = ctx + whole[len(ctx):]
    with torch.no_grad():
        logp = lm(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    picks = range(len(ctx), len(ids))
    return (float(sum(logp[i - 1, ids[i]] for i in picks)),
            all(int(logp[i - 1].argmax()) == ids[i] for i in picks))


def test_lm_eval_local_completions(lmeval: Path, srv: Server, tmp_path: Path, model: str) -> None:
    """generate_until and loglikelihood (multiple_choice) tasks over /v1/completions with token-id
    prompts: every document answered, and each log-likelihood is the model's own."""
    results, samples = lm_eval(lmeval, tmp_path, "local-completions", srv.http + "/v1/completions",
                               model, "pagedserve_gen,pagedserve_mc")
    assert results["n-samples"] == {"pagedserve_gen": {"original": 6, "effective": 6},
                                    "pagedserve_mc": {"original": 4, "effective": 4}}, results["n-samples"]
    assert 0.0 <= results["results"]["pagedserve_gen"]["exact_match,none"] <= 1.0
    assert 0.0 <= results["results"]["pagedserve_mc"]["acc,none"] <= 1.0
    assert len(samples["pagedserve_gen"]) == 6
    assert all(isinstance(s["filtered_resps"][0], str) for s in samples["pagedserve_gen"])
    assert all("\n" not in s["filtered_resps"][0] for s in samples["pagedserve_gen"])  # the stop held
    checked = 0
    for s in samples["pagedserve_mc"]:
        for args, resp in zip(s["arguments"].values(), s["filtered_resps"], strict=True):
            got_ll, got_greedy = float(resp[0]), resp[1] in (True, "True")
            want_ll, want_greedy = reference_loglikelihood(model, args["arg_0"], args["arg_1"])
            assert abs(got_ll - want_ll) < 1e-3 * max(1.0, abs(want_ll)), (args, got_ll, want_ll)
            assert got_greedy == want_greedy, (args, got_greedy)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in MC_DOCS)


def test_lm_eval_local_chat_completions(lmeval: Path, srv: Server, tmp_path: Path, model: str) -> None:
    """The chat model with --apply_chat_template: every document gets an answer, cut at the stop."""
    results, samples = lm_eval(lmeval, tmp_path, "local-chat-completions",
                               srv.http + "/v1/chat/completions", model, "pagedserve_gen", "--apply_chat_template")
    assert results["n-samples"]["pagedserve_gen"] == {"original": 6, "effective": 6}
    assert "exact_match,none" in results["results"]["pagedserve_gen"]
    answers = [s["filtered_resps"][0] for s in samples["pagedserve_gen"]]
    assert len(answers) == 6 and all(isinstance(a, str) and "\n" not in a for a in answers), answers
    assert any(answers), answers  # 6 max_gen_toks of a random model: not all can be an immediate stop


# --- aiperf ---------------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint_type", ["chat", "completions"])
def test_aiperf_profile(aiperf: Path, srv: Server, tmp_path: Path, model: str, endpoint_type: str) -> None:
    """aiperf's defaults (max_completion_tokens, include_usage; /metrics scraped): all requests
    complete with none failed, usage within the asked length, first token before the last."""
    art = tmp_path / "artifacts"
    r = run_tool([str(aiperf / "aiperf"), "profile", "--model", NAME, "--url", srv.http,
                  "--endpoint-type", endpoint_type, "--streaming", "--tokenizer", model,
                  "--request-count", str(REQUESTS), "--concurrency", "2", "--isl", str(PROMPT_TOKENS),
                  "--osl", str(OUTPUT_TOKENS), "--ui", "none", "--artifact-dir", str(art)], tmp_path, offline=False)
    report = art / "profile_export_aiperf.json"
    assert r.returncode == 0 and report.exists(), _tail(r)
    d = json.loads(report.read_text())
    assert d["error_summary"] == [] and d["was_cancelled"] is False, d["error_summary"]
    assert d["request_count"]["avg"] == REQUESTS and d["completed_request_count"]["avg"] == REQUESTS
    assert d.get("request_error_rate", {"avg": 0.0})["avg"] == 0.0
    usage = d["usage_completion_tokens"]
    assert usage["count"] == REQUESTS and 1 <= usage["min"] <= usage["max"] <= OUTPUT_TOKENS, usage
    assert d["usage_prompt_tokens"]["min"] > 0
    assert d["time_to_first_token"]["avg"] < d["request_latency"]["avg"], (d["time_to_first_token"],
                                                                            d["request_latency"])



# --- inference-perf (kubernetes-sigs) -------------------------------------------------------

INFERENCE_PERF_CONFIG = """\
load: {{type: constant, stages: [{{rate: 2, duration: 4}}], num_workers: 1}}
api: {{type: completion, streaming: true}}
server: {{type: vllm, model_name: {name}, base_url: "{url}", ignore_eos: true}}
tokenizer: {{pretrained_model_name_or_path: "{model}"}}
data:
  type: random
  input_distribution: {{min: 8, max: 16, mean: 12, std_dev: 2, total_count: 20}}
  output_distribution: {{min: 4, max: 8, mean: 6, std_dev: 1, total_count: 20}}
report: {{request_lifecycle: {{summary: true, per_request: true}}}}
storage: {{local_storage: {{path: "{out}"}}}}
"""


def test_inference_perf_constant_rate(inference_perf: Path, srv: Server, tmp_path: Path, model: str) -> None:
    """inference-perf's vLLM client (its random data works with the completion API only):
    no failure, and each request gets exactly its max_tokens (it sends ignore_eos)."""
    out = tmp_path / "reports"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(INFERENCE_PERF_CONFIG.format(name=NAME, url=srv.http, model=model, out=out))
    r = run_tool([str(inference_perf / "inference-perf"), "-c", str(cfg)], tmp_path)
    assert r.returncode == 0 and (out / "summary_lifecycle_metrics.json").exists(), _tail(r)
    summary = json.loads((out / "summary_lifecycle_metrics.json").read_text())
    assert summary["failures"]["count"] == 0, summary["failures"]
    per_request = json.loads((out / "per_request_lifecycle_metrics.json").read_text())
    assert summary["successes"]["count"] == len(per_request) >= 4, summary["successes"]["count"]
    for q in per_request:
        usage = q["info"]["response_metrics"]["server_usage"]
        assert q["error"] is None and usage["prompt_tokens"] > 0, q["error"]
        assert usage["completion_tokens"] == json.loads(q["request"])["max_tokens"], usage
