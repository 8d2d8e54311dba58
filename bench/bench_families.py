"""Depth, width and mixed cuts of real models under one protocol (issue 40): which family wins where? With
`--set baselines`, the field's activation baselines beside the Taylor methods under that protocol (issue 41).

Per model and sparsity, every configuration of FAMILIES is pruned from one calibration draw (wiki, 32 x 64 tokens,
seed 0; one gradient pass per model through the importance cache, one forward pass for the layer similarities) and
measured on this machine: held-out wiki perplexity (the first --windows windows of 128 tokens), the seven real tasks
at --eval-limit items each (acc_mean with its stderr as the report computes it), prefill and decode speed at batch 1
and the spec's larger batch against the unpruned model (measured first and last per model; the ratios use their
mean, the difference shows the drift) with their standard errors, and memory (weights plus the KV cache at the
spec's context). With --recover-steps N, the best configuration of each family by perplexity at each sparsity is
then recovered (LoRA, ce on the wiki calibration articles, N steps) and measured again.

`--set baselines` measures BASELINES instead (wanda_sp and flap, with and without FLAP's compensation, beside
taylor, layerwise, blockwise, magnitude and random), usually with `--num-samples 128 --sparsities 0.2
--recover-steps 0` (the issue's calibration: wiki, 128 x 64, seed 0).

Resumable: the record (--json) keeps every finished run, and a rerun skips them; every measured calibration loss of a
candidate plan is kept beside it (.losses.json), so a row stopped inside measured_loss's greedy search goes on where
it stopped. --table prints its tables.
With --no-speed the runs measure quality only (it does not depend on what else the machine runs); --speeds later
times every finished run that has no timing beside the unpruned model, on a quiet machine: the depth cuts rebuilt
from their recorded layers (measured_loss is not searched again), the others pruned again from the importance cache.

    .venv/bin/python bench/bench_families.py --json bench/families.json               # both models: many hours
    .venv/bin/python bench/bench_families.py --json bench/families.json --models smollm2-135m
    .venv/bin/python bench/bench_families.py --json bench/families.json --no-speed   # beside other work
    .venv/bin/python bench/bench_families.py --json bench/families.json --speeds     # then, alone: the timings
    .venv/bin/python bench/bench_families.py --json bench/families.json --table
    .venv/bin/python bench/bench_families.py --set baselines --num-samples 128 --sparsities 0.2 --recover-steps 0 \
        --json bench/baselines.json
    .venv/bin/python bench/bench_families.py --set baselines --num-samples 128 --sparsities 0.2 --recover-steps 0 \
        --no-speed --outcomes --names taylor,layerwise,blockwise,"wanda_sp (uniform)",flap \
        --json bench/baselines_paired.json                       # then: bench/paired_protocol.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import time
from pathlib import Path

import pandas as pd
import torch

from taylor_tune.config import EvalSpec, PruneConfig, RecoverySpec, SpeedSpec
from taylor_tune.evaluation.evaluate import Evaluator
from taylor_tune.evaluation.perplexity import perplexity
from taylor_tune.evaluation.speed import measure_speed, speed_ratios
from taylor_tune.jsonio import write_json
from taylor_tune.pruning.apply import remove_layers
from taylor_tune.pruning.measured import plan_loss
from taylor_tune.pruning.prune import STAGES, ImportanceCache, make_plan, plan, start
from taylor_tune.recovery.train import recover
from taylor_tune.reporting import stats
from taylor_tune.sources.data import load_ppl_text
from taylor_tune.sources.models import load_model, load_tokenizer
from taylor_tune.sources.recovery_data import heldout_ids, recovery_ids

# name -> (family, PruneConfig fields)
FAMILIES = {
    "depth/block_influence": ("depth", {"method": "depth", "depth_criterion": "block_influence"}),
    "depth/angular": ("depth", {"method": "depth", "depth_criterion": "angular"}),
    "depth/taylor": ("depth", {"method": "depth", "depth_criterion": "taylor"}),
    "depth/measured_loss": ("depth", {"method": "depth", "depth_criterion": "measured_loss"}),
    "depth/last": ("depth", {"method": "depth", "depth_criterion": "last"}),
    "width/taylor": ("width", {"method": "taylor"}),
    "width/blockwise": ("width", {"method": "blockwise"}),
    "width/taylor+uniform": ("width", {"method": "taylor", "uniform": True}),
    "mixed/0.25": ("mixed", {"method": "taylor", "depth_share": 0.25, "depth_criterion": "block_influence"}),
    "mixed/0.5": ("mixed", {"method": "taylor", "depth_share": 0.5, "depth_criterion": "block_influence"}),
}
# name -> (family, PruneConfig fields): the activation baselines (family: what scores the groups)
BASELINES = {
    "taylor": ("gradient", {"method": "taylor"}),
    "layerwise": ("gradient", {"method": "layerwise"}),
    "blockwise": ("gradient", {"method": "blockwise"}),
    "magnitude": ("weights", {"method": "magnitude"}),
    "random": ("none", {"method": "random"}),
    "wanda_sp (uniform)": ("activations", {"method": "taylor", "criterion": "wanda_sp", "uniform": True}),
    "wanda_sp (global)": ("activations", {"method": "taylor", "criterion": "wanda_sp"}),
    "flap": ("activations", {"method": "taylor", "criterion": "flap"}),
    "flap, no compensation": ("activations", {"method": "taylor", "criterion": "flap", "flap_compensation": False}),
}
SETS = {"families": FAMILIES, "baselines": BASELINES}
SPEED = SpeedSpec(prefill_batch=1, prefill_len=256, decode_batch=8, prompt_len=64, new_tokens=16, repeats=5, warmup=1)


def acc_mean_stderr(tasks: dict) -> float:
    row = pd.DataFrame([{f"acc_{t}_stderr": e["score_stderr"] for t, e in tasks.items()}])
    return float(stats.acc_mean_stderr(row, tuple(tasks)).iloc[0])


def outcomes_folder(args, key: str) -> Path:
    """Where a row's per-item outcomes and perplexity windows go (--outcomes): beside --json, one folder a row."""
    return args.json.with_suffix(".outcomes") / hashlib.sha256(key.encode()).hexdigest()[:16]


