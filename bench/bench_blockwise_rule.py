"""Blockwise's attention rule, measured: how many attention groups each block loses, chosen by each rule, and the
perplexity that gives, on the real models at the calibration sizes the demo and the paper use.

Per (model, seq_len x num_samples): one importance pass (wiki calibration, seed 0) serves every rule; per rule:
prune (blockwise at --sparsity), the attention groups each pruned block lost, the plan's own measured calibration
loss, and the wiki held-out perplexity (first --ppl-windows windows of 128 tokens). The unpruned model's
perplexity is the `unpruned` row.

    python bench/bench_blockwise_rule.py --json bench/blockwise_rule.json
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from taylor_tune.config import BLOCKWISE_ATTENTION_RULES, EvalSpec, PruneConfig
from taylor_tune.evaluation.evaluate import Evaluator
from taylor_tune.jsonio import write_json
from taylor_tune.pruning.prune import ImportanceCache, prune
from taylor_tune.sources.models import load_model, load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b")
    parser.add_argument("--calibrations", default="32x32,64x32,64x128", help="seq_len x num_samples, comma-separated")
    parser.add_argument("--sparsity", type=float, default=0.2)
    parser.add_argument("--rules", default=",".join(BLOCKWISE_ATTENTION_RULES))
    parser.add_argument("--ppl-windows", type=int, default=100)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    rows = []

    def ppl_of(model, tokenizer, name):
        spec = EvalSpec(tasks="piqa", ppl="wiki", ppl_max_windows=args.ppl_windows)
        return Evaluator(model, tokenizer, spec, model_name=name).perplexity().ppl

    for name in args.models.split(","):
        rows.append({"model": name, "rule": "unpruned", "ppl": ppl_of(load_model(name), load_tokenizer(name), name)})
        for calibration in args.calibrations.split(","):
            seq_len, num_samples = map(int, calibration.split("x"))
            cache = ImportanceCache(tempfile.mkdtemp(prefix="bench_blockwise_importance_"))  # one pass per draw

            for rule in args.rules.split(","):
                config = PruneConfig(model=name, method="blockwise", sparsity=args.sparsity, seq_len=seq_len,
                                     num_samples=num_samples, calibration="wiki", device="cpu", dtype="float32",
                                     blockwise_attention=rule)
                start = time.perf_counter()
                result = prune(config, cache=cache)
                seconds = time.perf_counter() - start
                lost = sorted({len(a) for a in result.plan.attn_removed[1:-1]})
                rows.append({"model": name, "rule": rule, "seq_len": seq_len, "num_samples": num_samples,
                             "attention_groups_lost_per_block": lost, "groups_per_block": result.layout.attn_groups[1],
                             "pruning_ratio": result.diagnostics["pruning_ratio"], "prune_s": seconds,
                             "ppl": ppl_of(result.model, result.tokenizer, name)})
                print(rows[-1], flush=True)
                write_json(args.json, {
                    "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
                    "date": time.strftime("%Y-%m-%d"), "sparsity": args.sparsity, "ppl_windows": args.ppl_windows,
                    "rows": rows,
                })


if __name__ == "__main__":
    main()
