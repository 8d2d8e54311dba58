"""What pruning buys, measured: prefill and decode speed, memory and perplexity of pruned real models, each method
at each sparsity with the free (per-layer) layout and the uniform one, against the unpruned model.

One process; per model the importance is computed once (taylor criterion, the real world's Wikipedia text) and
serves every gradient method. The unpruned model is measured first and again last, so that drift of this machine
during the run shows as the difference of the two (the speedups use their mean). Speed settings: --speed, a JSON
object of `taylor_tune.config.SpeedSpec` fields (the rest at their defaults). Perplexity on the held-out Wikipedia
text, first --ppl-windows windows of 128 tokens.

    python bench/bench_speed.py --models smollm2-135m,qwen2.5-0.5b --sparsities 0.2,0.4 \
        --speed '{"prefill_batch": 1, "prefill_len": 256}' --json bench/speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from taylor_tune.config import EvalSpec, PruneConfig, SpeedSpec
from taylor_tune.evaluation.evaluate import Evaluator
from taylor_tune.evaluation.speed import measure_speed, speed_ratios
from taylor_tune.jsonio import write_json
from taylor_tune.pruning.methods import METHODS
from taylor_tune.pruning.prune import ImportanceCache, prune
from taylor_tune.sources.models import load_model, load_tokenizer


def ppl_of(model, tokenizer, name: str, windows: int) -> float:
    spec = EvalSpec(tasks="piqa", ppl="auto", ppl_max_windows=windows)
    return Evaluator(model, tokenizer, spec, model_name=name).perplexity().ppl


def table(results: dict) -> str:
    """One row per (model, sparsity, method): the free layout and the uniform one side by side."""
    lines = ["| model | sparsity | method | layout | reached | ppl | prefill speedup | decode speedup (b1) | "
             "decode speedup (batch) | memory ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["trials"]:
        lines.append(f"| {r['model']} | {r['sparsity']:.0%} | {r['method']} | {'uniform' if r['uniform'] else 'free'} "
                     f"| {r['pruning_ratio']:.3f} | {r['ppl']:.1f} | {r['prefill_speedup']:.2f} | "
                     f"{r['decode_speedup']:.2f} | {r['decode_batch_speedup']:.2f} | {r['memory_ratio']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b")
    parser.add_argument("--sparsities", default="0.2,0.4")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--ppl-windows", type=int, default=40)
    parser.add_argument("--speed", default="{}", help="SpeedSpec fields as a JSON object")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--table", action="store_true", help="print the results in --json as Markdown, run nothing")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.json.read_text())))
        return
    spec = SpeedSpec(**json.loads(args.speed))
    rows, unpruned_runs = [], {}
    for name in args.models.split(","):
        tokenizer = load_tokenizer(name)
        base = load_model(name)
        first = measure_speed(base, spec)
        unpruned_ppl = ppl_of(base, tokenizer, name, args.ppl_windows)
        del base
        cache = ImportanceCache(tempfile.mkdtemp(prefix="bench_speed_importance_"))  # one pass per model

        trials, importance_s = [], None
        for sparsity in map(float, args.sparsities.split(",")):
            for method in args.methods.split(","):
                for uniform in (False, True):
                    config = PruneConfig(model=name, method=method, sparsity=sparsity, seq_len=args.seq_len,
                                         num_samples=args.num_samples, device="cpu", dtype="float32", uniform=uniform)
                    result = prune(config, cache=cache)
                    if result.importance_cache == "computed":
                        importance_s = result.timings["importance_s"]
                    measured = measure_speed(result.model, spec)
                    trials.append({
                        "model": name, "method": method, "sparsity": sparsity, "uniform": uniform,
                        "pruning_ratio": result.diagnostics["pruning_ratio"],
                        "ppl": ppl_of(result.model, result.tokenizer, name, args.ppl_windows), **measured,
                    })
                    print(
                        f"{name} {method} {sparsity} uniform={uniform}: prefill {measured['prefill_tokens_per_s']:.0f}"
                        f" tok/s, decode {measured['decode_tokens_per_s']:.1f} tok/s",
                        flush=True,
                    )
        base = load_model(name)
        last = measure_speed(base, spec)
        del base
        unpruned = {k: statistics.fmean([first[k], last[k]]) for k in first}
        unpruned_runs[name] = {"first": first, "last": last, "ppl": unpruned_ppl,
                               "importance_s": importance_s}
        rows += [t | speed_ratios(t, unpruned) for t in trials]
        write_json(args.json, {
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                        "threads": torch.get_num_threads()},
            "date": time.strftime("%Y-%m-%d"), "speed": spec.model_dump(), "unpruned": unpruned_runs, "trials": rows,
        })


if __name__ == "__main__":
    main()
