"""Does recovery change which configuration is best? SmolLM2-135M pruned by each method at each sparsity, then left
as it is, recovered with `ce` or with `kd` (the same steps and tokens), each scored by held-out wiki perplexity.

Per run: the perplexity on the first --windows windows of 128 tokens of the held-out articles (never trained on),
the recovery's held-out loss before and after, and seconds per recovery step on this machine. Then, per sparsity
and loss, Kendall's tau between the configurations' ranking unrecovered and recovered (scipy), with a bootstrap
interval over the configurations. With --eval-limit N, the two configurations best by perplexity before recovery
at each of --eval-sparsities are also scored on the seven real tasks at N items per task, unrecovered and after each
loss (the recovered model is scored in memory, right after its recovery). Rerunning skips measured runs (--json is
the record).

    .venv/bin/python bench/bench_recovery.py --json bench/recovery.json              # ~30 min on 2 cores
    .venv/bin/python bench/bench_recovery.py --json bench/recovery_2h.json --steps 50 --eval-limit 300  # ~2 h
    .venv/bin/python bench/bench_recovery.py --json bench/recovery.json --table      # the Markdown table
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import time
from pathlib import Path

import pandas as pd
import torch

from taylor_tune.config import EvalSpec, PruneConfig, RecoverySpec
from taylor_tune.evaluation.evaluate import Evaluator
from taylor_tune.evaluation.perplexity import perplexity
from taylor_tune.jsonio import write_json
from taylor_tune.pruning.prune import ImportanceCache, prune
from taylor_tune.recovery.train import recover
from taylor_tune.reporting import stats
from taylor_tune.reporting.stats import kendall_tau as kendall
from taylor_tune.sources.data import load_ppl_text
from taylor_tune.sources.models import load_model
from taylor_tune.sources.recovery_data import heldout_ids, recovery_ids


def zero_shot(model, tokenizer, model_name: str, limit: int) -> dict:
    spec = EvalSpec(task_data="real", limit=limit, ppl=None)
    shots = Evaluator(model, tokenizer, spec, model_name=model_name).zero_shot(limit)
    return {"acc_mean": shots.acc_mean, "zero_shot_s": shots.seconds,
            "tasks": {t: {k: e[k] for k in ("score", "score_stderr", "n", "metric")} for t, e in shots.tasks.items()}}


def acc_mean_stderr(tasks: dict) -> float:
    """acc_mean's stderr as the report computes it (`stats.acc_mean_stderr`: the tasks' stderrs as independent)."""
    row = pd.DataFrame([{f"acc_{t}_stderr": e["score_stderr"] for t, e in tasks.items()}])
    return float(stats.acc_mean_stderr(row, tuple(tasks)).iloc[0])


def measure(args, model_name: str, sparsity: float, method: str, loss: str, cache: ImportanceCache,
            evaluate: bool = False) -> dict:
    name, _, layout = method.partition("+")  # taylor+uniform: the uniform (stock-loadable) layout
    config = PruneConfig(model=model_name, method=name, sparsity=sparsity, seq_len=64, num_samples=32,
                         calibration="wiki", device="cpu", dtype="float32", uniform=layout == "uniform")
    result = prune(config, cache=cache)
    text = load_ppl_text("wiki")
    row = {"pruning_ratio": result.diagnostics["pruning_ratio"]}
    if loss != "none":
        spec = RecoverySpec(loss=loss, data="wiki", steps=args.steps, lr=args.lr, warmup_steps=args.steps // 10,
                            micro_batch_size=4, seq_len=128, lora_dropout=0.0)
        teacher = None if loss == "ce" else load_model(model_name, dtype=torch.float32)
        held = heldout_ids(result.tokenizer, "wiki", spec)
        recovered = recover(result.model, recovery_ids(result.tokenizer, spec, model_name), held, spec,
                            teacher=teacher)
        result.model = recovered.model
        row |= {"loss_before": recovered.loss_before, "loss_after": recovered.loss_after,
                "recovery_s": recovered.seconds, "s_per_step": recovered.seconds / args.steps}
    row["ppl"] = perplexity(result.model, result.tokenizer, text, window=128, max_windows=args.windows)["ppl"]
    if evaluate:
        row |= zero_shot(result.model, result.tokenizer, model_name, args.eval_limit)
    return row


def best_two(data: dict, sparsity: float, methods: list[str]) -> tuple[str, ...]:
    """The two methods with the lowest perplexity before recovery at `sparsity` (all must be measured)."""
    ppl = {m: data["runs"].get(f"{sparsity}|{m}|none", {}).get("ppl") for m in methods}
    if None in ppl.values():
        return ()
    return tuple(sorted(ppl, key=ppl.get)[:2])


def table(data: dict) -> str:
    lines = ["| sparsity | method | ppl, no recovery | ppl after ce | ppl after kd | s/step ce | s/step kd |",
             "|---|---|---|---|---|---|---|"]
    runs = data["runs"]
    for sparsity in data["settings"]["sparsities"]:
        for method in data["settings"]["methods"]:
            get = lambda loss, key: runs.get(f"{sparsity}|{method}|{loss}", {}).get(key)
            fmt = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"
            lines.append(f"| {sparsity} | {method} | {fmt(get('none', 'ppl'))} | {fmt(get('ce', 'ppl'))} | "
                         f"{fmt(get('kd', 'ppl'))} | {fmt(get('ce', 's_per_step'))} | {fmt(get('kd', 's_per_step'))} |")
    evaluated = [(k, r) for k, r in runs.items() if "acc_mean" in r]
    if evaluated:
        lines += ["", "| run (sparsity, method, recovery) | wiki ppl | acc_mean ± stderr | items per task "
                  "| zero-shot s |", "|---|---|---|---|---|"]
        for key, r in sorted(evaluated):
            n = min(e["n"] for e in r["tasks"].values())
            lines.append(f"| {key.replace('|', ', ')} | {r['ppl']:.2f} | {r['acc_mean']:.4f} ± "
                         f"{acc_mean_stderr(r['tasks']):.4f} | {n} | {r['zero_shot_s']:.0f} |")
    for key, value in data.get("kendall", {}).items():
        lines.append(f"\nKendall's tau, {key}: {value['tau']:.3f} (95% bootstrap interval {value['ci95'][0]:.3f} to "
                     f"{value['ci95'][1]:.3f}, {value.get('configurations', value.get('points'))} ranked points)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sparsities", default="0.2,0.4")
    parser.add_argument("--methods", default="taylor,layerwise,blockwise,taylor+uniform")
    parser.add_argument("--losses", default="none,ce,kd")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--eval-limit", type=int, default=0, help="items per task of the seven real tasks for the "
                        "best two configurations (0: no zero-shot)")
    parser.add_argument("--eval-sparsities", default="0.2")
    parser.add_argument("--table", action="store_true", help="print the Markdown table of --json and exit")
    args = parser.parse_args()
    data = json.loads(args.json.read_text()) if args.json.is_file() else {"runs": {}}
    if args.table:
        print(table(data))
        return
    sparsities, methods = [float(s) for s in args.sparsities.split(",")], args.methods.split(",")
    measured = data.get("settings", {})
    settings = {"model": args.model, "steps": args.steps, "lr": args.lr, "windows": args.windows,
                "tokens_per_step": 4 * 128}
    differ = [k for k in settings if k in measured and measured[k] != settings[k]]
    if differ:
        parser.error(f"{args.json} holds runs measured with other {', '.join(differ)}; use another --json")
    # a later invocation may add sparsities or methods: the record keeps them all
    sparsities = sorted(set(measured.get("sparsities", [])) | set(sparsities))
    methods = list(dict.fromkeys(measured.get("methods", []) + methods))
    data["settings"] = settings | {"sparsities": sparsities, "methods": methods}
    data["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__}
    cache = ImportanceCache(args.json.with_suffix(".importance_cache"))
    losses = args.losses.split(",")
    if args.eval_limit:
        settings["eval_limit"] = data["settings"]["eval_limit"] = args.eval_limit
    # unrecovered first: they pick the configurations that are also scored zero-shot
    order = [(s, m, "none") for s in sparsities for m in methods] if "none" in losses else []
    order += [(s, m, loss) for loss in losses if loss != "none" for s in sparsities for m in methods]
    for sparsity, method, loss in order:
        key = f"{sparsity}|{method}|{loss}"
        chosen = best_two(data, sparsity, methods) if args.eval_limit and loss != "none" else ()
        evaluate = sparsity in [float(s) for s in args.eval_sparsities.split(",")] and method in chosen
        if key in data["runs"] and (not evaluate or "acc_mean" in data["runs"][key]):
            continue
        if evaluate and loss != "none":  # the unrecovered model of a chosen configuration is scored first
            base = f"{sparsity}|{method}|none"
            if "acc_mean" not in data["runs"].get(base, {}):
                start = time.perf_counter()
                data["runs"][base] = measure(args, args.model, sparsity, method, "none", cache, True) | {
                    "wall_s": time.perf_counter() - start, "date": time.strftime("%Y-%m-%d")}
                print(base, {k: v for k, v in data["runs"][base].items() if k != "tasks"}, flush=True)
                write_json(args.json, data)
        start = time.perf_counter()
        data["runs"][key] = measure(args, args.model, sparsity, method, loss, cache, evaluate) | {
            "wall_s": time.perf_counter() - start, "date": time.strftime("%Y-%m-%d")}
        print(key, {k: v for k, v in data["runs"][key].items() if k != "tasks"}, flush=True)
        write_json(args.json, data)
    data["kendall"] = {}
    for sparsity, loss in itertools.product(sparsities, ("ce", "kd")):
        pairs = [(data["runs"].get(f"{sparsity}|{m}|none", {}).get("ppl"), data["runs"].get(f"{sparsity}|{m}|{loss}",
                  {}).get("ppl")) for m in methods]
        pairs = [p for p in pairs if None not in p]
        if len(pairs) >= 3:
            data["kendall"][f"{sparsity} none vs {loss}"] = kendall(*map(list, zip(*pairs)))
    all_pairs = [(data["runs"].get(f"{s}|{m}|none", {}).get("ppl"), data["runs"].get(f"{s}|{m}|{loss}", {}).get("ppl"))
                 for s in sparsities for m in methods for loss in ("ce", "kd")]
    all_pairs = [p for p in all_pairs if None not in p]
    if len(all_pairs) >= 3:
        data["kendall"]["every configuration and loss, none vs recovered"] = kendall(*map(list, zip(*all_pairs)))
    write_json(args.json, data)
    print(table(data))


if __name__ == "__main__":
    main()
