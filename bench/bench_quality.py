"""Pruning quality on the real models: every method (and criterion / blockwise-rule variant) at each sparsity.

For each model: one importance pass on wiki calibration (the paper's 128 x 64 by default, seed 0) serves every
Taylor-based run and measures every plan (`salience_removed`: the share of Σ|w·ḡ| the plan removes); then per
(sparsity, method, variant): prune, wiki held-out perplexity, the seven real tasks
at --limit items each (acc, acc_norm, stderr), and the plan's diagnostics (attention groups and MLP channels
kept per layer, extreme layers). The unpruned model is the `unpruned` row. Per model, every run's perplexity comes
first and its zero-shot pass second (perplexity is the cheap, low-noise measure: the verdicts it carries arrive
hours before the accuracies); the zero-shot stage prunes again and checks the plan is the one the perplexity was
measured on. Results go to --json after every stage; a killed run continues with the next unfinished stage (hours
on 2 CPU cores: spread it over sessions).

    python bench/bench_quality.py --json bench/quality.json                       # the full study (hours)
    python bench/bench_quality.py --models smollm2-135m --sparsity 0.2 --methods taylor --limit 2 \\
        --ppl-max-windows 2 --num-samples 4 --json /tmp/q.json                   # a check (a minute)
    python bench/bench_quality.py --json bench/quality.json --table              # the results so far, as Markdown
    python bench/bench_quality.py --json bench/quality.json --figure bench/quality.png   # and as a figure

A variant is `field=value` of the prune config, e.g. `criterion=taylor_sum` or `blockwise_attention=mlp_only`;
it applies to the methods it concerns (criterion: taylor, layerwise, blockwise, and magnitude for l1 or l2;
blockwise_attention: blockwise), or to those named after `@` (`criterion=l2@blockwise`: LLM-Pruner's L2
baseline). The `blockwise` rows use blockwise_attention closest_ratio unless a variant sets it (the product's
default is now measured_loss).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

import torch

from taylor_tune.config import METHOD_CRITERIA, ZERO_SHOT_TASKS, EvalSpec, build_prune_config
from taylor_tune.evaluation.perplexity import perplexity
from taylor_tune.evaluation.scorer import make_lm
from taylor_tune.evaluation.zero_shot import zero_shot
from taylor_tune.jsonio import write_json
from taylor_tune.pruning.groups import describe_layout
from taylor_tune.pruning.importance import compute_importance
from taylor_tune.pruning.prune import ImportanceCache, prune
from taylor_tune.sources.calibration import load_calibration
from taylor_tune.sources.data import load_ppl_text
from taylor_tune.sources.models import load_model, load_tokenizer

VARIANT_METHODS = {
    "criterion": ("taylor", "layerwise", "blockwise", "magnitude"),
    "blockwise_attention": ("blockwise",),
}


def variant_methods(variant: str) -> tuple[str, ...]:
    """The methods a variant applies to: those named after `@`, else those of its setting that use the value (a
    criterion only where the method ranks by it: magnitude takes l1 and l2, not taylor_sum)."""
    setting, _, methods = variant.partition("@")
    if methods:
        return tuple(methods.split(","))
    field, _, value = setting.partition("=")
    return tuple(m for m in VARIANT_METHODS[field] if field != "criterion" or value in METHOD_CRITERIA[m])


def measure_ppl(model, tokenizer, args) -> dict:
    start = time.perf_counter()
    out = perplexity(model, tokenizer, load_ppl_text("wiki"), window=128, max_windows=args.ppl_max_windows)
    out["ppl_s"] = time.perf_counter() - start
    del out["window_nll"]  # the record keeps the summary
    return out


def measure_zero_shot(model, tokenizer, args) -> dict:
    spec = EvalSpec(tasks=list(args.tasks), task_data="real", limit=args.limit, ppl=None, batch_size=16)
    tasks, seconds, _ = zero_shot(make_lm(model, tokenizer, 16), spec, "real")
    return {"tasks": {t: {k: e[k] for k in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "metric", "score",
                                            "score_stderr", "n")} for t, e in tasks.items()},
            "acc_mean": sum(e["score"] for e in tasks.values()) / len(tasks), "zero_shot_s": seconds}


def plan_sha(plan) -> str:
    """The plan's identity: which groups it removes, layer by layer."""
    return hashlib.sha256(repr((plan.attn_removed, plan.mlp_removed)).encode()).hexdigest()[:16]


def salience_removed(scores, layout, plan) -> float:
    """The share of the model's first-order Taylor salience (Σ|w·ḡ| over every group) that the plan removes: one
    yardstick, from the same calibration, for plans made by any criterion."""
    sizes = (layout.attn_group_params, layout.mlp_channel_params)
    total = sum(float(a.sum()) * sizes[0] + float(m.sum()) * sizes[1] for a, m in zip(scores.attn, scores.mlp))
    removed = sum(float(a[list(ra)].sum()) * sizes[0] + float(m[list(rm)].sum()) * sizes[1]
                  for a, m, ra, rm in zip(scores.attn, scores.mlp, plan.attn_removed, plan.mlp_removed))
    return removed / total


