"""``python -m benchmarks peers``: output tokens/s of pagedserve against other
engines on the same machine, in one run, on the same seeded workload.

Engines: pagedserve through its real gRPC server (``pagedserve serve`` as a
subprocess), transformers' continuous batching in process, and vLLM's CPU
build (offline ``LLM.generate``) in ``.venv-peers`` when that venv exists
(``scripts/setup-peers.sh``). Every engine gets identical prompt token ids
and output lengths, all requests at once, greedy, EOS ignored, fp32 (or
``--dtype bfloat16`` for every engine). Each
engine loads once; the rounds interleave the engines in a rotated order, so
slow drift of a shared machine falls on all of them. A run's time is from
the first submit to the last token. Greedy outputs are compared across
engines (a mismatch is reported, not hidden). ``--text`` times the text path
instead of ids only: every engine detokenizes inside its timed run, and the
texts of requests whose ids agree are compared too. Prints a table of medians and
the median per-round ratios, a ``BENCH_PEERS_JSON {...}`` line, and writes a
PNG bar chart to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.peer_engines import (PEERS_VENV, Engine, HFEngine, PagedserveEngine, RunResult, VllmEngine,
                                           Work, set_paused)
from benchmarks.peer_slices import ReadProbe, sliced_round
from benchmarks.roofline import bound_seconds, model_shape
from pagedserve.bench.workloads import machine_info, sample_lengths, synthetic_prompt

# Output/prompt scale per workload: ShareGPT x0.25 keeps a CPU run to minutes
# (about 5,900 output tokens over 64 requests at seed 0); Alpaca is short already.
SCALES = {"sharegpt": 0.25, "alpaca": 1.0, "long": 1.0, "fixed": 1.0}
# The fixed workload: every request FIXED_PROMPT_TOKENS of prompt and --max-output (default
# FIXED_OUTPUT_TOKENS) output tokens, so a run's decode steps all have --requests rows: one
# engine's step at one batch size against another's.
FIXED_PROMPT_TOKENS, FIXED_OUTPUT_TOKENS = 64, 128
# The long-prompt workload (issue 23): every prompt is one shared system prompt
# plus its own 500-1,000 tokens (1,500-2,000 in all), 128 output tokens each;
# it exercises prefill, attention over long contexts and prefix caching.
LONG_SYSTEM_TOKENS, LONG_OWN_TOKENS, LONG_OUTPUT_TOKENS = 1000, (500, 1000), 128
# pagedserve-async / -sync: --async-scheduling on / off (the default is auto: on with CUDA only)
ENGINES = ("pagedserve", "pagedserve-async", "pagedserve-sync", "hf", "vllm")
DEFAULT_ENGINES = ("pagedserve", "hf", "vllm")
ADAPTIVE = "PAGEDSERVE_WORKER_ADAPTIVE"  # gpuworker/cpu_contention.py's switch
PROBE_S = 2.0  # --roofline without --slice: the probe's time alone before and after each run


def build_workload(name: str, n: int, seed: int, vocab: int, max_len: int, max_output: int | None) -> Work:
    """Prompt ids and output lengths, scaled, capped so prompt + output < max_len."""
    if name == "long":
        return long_prompt_workload(n, seed, vocab, max_output)
    if name == "fixed":
        return [(synthetic_prompt(FIXED_PROMPT_TOKENS, seed * 1_000_003 + i, vocab), max_output or FIXED_OUTPUT_TOKENS)
                for i in range(n)]
    scale = SCALES[name]
    work = []
    for i, r in enumerate(sample_lengths(name, n, seed)):
        p = max(1, min(round(r.prompt_len * scale), max_len // 2))
        o = max(1, round(r.output_len * scale))
        o = min(o, max_output or o, max_len - 1 - p)
        work.append((synthetic_prompt(p, seed * 1_000_003 + i, vocab), o))
    return work


def long_prompt_workload(n: int, seed: int, vocab: int, max_output: int | None) -> Work:
    import random

    rng = random.Random(seed)
    system = synthetic_prompt(LONG_SYSTEM_TOKENS, seed * 7 + 1, vocab)
    out = min(LONG_OUTPUT_TOKENS, max_output or LONG_OUTPUT_TOKENS)
    return [(system + synthetic_prompt(rng.randint(*LONG_OWN_TOKENS), seed * 1_000_003 + i, vocab), out)
            for i in range(n)]


def greedy_agreement(ref: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """How many requests produced identical ids; where the others first diverged."""
    first_diff = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                  for x, y in zip(ref, other) if x != y]
    return {"identical": len(ref) - len(first_diff), "of": len(ref), "first_divergence": first_diff}


def text_agreement(ref_ids: list[list[int]], ref: list[str], ids: list[list[int]], texts: list[str]) -> dict[str, int]:
    """Of the requests whose ids agree, how many texts agree (the same ids must give
    the same text), up to an incomplete last character: pagedserve and vLLM hold
    back bytes that do not form a character yet, transformers' decode shows U+FFFD."""
    same = [i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a == b]
    return {"identical": sum(ref[i].rstrip("\ufffd") == texts[i].rstrip("\ufffd") for i in same), "of": len(same)}