def quality(model, tokenizer, model_name: str, args, key: str = "") -> dict:
    """Held-out wiki perplexity and the seven tasks at args.eval_limit items; with --outcomes, each item's outcome and
    each window's NLL written to `outcomes_folder` (what the paired comparisons read, bench/paired_protocol.py)."""
    if args.outcomes:  # the trial's own evaluator: the same windows and items as a sweep's, kept as a sweep keeps them
        folder = outcomes_folder(args, key)
        spec = EvalSpec(task_data="real", limit=args.eval_limit, ppl="wiki", ppl_window=128,
                        ppl_max_windows=args.windows)
        evaluator = Evaluator(model, tokenizer, spec, model_name=model_name)
        result = evaluator.perplexity()
        result.write_outcomes(folder)
        row = {"ppl": result.ppl, "outcomes": folder.name}
    else:
        row = {"ppl": perplexity(model, tokenizer, load_ppl_text("wiki"), window=128,
                                 max_windows=args.windows)["ppl"]}
    if args.eval_limit:
        spec = EvalSpec(task_data="real", limit=args.eval_limit, ppl=None)
        shots = Evaluator(model, tokenizer, spec, model_name=model_name).zero_shot(args.eval_limit)
        if args.outcomes:
            shots.write_outcomes(outcomes_folder(args, key))
        tasks = {t: {k: e[k] for k in ("score", "score_stderr", "n", "metric")} for t, e in shots.tasks.items()}
        row |= {"acc_mean": shots.acc_mean, "acc_mean_stderr": acc_mean_stderr(tasks), "tasks": tasks,
                "zero_shot_s": shots.seconds}
    return row


class LossMemo:
    """Every candidate plan's measured calibration loss, kept on disk (--json with the suffix .losses.json): the
    greedy measured-loss search of one large-model row takes hours of forwards, and a process stopped inside a row
    starts the row again; with the memo it repeats no forward it finished. Keyed by everything the loss depends on:
    the model, the calibration draw, the dtype, the micro-batch and the plan."""

    def __init__(self, path: Path):
        self.path = path
        self.values = json.loads(path.read_text()) if path.is_file() else {}
        self.measured = self.remembered = 0

    def wrap(self, config: PruneConfig, loss):
        def remembered(candidate) -> float:
            key = hashlib.sha256(repr((
                config.model, config.calibration, config.seq_len, config.num_samples, config.seed, config.dtype,
                config.micro_batch_size, candidate.layers_removed, candidate.attn_removed, candidate.mlp_removed,
            )).encode()).hexdigest()
            if key in self.values:
                self.remembered += 1
            else:
                self.values[key] = loss(candidate)
                self.measured += 1
                write_json(self.path, self.values)
            return self.values[key]

        return remembered


