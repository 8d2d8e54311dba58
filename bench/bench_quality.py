"""Pruning quality on the real models: every method (and criterion / blockwise-rule variant) at each sparsity.

For each model: one importance pass on wiki calibration (the paper's 128 x 64 by default, seed 0) serves every
Taylor-based run; then per (sparsity, method, variant): prune, wiki held-out perplexity, the seven real tasks
at --limit items each (acc, acc_norm, stderr), and the plan's diagnostics (attention groups and MLP channels
kept per layer, extreme layers). The unpruned model is the `unpruned` row. Results go to --json after every
run; a killed run continues with the next unfinished one (hours on 2 CPU cores: spread it over sessions).

    python bench/bench_quality.py --json bench/quality.json                       # the full study (hours)
    python bench/bench_quality.py --models smollm2-135m --sparsity 0.2 --methods taylor --limit 2 \\
        --ppl-max-windows 2 --num-samples 4 --json /tmp/q.json                   # a check (a minute)

A variant is `field=value` of the prune config, e.g. `criterion=taylor_sum` or `blockwise_attention=mlp_only`;
it applies to the methods it concerns (criterion: taylor, layerwise, blockwise; blockwise_attention: blockwise).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from taylor_tune.calibration import load_calibration
from taylor_tune.config import ZERO_SHOT_TASKS, EvalSpec, build_prune_config
from taylor_tune.evaluation import load_ppl_text, make_lm, perplexity, zero_shot
from taylor_tune.importance import compute_importance
from taylor_tune.models import load_model, load_tokenizer
from taylor_tune.prune import prune

VARIANT_METHODS = {"criterion": ("taylor", "layerwise", "blockwise"), "blockwise_attention": ("blockwise",)}


def save(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def evaluate_model(model, tokenizer, args) -> dict:
    start = time.perf_counter()
    out = perplexity(model, tokenizer, load_ppl_text("wiki"), window=128, max_windows=args.ppl_max_windows)
    out["ppl_s"] = time.perf_counter() - start
    spec = EvalSpec(tasks=list(args.tasks), task_data="real", limit=args.limit, ppl=None, batch_size=16)
    tasks, seconds = zero_shot(make_lm(model, tokenizer, 16), spec, "real")
    out["tasks"] = {t: {k: e[k] for k in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "metric", "score", "score_stderr", "n")}
                    for t, e in tasks.items()}
    out["acc_mean"] = sum(e["score"] for e in tasks.values()) / len(tasks)
    out["zero_shot_s"] = seconds
    return out


def runs(args) -> list[tuple[str, float | None, str, str]]:
    """(model, sparsity, method, variant) in order; variant "" is the default config."""
    out = []
    for model in args.models:
        out.append((model, None, "unpruned", ""))
        for sparsity in args.sparsity:
            for method in args.methods:
                out.append((model, sparsity, method, ""))
                for variant in args.variants:
                    if method in VARIANT_METHODS[variant.split("=")[0]]:
                        out.append((model, sparsity, method, variant))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b"])
    parser.add_argument("--sparsity", nargs="+", type=float, default=[0.1, 0.2])
    parser.add_argument("--methods", nargs="+", default=["taylor", "layerwise", "blockwise", "magnitude", "random"])
    parser.add_argument("--variants", nargs="*", default=["criterion=taylor_sum", "blockwise_attention=mlp_only",
                                                          "blockwise_attention=min_loss"])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--ppl-max-windows", type=int, default=400, help="400 windows of 128 = 50,800 scored tokens")
    parser.add_argument("--tasks", nargs="+", default=list(ZERO_SHOT_TASKS))
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    for variant in args.variants:
        if variant.split("=")[0] not in VARIANT_METHODS or "=" not in variant:
            parser.error(f"--variants: {variant!r} is not field=value with field one of {', '.join(VARIANT_METHODS)}")

    data = json.loads(args.json.read_text()) if args.json.is_file() else {}
    data["settings"] = {k: v for k, v in vars(args).items() if k != "json"}
    data.setdefault("runs", {})
    importance: dict[str, object] = {}
    for model_name, sparsity, method, variant in runs(args):
        key = f"{model_name}|{sparsity}|{method}|{variant}"
        if key in data["runs"]:
            continue
        start = time.perf_counter()
        if method == "unpruned":
            model, tokenizer = load_model(model_name, dtype=torch.float32), load_tokenizer(model_name)
            entry = {"params_count": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())}
        else:
            values = dict(model=model_name, method=method, sparsity=sparsity, seq_len=args.seq_len,
                          num_samples=args.num_samples, calibration="wiki", seed=0, device="cpu", dtype="float32")
            if variant:
                field, value = variant.split("=")
                values[field] = value
            config = build_prune_config(values)

            def provide(model, layout, tokenizer):  # one gradient pass per model, shared by every run
                if model_name not in importance:
                    ids = load_calibration(tokenizer, "wiki", seq_len=args.seq_len, num_samples=args.num_samples, seed=0)
                    importance[model_name] = (compute_importance(model, layout, ids, micro_batch_size=8)[args.num_samples], ids)
                return importance[model_name]

            result = prune(config, importance_provider=provide)
            model, tokenizer, d = result.model, result.tokenizer, result.diagnostics
            entry = {k: d[k] for k in ("params_count", "pruning_ratio", "extreme_pruning_layers", "attention_groups_kept",
                                       "mlp_channels_kept", "layer_pruning_ratio")}
        entry |= evaluate_model(model, tokenizer, args)
        entry["seconds"] = time.perf_counter() - start
        data["runs"][key] = entry
        save(args.json, data)
        print(f"{key}: ppl {entry['ppl']:.2f}, acc_mean {entry['acc_mean']:.4f} ({entry['seconds']:.0f} s)", flush=True)
        del model


if __name__ == "__main__":
    main()