def rotated(names: list[str], r: int) -> list[str]:
    k = r % len(names)
    return names[k:] + names[:k]


def _model_limits(model_dir: str) -> tuple[int, int]:
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(model_dir).get_text_config()
    vocab = min(len(AutoTokenizer.from_pretrained(model_dir)), cfg.vocab_size)
    # 4,096 holds the long-prompt workload (up to 2,000 + 128 tokens).
    return vocab, min(int(getattr(cfg, "max_position_embeddings", 2048) or 2048), 4096)


def _chart(path: Path, res: dict[str, Any]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench peers: matplotlib is not installed; no chart")
        return None
    try:
        names = res["engines"]
        wls = list(res["workloads"])
        fig, ax = plt.subplots(figsize=(2.2 + 1.8 * len(wls) * len(names) / 2, 3.6))
        width = 0.8 / len(names)
        for k, e in enumerate(names):
            med = [res["workloads"][w]["engines"][e]["median_tok_s"] for w in wls]
            lo = [m - res["workloads"][w]["engines"][e]["min_tok_s"] for m, w in zip(med, wls)]
            hi = [res["workloads"][w]["engines"][e]["max_tok_s"] - m for m, w in zip(med, wls)]
            xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(wls))]
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=res["labels"][e])
        ax.set_xticks(range(len(wls)), [f"{w} ({res['workloads'][w]['requests']} req)" for w in wls])
        ax.set_ylabel("output tokens/s (median, min-max)")
        ax.set_title(f"{res['model']}, {res['dtype']}, greedy; {res['machine'][:60]}", fontsize=8)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return str(path)
    except Exception as e:  # noqa: BLE001 - the numbers are already printed; a chart must not fail the run
        print(f"bench peers: chart not written: {type(e).__name__}: {e}")
        return None