def pruned(config: PruneConfig, cache: ImportanceCache, memo: LossMemo):
    """`prune(config)`, its plan stage's measured losses read from and written to `memo`."""
    def remembered_plan(pruning) -> dict[str, float]:
        begin = time.perf_counter()
        loss = memo.wrap(config, plan_loss(pruning.model, pruning.calibration.ids, config.micro_batch_size))
        pruning.plan = make_plan(config, pruning.scores, pruning.layout, loss, pruning.similarity)
        return {"plan_s": time.perf_counter() - begin}

    pruning = start(config, cache=cache)
    for stage in STAGES:
        pruning.timings |= (remembered_plan if stage is plan else stage)(pruning)
    return pruning


def config_of(model_name: str, sparsity: float, name: str, configs: dict, num_samples: int) -> PruneConfig:
    return PruneConfig(model=model_name, sparsity=sparsity, seq_len=64, num_samples=num_samples, calibration="wiki",
                       device="cpu", dtype="float32", seed=0, **configs[name][1])


def unpruned_speed(model_name: str) -> dict:
    return measure_speed(load_model(model_name, dtype=torch.float32).eval(), SPEED)


def mean_speed(first: dict, last: dict | None) -> dict:
    """The unpruned model's speed: the mean of its first and last measurement (each rate's se combined as of a mean
    of two independent measurements)."""
    if last is None:
        return first
    out = dict(first)
    for key, value in first.items():
        if key.endswith("_tokens_per_s"):
            out[key] = (value + last[key]) / 2
            se = first.get(f"{key}_se"), last.get(f"{key}_se")
            out[f"{key}_se"] = None if None in se else 0.5 * (se[0] ** 2 + se[1] ** 2) ** 0.5
    return out


def run(model_name: str, sparsity: float, name: str, args, cache: ImportanceCache, recover_steps: int = 0,
        unrecovered: dict | None = None) -> dict:
    """One configuration measured; with recover_steps, its `unrecovered` run's model rebuilt (a depth cut from its
    recorded layers: measured_loss's greedy search is not run twice), recovered, and measured again."""
    start = time.perf_counter()
    configs = SETS[args.set]
    if recover_steps:
        model, tokenizer = rebuilt(model_name, sparsity, name, unrecovered, args, cache), load_tokenizer(model_name)
        row = {k: unrecovered[k] for k in ("family", "pruning_ratio", "layers_removed")}
        row["prune_s"] = time.perf_counter() - start
        spec = RecoverySpec(loss="ce", data="wiki", steps=recover_steps, lr=2e-4, warmup_steps=recover_steps // 10,
                            micro_batch_size=4, seq_len=128, lora_dropout=0.0)
        recovered = recover(model, recovery_ids(tokenizer, spec, model_name), heldout_ids(tokenizer, "wiki", spec),
                            spec)
        model = recovered.model
        row |= {"recovery_loss_before": recovered.loss_before, "recovery_loss_after": recovered.loss_after,
                "recovery_s": recovered.seconds}
    else:
        memo = LossMemo(args.json.with_suffix(".losses.json"))
        result = pruned(config_of(model_name, sparsity, name, configs, args.num_samples), cache, memo)
        model, tokenizer = result.model, result.tokenizer
        row = {"family": configs[name][0], "pruning_ratio": result.diagnostics["pruning_ratio"],
               "layers_removed": list(result.plan.layers_removed), "prune_s": time.perf_counter() - start}
        if memo.measured + memo.remembered:  # prune_s then counts only the losses measured here
            row["plan_losses"] = {"measured": memo.measured, "remembered": memo.remembered}
        if not args.no_speed:
            row |= timed_beside_unpruned(model_name, model)
    row |= quality(model, tokenizer, model_name, args,
                   f"{model_name}|{sparsity}|{name}|{'ce' if recover_steps else 'none'}")
    return row | {"wall_s": time.perf_counter() - start, "date": time.strftime("%Y-%m-%d %H:%M")}


def timed_beside_unpruned(model_name: str, model) -> dict:
    """The unpruned model timed right before the pruned one: a ratio of neighbours, not of distant moments."""
    return {"unpruned_speed": unpruned_speed(model_name), "speed": measure_speed(model.eval(), SPEED),
            "speed_date": time.strftime("%Y-%m-%d %H:%M")}


