"""``python -m benchmarks vllm-diff``: the same 200 requests to vLLM 0.32's CPU
OpenAI server (``.venv-peers``) and to ``pagedserve serve``, on the same model
with greedy decoding, one server at a time, then compared (issue 20,
acceptance 1; issue 41, acceptance 4).

Each engine's raw answers go to ``OUT/<engine>.json``; the per-request
comparison to ``OUT/diff.json``; a table by category and the counts by kind
are printed. Compared: token ids, ``tool_calls``, ``finish_reason``, text,
logprobs, usage and HTTP status (vllm_diff_compare); the error bodies field by
field, the keys each body sends (null or set), ``prompt_logprobs`` ids and
ranks, and after the load the ``/metrics`` families and ``/v1/models`` keys
(vllm_diff_bodies). Every difference must be listed in docs/api.md's table
(vllm_diff_accepted); an unlisted one makes the exit status 1.

    python -m benchmarks vllm-diff [--out DIR] [--engines vllm,pagedserve] [--compare-only]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pagedserve.bench.serve_proc import start_serve
from benchmarks import vllm_diff_accepted as accepted
from benchmarks import vllm_diff_bodies as bodies
from benchmarks.vllm_diff_compare import compare, normalize
from benchmarks.vllm_diff_corpus import CHAT, STATUS, Case, basic_cases
from benchmarks.vllm_diff_invalid import invalid_cases
from benchmarks.vllm_diff_tools import structured_cases, tool_cases
from benchmarks.vllm_server import VllmServer, start_vllm_serve

SERVED = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 2048
TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
# What acceptance 1 requires; the other kinds (text, logprobs, usage, ...) are reported.
REQUIRED = {"status": "same HTTP status", "n_choices": "token ids", "token_ids": "token ids",
            "ids_missing": "token ids", "tool_calls": "tool_calls", "finish_reason": "finish_reason"}
REQUEST_TIMEOUT_S = 300.0
AFTER_LOAD = "after load"  # the category of the /metrics and /v1/models rows


def all_cases() -> list[Case]:
    cases = [*basic_cases(), *structured_cases(), *tool_cases(), *invalid_cases()]
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "case names must be unique"
    return cases


def start_vllm(model_dir: str) -> VllmServer:
    """vLLM's api_server as bench serving's peer (vllm_server.py), plus the tool flags and a 1 GiB KV cache."""
    kv = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    return start_vllm_serve(model_dir, SERVED, MAX_MODEL_LEN, 8, extra_args=TOOL_FLAGS, extra_env=kv)


def _post(url: str, data: bytes, stream: bool) -> dict[str, Any]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            if not stream:
                return {"status": r.status, "body": json.load(r), "seconds": time.monotonic() - t0}
            chunks, events = [], 0
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                events += 1
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunks.append(json.loads(payload))
            # An error inside a stream (status 200 already sent) is an event with "error".
            errors = [c for c in chunks if "error" in c]
            return {"status": r.status, "chunks": chunks, "stream_errors": errors, "seconds": time.monotonic() - t0}
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            body: Any = json.loads(text)
        except ValueError:
            body = text
        return {"status": e.code, "body": body, "seconds": time.monotonic() - t0}
    except (urllib.error.URLError, OSError, ValueError) as e:
        return {"status": -1, "body": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}


def send(base: str, case: Case) -> dict[str, Any]:
    """One case; a valid one also asks for ``return_token_ids``. If the engine
    refuses that field alone, the case is sent again without it (and the
    result says so): its ids then come from logprobs or are missing."""
    url = base + case.route
    if case.raw is not None:
        return _post(url, case.raw, False)
    body = {"model": SERVED, **case.body}
    stream = bool(body.get("stream"))
    if case.compare != STATUS and not case.plain:
        res = _post(url, json.dumps({**body, "return_token_ids": True}).encode(), stream)
        if res["status"] != 400 or "return_token_ids" not in json.dumps(res.get("body")):
            return res
        first = res
        res = _post(url, json.dumps(body).encode(), stream)
        res["return_token_ids_refused"] = first["body"]
        return res
    return _post(url, json.dumps(body).encode(), stream)


def run_engine(engine: str, cases: list[Case], model_dir: str, kv_memory: str) -> dict[str, Any]:
    t0 = time.monotonic()
    if engine == "vllm":
        srv: Any = start_vllm(model_dir)
        base = srv.url
    else:
        srv = start_serve(["--kv-cache-memory", kv_memory, "--max-model-len", str(MAX_MODEL_LEN),
                           "--served-model-name", SERVED, "--seed", "0", "--max-num-seqs", "8", *TOOL_FLAGS],
                          model_dir)
        base = srv.http_url
    started = time.monotonic() - t0
    print(f"vllm-diff: {engine} up in {started:.0f} s; sending {len(cases)} requests", flush=True)
    results: dict[str, Any] = {}
    after: dict[str, Any] = {}
    try:
        for i, case in enumerate(cases):
            results[case.name] = send(base, case)
            if (i + 1) % 25 == 0:
                print(f"vllm-diff: {engine}: {i + 1}/{len(cases)}", flush=True)
        # After the same load: the metric families each exports, and the model card's fields.
        after = {path: _get(base + path) for path in ("/metrics", "/v1/models")}
    finally:
        srv.stop()
    return {"engine": engine, "startup_s": started, "seconds": time.monotonic() - t0, "results": results,
            "after_load": after, "log_tail": "".join(srv.log[-30:])}


def _get(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return {"status": r.status, "text": r.read().decode(errors="replace")}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "text": e.read().decode(errors="replace")}
    except (urllib.error.URLError, OSError) as e:
        return {"status": -1, "text": f"{type(e).__name__}: {e}"}


def _outcome(case: Case, raw: dict[str, Any]) -> dict[str, Any]:
    out = normalize(case.route == CHAT, raw["status"], raw.get("body"), raw.get("chunks"))
    if raw.get("stream_errors"):
        out["status"] = f"200+stream error {raw['stream_errors'][0].get('error', {}).get('code', '')}"
    return out


def shape_diffs(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[tuple[str, str]], Counter[str]]:
    """The bodies' shape (vllm_diff_bodies): error fields when both refuse
    with one status, the key paths and prompt_logprobs when both answer 200;
    and which of these comparisons were made."""
    made: Counter[str] = Counter()
    if a["status"] != b["status"]:
        return [], made
    if a["status"] != 200:
        made["error bodies"] += 1
        return bodies.compare_errors(a.get("body"), b.get("body")), made
    made["key sets"] += 1
    out = bodies.compare_keys(bodies.bodies_of(a), bodies.bodies_of(b))
    pa, pb = bodies.prompt_logprobs_of(a.get("body")), bodies.prompt_logprobs_of(b.get("body"))
    for where in sorted(set(pa) | set(pb)):
        made["prompt_logprobs"] += 1
        out += bodies.compare_prompt_logprobs(pa.get(where), pb.get(where), where)
    return out, made


def diff(cases: list[Case], ref: dict[str, Any], ours: dict[str, Any]) -> tuple[list[dict[str, Any]], Counter[str]]:
    """One row per request (its mismatches, ``[kind, detail]``), then one row
    per after-load route (/metrics families, /v1/models keys); and how many
    comparisons of each sort were made."""
    rows, made = [], Counter[str]()
    for c in cases:
        a, b = ref["results"].get(c.name), ours["results"].get(c.name)
        if a is None or b is None:
            rows.append({"name": c.name, "cat": c.cat, "mismatches": [["not_run", "missing from a run"]]})
            continue
        mism = compare(c, _outcome(c, a), _outcome(c, b))
        if b.get("return_token_ids_refused") is not None:
            mism.append(("return_token_ids_refused", "pagedserve refused return_token_ids"))
        shape, n = shape_diffs(a, b)
        made += n
        rows.append({"name": c.name, "cat": c.cat, "status": [a["status"], b["status"]],
                     "mismatches": [list(m) for m in [*mism, *shape]]})
    la, lb = ref.get("after_load") or {}, ours.get("after_load") or {}
    for route in ("/metrics", "/v1/models"):
        ga, gb = la.get(route) or {"status": -1, "text": ""}, lb.get(route) or {"status": -1, "text": ""}
        if ga["status"] != 200 or gb["status"] != 200:
            mism = [("status", f"{ga['status']} vs {gb['status']}")]
        elif route == "/metrics":
            made["metric families"] += len(bodies.families(ga["text"]))
            mism = bodies.compare_metrics(ga["text"], gb["text"])
        else:
            made["key sets"] += 1
            mism = bodies.compare_keys([json.loads(ga["text"])], [json.loads(gb["text"])])
        rows.append({"name": route, "cat": AFTER_LOAD, "mismatches": [list(m) for m in mism]})
    return rows, made


def _ok(r: dict[str, Any]) -> bool:
    """Every difference listed in docs/api.md (or none); after judge()."""
    return all(m[2] is not None for m in r["mismatches"])


def table(rows: list[dict[str, Any]]) -> str:
    """Per category: requests, exact matches, requests whose differences
    are all listed in docs/api.md, and the listed / unlisted difference counts."""
    cats = list(dict.fromkeys(r["cat"] for r in rows))
    head = ["category", "requests", "match", "all listed", "listed", "unlisted"]
    lines = [head]
    for cat in [*cats, "all"]:
        rs = [r for r in rows if cat in ("all", r["cat"])]
        ms = [m for r in rs for m in r["mismatches"]]
        lines.append([cat, str(len(rs)), str(sum(not r["mismatches"] for r in rs)), str(sum(map(_ok, rs))),
                      str(sum(m[2] is not None for m in ms)), str(sum(m[2] is None for m in ms))])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(line, widths)))
                     for line in lines)


def per_kind(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Kind -> how many differences of it were listed / unlisted."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        for m in r["mismatches"]:
            k = out.setdefault(m[0], {"listed": 0, "unlisted": 0})
            k["listed" if m[2] is not None else "unlisted"] += 1
    return dict(sorted(out.items()))


def required_failures(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Requirement -> names of the requests that break it (a listed difference does not count)."""
    out: dict[str, list[str]] = {}
    for r in rows:
        for kind, _, listed in r["mismatches"]:
            if kind in REQUIRED and listed is None and r["name"] not in out.get(REQUIRED[kind], []):
                out.setdefault(REQUIRED[kind], []).append(r["name"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks vllm-diff", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "pagedserve-vllm-diff")
    p.add_argument("--engines", default="vllm,pagedserve", help="which engines to run now (comma-separated)")
    p.add_argument("--compare-only", action="store_true", help="compare the answers already in --out")
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--kv-cache-memory", default="512MiB", help="pagedserve's KV cache")
    p.add_argument("--only", default=None, help="only these categories (comma-separated)")
    p.add_argument("--results", type=Path, default=None,
                   help="also write the summary and every difference found, without the raw answers (docs/results/)")
    args = p.parse_args(argv)
    from pagedserve.common.default_model import resolve_model

    model_dir = str(resolve_model(args.model))
    cases = all_cases()
    if args.only:
        cases = [c for c in cases if c.cat in args.only.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.compare_only:
        for engine in args.engines.split(","):
            res = run_engine(engine, cases, model_dir, args.kv_cache_memory)
            (args.out / f"{engine}.json").write_text(json.dumps(res, indent=1))
            print(f"vllm-diff: {engine}: {len(cases)} requests in {res['seconds']:.0f} s", flush=True)
    ref = json.loads((args.out / "vllm.json").read_text())
    ours = json.loads((args.out / "pagedserve.json").read_text())
    summary = summarize(cases, ref, ours, model_dir)
    (args.out / "diff.json").write_text(json.dumps(summary, indent=1))
    if args.results:
        args.results.write_text(json.dumps(compact(summary), indent=1) + "\n")
    print(table(summary["rows"]))
    for kind, n in summary["per_kind"].items():
        print(f"vllm-diff: {kind}: {n['listed']} listed, {n['unlisted']} unlisted")
    for req, names in summary["required_failures"].items():
        print(f"vllm-diff: {req}: {len(names)} requests differ: {', '.join(names[:12])}")
    for line in summary["unlisted"]:
        print(f"vllm-diff: UNLISTED: {line}"[:400])
    for label in summary["unused"]:
        print(f"vllm-diff: listed in docs/api.md but not seen: {label}")
    print(f"vllm-diff: {summary['matches']}/{summary['requests']} requests match; {len(summary['unlisted'])} "
          f"differences not listed in docs/api.md; details in {args.out / 'diff.json'}")
    return 1 if summary["unlisted"] else 0


def _cpu() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def compact(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary with each difference (request, kind, detail, the docs/api.md reason that lists it, or
    null: unlisted) instead of the per-request rows."""
    table = accepted.load()
    found = [{"request": r["name"], "kind": m[0], "detail": m[1],
              "listed": None if m[2] is None else table[m[2]].reason} for r in summary["rows"] for m in r["mismatches"]]
    return {**{k: v for k, v in summary.items() if k != "rows"}, "differences": found}


def summarize(cases: list[Case], ref: dict[str, Any], ours: dict[str, Any], model: str) -> dict[str, Any]:
    """The whole comparison, judged against docs/api.md's table: what diff.json holds."""
    rows, made = diff(cases, ref, ours)
    verdict = accepted.judge(rows, accepted.load())
    reqs = [r for r in rows if r["cat"] != AFTER_LOAD]
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{_cpu()} ({platform.machine()})", "cpus": len(os.sched_getaffinity(0)), "model": model,
            "baseline": "vLLM 0.32 CPU api_server (.venv-peers), the same requests, one server at a time",
            "requests": len(reqs), "matches": sum(not r["mismatches"] for r in reqs),
            "all_listed": sum(map(_ok, reqs)), "comparisons": dict(made),
            "per_category": {cat: {"requests": len(rs), "match": sum(not r["mismatches"] for r in rs),
                                   "all_listed": sum(map(_ok, rs))}
                             for cat in dict.fromkeys(r["cat"] for r in rows)
                             for rs in [[r for r in rows if r["cat"] == cat]]},
            "per_kind": per_kind(rows), "required_failures": required_failures(rows),
            "unlisted": verdict["unlisted"], "unused": verdict["unused"], "rows": rows}


if __name__ == "__main__":
    sys.exit(main())