def _summarize(times: dict[str, dict[str, list[float]]], work: dict[str, Work], names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for w, per in times.items():
        tokens = sum(o for _, o in work[w])
        tps = {e: [tokens / t for t in per[e]] for e in names}
        eng = {e: {"median_tok_s": statistics.median(v), "min_tok_s": min(v), "max_tok_s": max(v),
                   "tok_s": v, "seconds": per[e]} for e, v in tps.items()}
        ratios = {}
        if "pagedserve" in names:
            for e in names:
                if e != "pagedserve":  # paired per round, then the median
                    ratios[f"pagedserve/{e}"] = statistics.median(a / b for a, b in zip(tps["pagedserve"], tps[e]))
        out[w] = {"requests": len(work[w]), "output_tokens": tokens, "prompt_tokens": sum(len(p) for p, _ in work[w]),
                  "engines": eng, "median_ratio": ratios}
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--workload", default="sharegpt,alpaca", help="comma list of sharegpt, alpaca, long (32 requests of 1,500-2,000 prompt tokens sharing a "
                        "1,000-token system prompt, 128 output tokens: use --requests 32), fixed (64 prompt and "
                        "--max-output output tokens each, default 128)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="every engine's weights and KV")
    p.add_argument("--max-output", type=int, default=None, help="cap every request's output length")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                   help="comma list of pagedserve, pagedserve-async, pagedserve-sync (async scheduling on, off), hf, vllm")
    p.add_argument("--out", default="out/bench-peers", help="folder for the PNG and the JSON")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra `pagedserve serve` argument (repeatable, later wins), e.g. --serve-arg=--max-num-seqs=64")
    p.add_argument("--peers-python", default=str(PEERS_VENV / "bin" / "python"), help="python of the vLLM venv")
    p.add_argument("--fresh", action="store_true", help="each round starts every engine anew (one workload): "
                   "no prefix cache or warm state carried between rounds")
    p.add_argument("--text", action="store_true", help="the text path: every engine detokenizes in its timed run")
    p.add_argument("--slice", type=float, default=None, metavar="S",
                   help="time-sliced rounds: the engines run each workload at once, S seconds each in turn (the "
                        "others SIGSTOPped); an engine's time is the sum of its slices (benchmarks/peer_slices.py)")
    p.add_argument("--roofline", nargs="?", const="1b", choices=("1b", "smol"), default=None,
                   help="a read-rate probe (a decode step of this shape's bf16 panels at one row, default 1b) "
                        "runs alone for 2 s before and after each engine's round (with --slice: a slice of its own "
                        "in each turn); each round gets its least time at that rate (benchmarks/roofline.py)")
    args = p.parse_args(argv)
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    wls = [w.strip() for w in args.workload.split(",") if w.strip()]
    if unknown := [e for e in names if e not in ENGINES] + [w for w in wls if w not in SCALES]:
        p.error(f"unknown engine or workload: {unknown}")
    if args.repeats < 1 or args.requests < 1:
        p.error("--repeats and --requests must be positive")
    if args.slice is not None and (args.slice <= 0 or "hf" in names):
        p.error("--slice takes a positive number of seconds, and engines with processes of their own (not hf)")

    from pagedserve.common.default_model import resolve_model

    model_dir = resolve_model(args.model)
    vocab, max_len = _model_limits(model_dir)
    work = {w: build_workload(w, args.requests, args.seed, vocab, max_len, args.max_output) for w in wls}
    skipped: dict[str, str] = {}
    if "vllm" in names and not VllmEngine.available(Path(args.peers_python)):
        skipped["vllm"] = f"{args.peers_python} not found (run scripts/setup-peers.sh)"
        print(f"bench peers: vLLM skipped: {skipped['vllm']}")
        names.remove("vllm")
    # The KV pool gets what vLLM gets (VLLM_CPU_KVCACHE_SPACE=4): the CPU default
    # (256 MiB) would preempt a 64-request ShareGPT-like batch. --serve-arg overrides.
    serve_args = ["--device", "cpu", "--dtype", args.dtype, "--kv-cache-memory", "4GiB", *args.serve_arg]
    def make(e: str) -> Engine:
        print(f"bench peers: starting {e}", file=sys.stderr, flush=True)
        if e == "pagedserve":
            return PagedserveEngine(args.model, work, serve_args, text=args.text)
        if e in ("pagedserve-async", "pagedserve-sync"):
            return PagedserveEngine(args.model, work, serve_args, async_scheduling=e == "pagedserve-async",
                                    text=args.text)
        if e == "hf":
            return HFEngine(model_dir, work, args.dtype, text=args.text)
        return VllmEngine(model_dir, work, max_len, Path(args.peers_python), args.dtype, text=args.text)

    engines: dict[str, Engine] = {}
    probe: ReadProbe | None = None
    # --roofline: each engine's rounds' read rates and least times
    bounds: dict[str, dict[str, list[dict[str, float]]]] = {w: {e: [] for e in names} for w in wls}
    governor = os.environ.get(ADAPTIVE)
    if args.slice is not None:  # a step stopped midway reads as contention to the CPU worker's thread governor
        os.environ[ADAPTIVE] = "0"  # for the servers started below; restored after
    try:
        for e in names:
            eng = make(e)
            try:
                eng.start()
            except Exception as exc:  # noqa: BLE001 - vLLM is optional; the others must start
                eng.close()
                if e != "vllm":
                    raise
                skipped["vllm"] = f"did not start: {exc}"[:2000]
                print(f"bench peers: vLLM skipped: {skipped['vllm']}")
                continue
            engines[e] = eng
            if isinstance(eng, PagedserveEngine):
                eng.log_path = Path(args.out) / f"{e}-server.log"
        names = [e for e in names if e in engines]
        times = {w: {e: [] for e in names} for w in wls}
        outputs: dict[str, dict[str, list[list[list[int]]]]] = {w: {e: [] for e in names} for w in wls}
        texts: dict[str, dict[str, list[str] | None]] = {w: {} for w in wls}  # each engine's first run
        print("bench peers: the engines not being measured are paused (SIGSTOP)", file=sys.stderr, flush=True)

        def fresh(e: str, r: int) -> None:
            """A new process of ``e`` for round ``r``: no cache or warm state from the last round."""
            set_paused(engines[e], False)  # a stopped process would not see its close
            engines[e].close()
            engines[e] = make(e)
            engines[e].start()
            if isinstance(engines[e], PagedserveEngine):
                engines[e].log_path = Path(args.out) / f"{e}-server-{r + 1}.log"

        def record(w: str, e: str, r: int, run: RunResult, seconds: float, how: str = "") -> None:
            times[w][e].append(seconds)
            outputs[w][e].append(run.ids)
            texts[w].setdefault(e, run.texts)
            print(f"bench peers: round {r + 1}/{args.repeats} {w} {e}: {seconds:.2f} s{how}", file=sys.stderr,
                  flush=True)

        def bound(w: str, who: list[str], first: int) -> None:
            """--roofline: the least time of ``w`` at the probe's rate over its samples from ``first``,
            for the runs of ``who`` (a sliced round's engines share one)."""
            rate = {"read_gb_s": probe.rate_since(first), "peak_gflop_s": probe.peak_gflop_s}
            least = bound_seconds([(len(ids), o) for ids, o in work[w]], model_shape(model_dir), rate)["total_s"]
            for e in who:
                bounds[w][e].append({**rate, "bound_s": least})
            print(f"bench peers: {w} {', '.join(who)}: probe read {rate['read_gb_s']:.1f} GB/s, least time "
                  f"{least:.2f} s", file=sys.stderr, flush=True)

        for r in range(args.repeats):
            for w in wls:
                order = rotated(names, r)
                if args.roofline and probe is None:
                    probe = ReadProbe(args.roofline)
                if args.slice is not None:
                    for e in order if args.fresh and r > 0 else []:  # all before the round: they run it at once
                        fresh(e, r)
                    first = len(probe.samples) if probe else 0
                    for e, (run, secs) in sliced_round(engines, order, w, args.slice, probe).items():
                        record(w, e, r, run, secs, f" in its slices ({run.seconds:.2f} s of wall clock)")
                    if probe is not None:
                        bound(w, order, first)
                    continue
                for e in order:
                    if args.fresh and r > 0:
                        fresh(e, r)
                    if probe is not None:  # the probe alone just before and just after the run
                        for other in names:
                            set_paused(engines[other], True)
                        first = len(probe.samples)
                        probe.sample(PROBE_S)
                    for other in names:
                        set_paused(engines[other], other != e)
                    run = engines[e].run(w)
                    record(w, e, r, run, run.seconds)
                    if probe is not None:
                        set_paused(engines[e], True)
                        probe.sample(PROBE_S)
                        bound(w, [e], first)
    finally:
        for eng in engines.values():
            set_paused(eng, False)  # a stopped process would not see its close
            eng.close()
        if probe is not None:
            probe.close()
        if governor is None:
            os.environ.pop(ADAPTIVE, None)
        else:
            os.environ[ADAPTIVE] = governor

    summary = _summarize(times, work, names)
    ref = names[0]
    for w in wls:
        summary[w]["greedy_reference"] = ref
        summary[w]["greedy_match"] = {e: greedy_agreement(outputs[w][ref][0], outputs[w][e][0])
                                      for e in names if e != ref}
        if args.text:
            summary[w]["text_match"] = {e: text_agreement(outputs[w][ref][0], texts[w][ref] or [], outputs[w][e][0],
                                                          texts[w][e] or []) for e in names if e != ref}
            summary[w]["text_chars_by_engine"] = {e: sum(map(len, texts[w][e] or [])) for e in names}
        # Runs of one engine that differ from its own first run (batching nondeterminism).
        summary[w]["unstable_runs"] = {e: sum(o != outputs[w][e][0] for o in outputs[w][e][1:]) for e in names}
        summary[w]["output_tokens_by_engine"] = {e: sum(map(len, outputs[w][e][0])) for e in names}
        if any(bounds[w].values()):  # an engine's share of each round's least time; the lead an engine at it would have
            shares = {e: [b["bound_s"] / t for b, t in zip(bounds[w][e], times[w][e])] for e in names}
            summary[w]["roofline"] = {"rounds": bounds[w], "share_of_bound": shares,
                                      "lead_at_the_bound": {e: statistics.median(1 / x for x in v)
                                                            for e, v in shares.items()}}
    labels = {e: engines[e].label for e in names}
    gaps = {e: g for e in names if (g := getattr(engines[e], "idle_gaps", ""))}
    res: dict[str, Any] = {"bench": "peers", "machine": machine_info(), "model": os.path.basename(model_dir.rstrip("/")),
                           "dtype": args.dtype, "text": args.text, "seed": args.seed, "repeats": args.repeats,
                           "engines": names,
                           "labels": labels, "skipped": skipped, "serve_args": serve_args, "workloads": summary,
                           "worker_idle_between_steps": gaps}
    _print_table(res)
    out = Path(args.out)
    res["chart"] = _chart(out / "bench-peers.png", res)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench-peers.json").write_text(json.dumps(res, indent=1))
    except OSError as e:
        print(f"bench peers: {out / 'bench-peers.json'} not written: {e}")
    print("BENCH_PEERS_JSON " + json.dumps(res))
    return 0


def _print_table(res: dict[str, Any]) -> None:
    print(f"bench peers on {res['machine']}: {res['model']}, {res['dtype']}, greedy, EOS ignored, "
          f"{'text (detokenized)' if res['text'] else 'ids only'}, {res['repeats']} interleaved rounds")
    for w, s in res["workloads"].items():
        print(f"\n{w}-like (x{SCALES[w]}): {s['requests']} requests at once, {s['prompt_tokens']} prompt / "
              f"{s['output_tokens']} output tokens")
        print(f"  {'engine':<38}{'median tok/s':>13}{'min':>9}{'max':>9}")
        for e, v in s["engines"].items():
            print(f"  {res['labels'][e]:<38}{v['median_tok_s']:>13.1f}{v['min_tok_s']:>9.1f}{v['max_tok_s']:>9.1f}")
        for k, v in s["median_ratio"].items():
            print(f"  median ratio {k}: {v:.2f}x")
        for e, v in s.get("roofline", {}).get("lead_at_the_bound", {}).items():
            share = statistics.median(s["roofline"]["share_of_bound"][e])
            print(f"  {res['labels'][e]}: {share:.0%} of the least time (median); an engine at it: {v:.2f}x")
        for e, m in s["greedy_match"].items():
            flag = "" if m["identical"] == m["of"] else "  GREEDY MISMATCH"
            print(f"  greedy ids {s['greedy_reference']} vs {e}: {m['identical']}/{m['of']} requests identical{flag}")
        for e, m in s.get("text_match", {}).items():
            flag = "" if m["identical"] == m["of"] else "  TEXT MISMATCH"
            print(f"  text {s['greedy_reference']} vs {e}: {m['identical']}/{m['of']} of the requests with identical "
                  f"ids{flag}")
    for e, g in res.get("worker_idle_between_steps", {}).items():
        print(f"  {res['labels'][e]}: worker {g}")
    for e, why in res["skipped"].items():
        print(f"  {e}: skipped ({why.splitlines()[0] if why else ''})")