def rebuilt(model_name: str, sparsity: float, name: str, row: dict, args, cache: ImportanceCache):
    """The model of a finished run again: a depth cut from its recorded layers, any other pruned again (from the
    cache); the parameter ratio reached must be the recorded one."""
    configs = SETS[args.set]
    if configs[name][1].get("method") == "depth":
        model = load_model(model_name, dtype=torch.float32)
        total = sum(p.numel() for p in model.parameters())
        remove_layers(model, tuple(row["layers_removed"]))
        reached = 1 - sum(p.numel() for p in model.parameters()) / total
    else:
        result = pruned(config_of(model_name, sparsity, name, configs, args.num_samples), cache,
                        LossMemo(args.json.with_suffix(".losses.json")))
        model, reached = result.model, result.diagnostics["pruning_ratio"]
    if abs(reached - row["pruning_ratio"]) > 1e-3:
        raise RuntimeError(f"{name}: rebuilt at {reached:.4f} of the parameters removed, recorded "
                           f"{row['pruning_ratio']:.4f}")
    return model


def with_ratios(row: dict, unpruned: dict) -> dict:
    """The speedups against the unpruned model timed beside this run (`unpruned_speed`), else against `unpruned`
    (the model's first and last timing: runs recorded before the neighbour timing was added)."""
    if "speed" not in row or ("unpruned_speed" not in row and unpruned is None):
        return row
    return row | speed_ratios(row["speed"], row.get("unpruned_speed", unpruned))


def best_per_family(runs: dict, model_name: str, sparsity: float) -> list[str]:
    """Per family, the configuration with the lowest perplexity (all of the family measured), in FAMILIES' order."""
    chosen = []
    for family in ("depth", "width", "mixed"):
        names = [n for n, (f, _) in FAMILIES.items() if f == family]
        ppl = {n: runs.get(f"{model_name}|{sparsity}|{n}|none", {}).get("ppl") for n in names}
        if None not in ppl.values():
            chosen.append(min(names, key=lambda n: (ppl[n], names.index(n))))
    return chosen


def _pm(value, se, digits=2) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" + ("" if se is None else f" ± {se:.{digits}f}")