def runs(args) -> list[tuple[str, str, float | None, str, str]]:
    """(stage, model, sparsity, method, variant) in order: per model, the ppl stage of every run, then the
    zero-shot stage of every run; the runs are the unpruned row, then per sparsity every method as configured
    by default (variant ""), then the variants."""
    out = []
    for model in args.models:
        model_runs = [(model, None, "unpruned", "")]
        for sparsity in args.sparsity:
            model_runs += [(model, sparsity, method, "") for method in args.methods]
            model_runs += [(model, sparsity, method, variant) for variant in args.variants for method in args.methods
                           if method in variant_methods(variant)]
        out += [(stage, *run) for stage in ("ppl", "zero_shot") for run in model_runs]
    return out


def table(data: dict) -> str:
    """The study so far as a Markdown table (acc_mean ± the stderr of a mean of 7 independent task scores)."""
    from taylor_tune.sources.models import load_model_config

    rows = [
        "| model | sparsity | method | variant | ratio reached | wiki ppl | acc_mean ± se | without BoolQ | "
        "layer ratio min–max | attention groups removed | salience removed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, run in data["runs"].items():
        model, sparsity, method, variant = key.split("|")
        tasks = run.get("tasks")
        acc = (f"{run['acc_mean']:.4f} ± {sum(e['score_stderr'] ** 2 for e in tasks.values()) ** 0.5 / len(tasks):.4f}"
               if tasks else "pending")
        # BoolQ swings by ±0.15 between plans of these small models (it sits near its majority-class rate), and
        # alone can reorder the acc_mean; the six-task mean shows the order without it.
        rest = [e["score"] for task, e in (tasks or {}).items() if not task.startswith("boolq")]
        without_boolq = f"{sum(rest) / len(rest):.4f}" if rest else "–"
        ratios, kept = run.get("layer_pruning_ratio"), run.get("attention_groups_kept")
        groups = load_model_config(model).num_key_value_heads  # per layer, before pruning
        rows.append(f"| {model} | {sparsity if sparsity != 'None' else '–'} | {method} | {variant or '–'} | "
                    f"{run.get('pruning_ratio', 0):.4f} | {run['ppl']:.2f} | {acc} | {without_boolq} | "
                    + (f"{min(ratios):.2f}–{max(ratios):.2f}" if ratios else "–") + " | "
                    + (f"{groups * len(kept) - sum(kept)} of {groups * len(kept)}" if kept else "–") + " | "
                    + (f"{run['salience_removed']:.3f}" if "salience_removed" in run else "–") + " |")
    return "\n".join(rows)


def figure(data: dict, path: Path) -> None:
    """Per model and sparsity, one row of two panels: wiki ppl (log scale) and acc_mean with its 95% interval, per
    method and variant (the unpruned model as a line)."""
    from matplotlib.figure import Figure

    runs = [(tuple(k.split("|")), v) for k, v in data["runs"].items()]
    panels = sorted(
        {(m, s) for (m, s, method, _), _ in runs if method != "unpruned"}, key=lambda p: (p[0], -float(p[1]))
    )
    fig = Figure(figsize=(12, 3.2 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 2, squeeze=False)
    for (model, sparsity), (ax_ppl, ax_acc) in zip(panels, axes):
        rows = [(f"{method}" + (f"\n{variant}" if variant else ""), run) for (m, s, method, variant), run in runs
                if m == model and s == sparsity]
        base = next((run for (m, _, method, _), run in runs if m == model and method == "unpruned"), None)
        x = range(len(rows))
        # a run whose zero-shot stage is still pending has no accuracy bar yet
        se = [1.96 * sum(e["score_stderr"] ** 2 for e in run["tasks"].values()) ** 0.5 / len(run["tasks"])
              if "tasks" in run else 0.0 for _, run in rows]
        ax_ppl.bar(x, [run["ppl"] for _, run in rows], color="tab:blue")
        ax_ppl.set_yscale("log")
        ax_acc.bar(x, [run.get("acc_mean", 0.0) for _, run in rows], yerr=se, capsize=3, color="tab:green")
        for ax, key, label in ((ax_ppl, "ppl", "wiki ppl (log)"), (ax_acc, "acc_mean", "acc_mean ± 95% CI")):
            if base is not None and key in base:
                ax.axhline(base[key], color="black", linestyle="--", linewidth=1, label="unpruned")
                ax.legend(fontsize=7)
            ax.set_xticks(list(x), [name for name, _ in rows], rotation=60, ha="right", fontsize=7)
            ax.set_ylabel(label)
            ax.set_title(f"{model}, sparsity {sparsity}", fontsize=9)
        ax_acc.set_ylim(0.3, max(0.5, max(run.get("acc_mean", 0.0) for _, run in rows) + 0.05))
    fig.savefig(path, dpi=110)


MEASUREMENT = ("seq_len", "num_samples", "limit", "ppl_max_windows", "tasks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b"])
    parser.add_argument("--sparsity", nargs="+", type=float, default=[0.1, 0.2])
    parser.add_argument("--methods", nargs="+", default=["taylor", "layerwise", "blockwise", "magnitude", "random"])
    parser.add_argument(
        "--variants",
        nargs="*",
        default=[
            "criterion=taylor_sum@taylor,layerwise,blockwise",
            "blockwise_attention=mlp_only",
            "blockwise_attention=min_loss",
            "criterion=l2@blockwise",
            "criterion=l1@blockwise,magnitude",
        ],
    )
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--ppl-max-windows", type=int, default=400, help="400 windows of 128 = 50,800 scored tokens")
    parser.add_argument("--tasks", nargs="+", default=list(ZERO_SHOT_TASKS))
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument(
        "--table", action="store_true", help="print the results in --json as a Markdown table, run nothing"
    )
    parser.add_argument("--figure", type=Path, help="draw the results in --json to this PNG, run nothing")
    args = parser.parse_args()
    if args.table or args.figure:
        data = json.loads(args.json.read_text())
        if args.table:
            print(table(data))
        if args.figure:
            figure(data, args.figure)
        return
    for variant in args.variants:
        if variant.split("=")[0] not in VARIANT_METHODS or "=" not in variant.partition("@")[0]:
            parser.error(f"--variants: {variant!r} is not field=value with field one of {', '.join(VARIANT_METHODS)}")

    data = json.loads(args.json.read_text()) if args.json.is_file() else {}
    # what makes two runs comparable; which models, methods and variants to run is each invocation's own choice
    settings = {k: getattr(args, k) for k in MEASUREMENT}
    differ = [k for k in MEASUREMENT if k in data.get("settings", {}) and data["settings"][k] != settings[k]]
    if differ:
        parser.error(f"{args.json} holds runs measured with " + ", ".join(f"{k} {data['settings'][k]}" for k in differ)
                     + "; measure other settings into another --json")
    data["settings"] = settings
    data.setdefault("runs", {})
    importance: dict[str, object] = {}
    cache_dir = tempfile.mkdtemp(prefix="bench_quality_importance_")
    for stage, model_name, sparsity, method, variant in runs(args):
        key = f"{model_name}|{sparsity}|{method}|{variant.partition('@')[0]}"
        entry = data["runs"].get(key, {})
        if ("ppl" if stage == "ppl" else "tasks") in entry:
            continue
        start = time.perf_counter()
        if method == "unpruned":
            model, tokenizer = load_model(model_name, dtype=torch.float32), load_tokenizer(model_name)
            pruned = {"params_count": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())}
        else:
            values = dict(model=model_name, method=method, sparsity=sparsity, seq_len=args.seq_len,
                          num_samples=args.num_samples, calibration="wiki", seed=0, device="cpu", dtype="float32")
            if method == "blockwise":
                # The study's blockwise rows keep the rule they were measured with (closest_ratio, the default until
                # this study chose min_loss); the blockwise_attention variants measure the other rules.
                values["blockwise_attention"] = "closest_ratio"
            if variant:
                field, value = variant.partition("@")[0].split("=")
                values[field] = value
            config = build_prune_config(values)

            if model_name not in importance:  # one gradient pass per model: every run's scores or yardstick
                base, base_tokenizer = load_model(model_name, dtype=torch.float32), load_tokenizer(model_name)
                ids = load_calibration(
                    base_tokenizer, "wiki", seq_len=args.seq_len, num_samples=args.num_samples, seed=0
                )
                importance[model_name] = (
                    compute_importance(base, describe_layout(base), ids, micro_batch_size=8)[args.num_samples],
                    ids,
                )
                del base
            # the gradient methods' pass: one per model and calibration through the importance service's cache
            result = prune(config, cache=ImportanceCache(cache_dir))
            model, tokenizer, d = result.model, result.tokenizer, result.diagnostics
            pruned = {
                k: d[k]
                for k in (
                    "params_count",
                    "pruning_ratio",
                    "extreme_pruning_layers",
                    "attention_groups_kept",
                    "mlp_channels_kept",
                    "layer_pruning_ratio",
                )
            }
            pruned["salience_removed"] = salience_removed(importance[model_name][0].scores, result.layout, result.plan)
            pruned["plan_sha"] = plan_sha(result.plan)
            if entry.get("plan_sha", pruned["plan_sha"]) != pruned["plan_sha"]:
                raise SystemExit(
                    f"{key}: the plan differs from the one its perplexity was measured on "
                    f"({pruned['plan_sha']} against {entry['plan_sha']}); delete the run from {args.json} to redo it"
                )
        entry |= pruned | (
            measure_ppl(model, tokenizer, args) if stage == "ppl" else measure_zero_shot(model, tokenizer, args)
        )
        entry[f"{stage}_stage_s"] = time.perf_counter() - start
        data["runs"][key] = entry
        write_json(args.json, data)
        shown = f"ppl {entry['ppl']:.2f}" if stage == "ppl" else f"acc_mean {entry['acc_mean']:.4f}"
        print(f"{key} [{stage}]: {shown} ({entry[f'{stage}_stage_s']:.0f} s)", flush=True)
        del model


if __name__ == "__main__":
    main()