def table(data: dict) -> str:
    lines, configs = [], SETS[data["settings"].get("set", "families")]
    for model_name in data["settings"]["models"]:
        speeds = data.get("unpruned", {}).get(model_name, {})
        if model_name not in data.get("unpruned_quality", {}):
            continue
        base = mean_speed(speeds["first"], speeds.get("last")) if "first" in speeds else None
        drift = ("" if "last" not in speeds or "first" not in speeds else
                 f"; the unpruned model measured last decoded at {speeds['last']['decode_tokens_per_s'] / speeds['first']['decode_tokens_per_s']:.3f}× its first speed")  # noqa: E501
        unp = data.get("unpruned_quality", {}).get(model_name, {})
        lines += ["", f"**{model_name}** (unpruned: wiki ppl {unp.get('ppl', float('nan')):.2f}, acc_mean "
                  f"{_pm(unp.get('acc_mean'), unp.get('acc_mean_stderr'), 4)}{drift})", "",
                  "| sparsity | configuration | layers removed | reached | wiki ppl | acc_mean ± stderr | prefill "
                  "speedup | decode speedup b1 | decode speedup b8 | memory ratio | recovered: ppl | recovered: "
                  "acc_mean ± stderr |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for sparsity in data["settings"]["sparsities"]:
            for name in configs:
                r = data["runs"].get(f"{model_name}|{sparsity}|{name}|none")
                if r is None:
                    continue
                r = with_ratios(r, base)
                rec = data["runs"].get(f"{model_name}|{sparsity}|{name}|ce", {})
                mark = "" if "unpruned_speed" in r or "speed" not in r else " †"
                lines.append(
                    f"| {sparsity:.0%} | {name}{mark} | {len(r['layers_removed'])} | {r['pruning_ratio']:.3f} | "
                    f"{r['ppl']:.2f} | {_pm(r.get('acc_mean'), r.get('acc_mean_stderr'), 4)} | "
                    f"{_pm(r.get('prefill_speedup'), r.get('prefill_speedup_se'))} | "
                    f"{_pm(r.get('decode_speedup'), r.get('decode_speedup_se'))} | "
                    f"{_pm(r.get('decode_batch_speedup'), r.get('decode_batch_speedup_se'))} | "
                    f"{_pm(r.get('memory_ratio'), None, 3)} | "
                    f"{_pm(rec.get('ppl'), None)} | {_pm(rec.get('acc_mean'), rec.get('acc_mean_stderr'), 4)} |")
    if any("speed" in r and "unpruned_speed" not in r for r in data["runs"].values()):
        lines += ["", "† speedups against the unpruned model's first and last timing of the run, not a neighbour's"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--set", choices=sorted(SETS), default="families")
    parser.add_argument("--num-samples", type=int, default=32, help="calibration rows of 64 tokens")
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b")
    parser.add_argument("--sparsities", default="0.2,0.3")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--eval-limit", type=int, default=300)
    parser.add_argument("--recover-steps", type=int, default=50, help="0: no recovery")
    parser.add_argument("--table", action="store_true", help="print the Markdown tables of --json and exit")
    parser.add_argument("--no-speed", action="store_true", help="measure quality only; time later with --speeds")
    parser.add_argument("--outcomes", action="store_true",
                        help="keep each row's per-item outcomes and perplexity windows (for bench/paired_protocol.py)")
    parser.add_argument("--names", default=None, help="only these configurations of --set (comma-separated)")
    parser.add_argument("--speeds", action="store_true",
                        help="only time the finished runs that have no timing beside the unpruned model")
    args = parser.parse_args()
    data = json.loads(args.json.read_text()) if args.json.is_file() else {"runs": {}}
    if args.table:
        print(table(data))
        return
    settings = {"windows": args.windows, "eval_limit": args.eval_limit, "recover_steps": args.recover_steps,
                "speed": SPEED.model_dump()} | ({"outcomes": True} if args.outcomes else {})
    if args.set != "families" or args.num_samples != 32:  # the first record (families, 32 rows) predates these
        settings |= {"set": args.set, "num_samples": args.num_samples}
    differ = [k for k in settings if k in data.get("settings", {}) and data["settings"][k] != settings[k]]
    if differ:
        parser.error(f"{args.json} holds runs measured with other {', '.join(differ)}; use another --json")
    models, sparsities = args.models.split(","), [float(s) for s in args.sparsities.split(",")]
    old = data.get("settings", {})
    data["settings"] = settings | {"models": list(dict.fromkeys(old.get("models", []) + models)),
                                   "sparsities": sorted(set(old.get("sparsities", [])) | set(sparsities))}
    data["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__}
    cache = ImportanceCache(args.json.with_suffix(".importance_cache"))
    if args.speeds:
        for model_name in models:
            for sparsity in sparsities:
                for name in SETS[args.set]:
                    key = f"{model_name}|{sparsity}|{name}|none"
                    row = data["runs"].get(key)
                    if row is not None and "unpruned_speed" not in row:
                        row |= timed_beside_unpruned(model_name, rebuilt(model_name, sparsity, name, row, args, cache))
                        print(key, {k: v for k, v in with_ratios(row, None).items() if k.endswith("speedup")},
                              flush=True)
                        write_json(args.json, data)
        print(table(data))
        return
    for model_name in models:
        speeds = data.setdefault("unpruned", {}).setdefault(model_name, {})
        if "first" not in speeds and not args.no_speed:
            speeds["first"] = unpruned_speed(model_name)
            write_json(args.json, data)
        if model_name not in data.setdefault("unpruned_quality", {}):
            data["unpruned_quality"][model_name] = quality(load_model(model_name, dtype=torch.float32).eval(),
                                                           load_tokenizer(model_name), model_name, args,
                                                           f"{model_name}|unpruned")
            write_json(args.json, data)
        # the greedy measured-loss search costs several times any other row: each sparsity's other rows come first
        names = args.names.split(",") if args.names else list(SETS[args.set])
        if unknown := set(names) - set(SETS[args.set]):
            parser.error(f"--names: {', '.join(sorted(unknown))} not in --set {args.set}")
        order = sorted(((s, n, 0) for s in sparsities for n in names),
                       key=lambda row: (row[0], row[1] == "depth/measured_loss"))
        for sparsity, name, steps in order:
            key = f"{model_name}|{sparsity}|{name}|none"
            if key not in data["runs"]:
                data["runs"][key] = run(model_name, sparsity, name, args, cache)
                print(key, {k: v for k, v in data["runs"][key].items() if k not in ("tasks", "speed")}, flush=True)
                write_json(args.json, data)
        if "last" not in speeds and not args.no_speed:
            speeds["last"] = unpruned_speed(model_name)
            write_json(args.json, data)
        if args.recover_steps:
            for sparsity in sparsities:
                for name in best_per_family(data["runs"], model_name, sparsity):
                    key = f"{model_name}|{sparsity}|{name}|ce"
                    if key not in data["runs"]:
                        data["runs"][key] = run(model_name, sparsity, name, args, cache, args.recover_steps,
                                                data["runs"][f"{model_name}|{sparsity}|{name}|none"])
                        print(key, {k: v for k, v in data["runs"][key].items() if k != "tasks"}, flush=True)
                        write_json(args.json, data)
    print(table(data))


if __name__ == "__main__":
    main()
