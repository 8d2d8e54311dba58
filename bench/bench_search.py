"""Search efficiency: replay TPE and TPE+ASHA against a complete grid result, offline.

Input: a finished grid sweep whose trials report one or more cheap zero-shot passes and then the full one
(`experiments/offline_paper_grid.yaml`: 14, 40, all items per task). Every configuration's accuracy and
seconds at each pass are read from its trial's results; a grid run with `search.repeats` > 1 gives one grid
per calibration seed, and each is replayed on its own (a realization of the same landscape). A replay
drives taylor_tune's own searcher (`PerModelSearcher`, the one a TPE sweep runs, seeded) and, for
TPE+ASHA, its own scheduler (`FidelityASHA`, one rung per cheap pass, as a sweep with those fidelities
runs it), and "evaluates" each configuration by lookup, one trial at a time:
- TPE: every configuration costs its full evaluation;
- TPE+ASHA: a configuration pays for each pass it reaches; a stopped trial reports its last score to the
  searcher, as Tune does.
A replay succeeds at the first fully evaluated configuration within `--tolerance` (0.5 points) of its grid's
best. Its cost is reported as a fraction of the grid's cost (every configuration at full fidelity).

A grid that searched for the lowest perplexity (`metric: ppl`, `experiments/real_paper_grid.yaml`) is replayed on
ppl instead (`--metric ppl`, found from the trials' configs): the cheap fidelity is the perplexity over the first
`--ppl-rung` windows (read from the trial's `ppl_curve`; its cost is that share of the trial's perplexity seconds), and
`--tolerance` is relative (0.01 = within 1% of the best ppl). A trial costs its load, prune and perplexity seconds;
the importance pass of a (seq_len, seed) is paid once, by the first trial of the search that needs it, as the sweep's
importance cache does. The zero-shot pass that rides along is not part of the search and costs nothing here.
`--importance-cost` prices that pass as two caches the product does not have (what-ifs, the pass's seconds taken as
proportional to its samples): `per_count` computes only the count a trial asks for and recomputes for a larger one;
`incremental` extends a computed pass to a larger count, paying only for the added samples.

    .venv/bin/python bench/bench_search.py runs/sweeps/offline_paper_grid --passes 40,all --json bench/out/search.json
    .venv/bin/python bench/bench_search.py runs/sweeps/real_paper_grid --ppl-rung 16 --tolerance 0.01 \
        --json bench/real_search.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from taylor_tune.jsonio import write_json  # noqa: E402
from taylor_tune.storage.cache import Store
from taylor_tune.sweep.tune.scheduler import PASS, FidelityASHA  # noqa: E402
from taylor_tune.sweep.tune.search import PerModelSearcher  # noqa: E402

NAMES = ("taylor_seq_len", "taylor_num_samples", "pruning_method")


def objective(path: Path) -> tuple[str, str]:
    """The grid's metric and mode, as its trials' configs recorded them (acc_mean / max for older sweeps)."""
    found = {
        (o.get("metric", "acc_mean"), o.get("mode", "max"))
        for o in (json.loads(p.read_text()).get("fixed", {}).get("objective") or {} for p in path.glob("*/params.json"))
    }
    if len(found) != 1:
        raise SystemExit(f"{path}: the trials record {len(found)} objectives: {sorted(found)}")
    return found.pop()


def ppl_passes(final: dict, rung: int) -> list[dict]:
    """A ppl grid trial's passes: perplexity over its first `rung` windows (from ppl_curve), then over all."""
    curve, total = dict((int(w), v) for w, v in final["ppl_curve"]), final["ppl_windows"]
    if rung not in curve or rung >= total:
        raise SystemExit(
            f"--ppl-rung {rung}: the trials recorded ppl after {sorted(curve)} windows (of {total}); pick one below "
            f"{total}"
        )
    base = final["load_s"] + final["prune_s"]
    return [
        {"stage": f"ppl_{rung}", "limit": str(rung), "value": curve[rung], "s": base + final["ppl_s"] * rung / total},
        {"stage": "ppl", "limit": "all", "value": final["ppl"], "s": base + final["ppl_s"]},
    ]


def load_grids(path: Path, passes: list[str] | None = None, metric: str = "acc_mean", ppl_rung: int | None = None):
    """(grids, importance): grids maps calibration seed -> {(seq_len, num_samples, method) -> [{"stage", "limit",
    "value", "s"} per pass, cheapest first]}, from each trial's result.json; `passes` picks zero-shot passes by limit
    ("40", "all"), the last "all". importance maps (seed, seq_len) -> the seconds of its one importance pass."""
    grids: dict[int, dict[tuple, list[dict]]] = {}
    importance: dict[tuple, float] = {}
    for result_file in path.glob("*/result.json"):
        rows = [json.loads(line) for line in result_file.read_text().splitlines() if line.strip()]
        full = rows[-1]
        if full.get("importance_cache") == "computed":
            importance[(full["seed"], full["taylor_seq_len"])] = full["importance_s"] + full.get("calibration_s", 0.0)
        if metric == "ppl":
            if "ppl_curve" not in full:
                raise SystemExit(f"{result_file}: the trial did not reach its final report; replay a finished grid")
            grids.setdefault(full["seed"], {})[tuple(full[name] for name in NAMES)] = ppl_passes(full, ppl_rung)
            continue
        reached = [{"stage": r["stage"], "limit": r["stage"].removeprefix("zero_shot_"), "value": r["acc_mean"],
                    "s": r[r["stage"] + "_s"]} for r in rows if r.get("stage", "").startswith("zero_shot_")]
        if passes is not None:
            reached = [p for p in reached if p["limit"] in passes]
        if reached[-1]["limit"] != "all":
            raise SystemExit(f"{result_file}: the trial did not reach its full evaluation; replay a finished grid")
        grids.setdefault(full["seed"], {})[tuple(full[name] for name in NAMES)] = reached
    for event in Store(path / "importance_cache").events():  # the cache's own record: also a pass no trial computed
        if event["event"] == "computed":
            importance.setdefault((int(event["seed"]), int(event["seq_len"])), event["seconds"])
    return grids, importance


def replay(grid: dict, good: set[tuple], *, seed: int, asha: bool, n_startup_trials: int, reduction_factor: float,
           items_per_task: int | None = None, metric: str = "acc_mean", mode: str = "max",
           importance: dict[int, float] | None = None, importance_cost: str = "once") -> dict:
    """One search on `grid` until it fully evaluates a configuration in `good`; `importance` (seq_len -> seconds of
    the pass over the grid's largest sample count) is paid as `importance_cost` says (module docstring)."""
    domains = {name: sorted({k[i] for k in grid}, key=str) for i, name in enumerate(NAMES)}
    searcher = PerModelSearcher(["model"], domains, len(grid), {}, metric=metric, mode=mode, seed=seed,
                                n_startup_trials=n_startup_trials)
    n_passes = len(next(iter(grid.values())))
    scheduler = FidelityASHA(n_passes, reduction_factor=reduction_factor, metric=metric, mode=mode) if asha else None
    cost = 0.0
    largest = max(domains["taylor_num_samples"])
    have: dict[int, int] = {}  # seq_len -> the sample count its cached pass holds
    for n in range(1, len(grid) + 1):
        config = searcher.suggest(str(n))
        key = tuple(config[name] for name in NAMES)
        passes = grid[key]
        if importance:
            cost += importance_charge(importance_cost, importance[key[0]], largest, have.get(key[0], 0), key[1])
            have[key[0]] = largest if importance_cost == "once" else max(have.get(key[0], 0), key[1])
        trial = SimpleNamespace(trial_id=str(n))
        if scheduler:
            scheduler.on_trial_add(None, trial)
        for k, p in enumerate(passes if asha else passes[-1:]):
            last = p is passes[-1]
            # what-if: a cheap pass costs its share of the items of a task of `items_per_task` (a real task's size)
            cost += p["s"] if last or items_per_task is None else passes[-1]["s"] * int(p["limit"]) / items_per_task
            result = {metric: p["value"], PASS: k}
            if scheduler and scheduler.on_trial_result(None, trial, result) == "STOP" and not last:
                scheduler.on_trial_complete(None, trial, result)
                searcher.on_trial_complete(str(n), result)
                break
        else:
            if scheduler:
                scheduler.on_trial_complete(None, trial, result)
            searcher.on_trial_complete(str(n), result)
            if key in good:
                return {"reached": True, "trials": n, "cost_s": cost}
    return {"reached": False, "trials": len(grid), "cost_s": cost}


def importance_charge(policy: str, pass_s: float, largest: int, have: int, need: int) -> float:
    """What a trial needing `need` samples pays for importance, the cache holding a pass over `have` samples
    (0: none) and a pass over `largest` costing `pass_s`."""
    if need <= have:
        return 0.0
    if policy == "once":  # the product's cache: one pass over the largest count, snapshots at the smaller ones
        return pass_s
    if policy == "per_count":
        return pass_s * need / largest
    if policy == "incremental":
        return pass_s * (need - have) / largest
    raise ValueError(policy)


def within(scores: dict[tuple, float], tolerance: float, mode: str = "max") -> set[tuple]:
    """The configurations within `tolerance` of the best: absolute for an accuracy, relative for a perplexity."""
    if mode == "min":
        best = min(scores.values())
        return {key for key, score in scores.items() if score <= best * (1 + tolerance)}
    best = max(scores.values())
    return {key for key, score in scores.items() if score >= best - tolerance}


def replays(grid: dict, good: set[tuple], args: argparse.Namespace, importance: dict[int, float] | None = None) -> dict:
    cost = sum(passes[-1]["s"] for passes in grid.values()) + sum((importance or {}).values())
    out = {}
    for name, asha in (("tpe", False), ("tpe_asha", True)):
        runs = [
            replay(
                grid,
                good,
                seed=s,
                asha=asha,
                n_startup_trials=args.n_startup_trials,
                reduction_factor=args.reduction_factor,
                items_per_task=args.items_per_task,
                metric=args.metric,
                mode=args.mode,
                importance=importance,
                importance_cost=args.importance_cost,
            )
            for s in range(args.repeats)
        ]
        # a run that never fully evaluated a good configuration (ASHA stopped them all) did not reach one at
        # any cost: its fraction is infinite, so a mean over runs with one is inf
        f = [run["cost_s"] / cost if run["reached"] else math.inf for run in runs]
        # a fixed budget of trials per model (experiments/tpe_asha.yaml runs 12): how often it reaches one
        budgets = {b: sum(run["reached"] and run["trials"] <= b for run in runs) for b in (12, 20)}
        out[name] = {
            "fractions": f,
            "reached": sum(run["reached"] for run in runs),
            "median_fraction": statistics.median(f),
            "mean_fraction": statistics.fmean(f),
            "max_fraction": max(f),
            "reached_within_trials": budgets,
            "median_trials": statistics.median(run["trials"] for run in runs),
        }
        print(
            f"    {name}: reached in {out[name]['reached']}/{args.repeats}; cost as a fraction of the grid: median "
            f"{out[name]['median_fraction']:.3f}, mean {out[name]['mean_fraction']:.3f}, max "
            f"{out[name]['max_fraction']:.3f}; "
            f"median trials {out[name]['median_trials']:g}; within 12 trials {budgets[12]}, within 20 {budgets[20]}"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", type=Path)
    parser.add_argument("--repeats", type=int, default=100, help="search seeds per grid")
    parser.add_argument("--n-startup-trials", type=int, default=10, help="the experiment's search.n_startup_trials")
    parser.add_argument("--reduction-factor", type=float, default=2, help="the experiment's search.reduction_factor")
    parser.add_argument(
        "--passes",
        help="the zero-shot passes the replayed sweep runs, e.g. 40,all (default: every one "
        "the grid has); ASHA gets a rung at each but the last",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.005,
        help="accuracy points as a fraction (0.005 = 0.5 points); "
        "for a ppl grid, relative to the best ppl (0.01 = within 1%%)",
    )
    parser.add_argument(
        "--ppl-rung", type=int, default=16, help="ppl grid: ASHA's rung, the ppl over the first this many windows"
    )
    parser.add_argument(
        "--items-per-task",
        type=int,
        help="what-if: cost a cheap pass of L items per task at L / this of "
        "the trial's full evaluation instead of its measured seconds (the real tasks average ~2,900)",
    )
    parser.add_argument(
        "--importance-cost",
        choices=("once", "per_count", "incremental"),
        default="once",
        help="ppl grid: how the search pays for importance passes: once per seq_len (the product's cache), "
        "or a what-if cache (module docstring)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.metric, args.mode = objective(args.experiment)
    grids, importance = load_grids(
        args.experiment, args.passes.split(",") if args.passes else None, args.metric, args.ppl_rung
    )
    keys = set.intersection(*(set(grid) for grid in grids.values()))
    # with several calibration seeds, a configuration's mean over them is the grid's least noisy estimate
    seed_mean = {key: statistics.fmean(grid[key][-1]["value"] for grid in grids.values()) for key in keys}
    pick = min if args.mode == "min" else max
    judges = {"draw": "its own grid's best (the calibration draw the search sees)"}
    if len(grids) > 1:
        judges["seed_mean"] = f"the best mean over the {len(grids)} calibration seeds"
        seed_mean_good = within(seed_mean, args.tolerance, args.mode)
        print(
            f"over {len(grids)} calibration seeds: best mean {pick(seed_mean.values()):.4f}; {len(seed_mean_good)} "
            f"configurations within "
            f"{args.tolerance * 100:.1f} {'%' if args.mode == 'min' else 'points'} of it; a configuration's "
            f"{args.metric} varies by "
            f"{statistics.fmean(statistics.stdev(g[k][-1]['value'] for g in grids.values()) for k in keys):.4f} "
            f"(std, mean over configurations)"
        )
    result = {
        "metric": args.metric,
        "mode": args.mode,
        "tolerance": args.tolerance,
        "n_startup_trials": args.n_startup_trials,
        "reduction_factor": args.reduction_factor,
        "importance_cost": args.importance_cost,
        "items_per_task_what_if": args.items_per_task,
        "ppl_rung": args.ppl_rung if args.metric == "ppl" else None,
        "judges": judges,
        "grids": {},
    }
    pooled = {judge: {"tpe": [], "tpe_asha": []} for judge in judges}
    for calibration_seed, grid in sorted(grids.items()):
        final = {key: passes[-1]["value"] for key, passes in grid.items()}
        best_key = pick(final, key=final.get)
        stages = [p["stage"] for p in grid[best_key]][:-1]
        paid = (
            {seq_len: s for (seed, seq_len), s in importance.items() if seed == calibration_seed}
            if args.metric == "ppl"
            else None
        )
        cost = sum(passes[-1]["s"] for passes in grid.values()) + sum((paid or {}).values())
        shares = {s: sum(passes[i]["s"] for passes in grid.values()) / cost for i, s in enumerate(stages)}
        # a perplexity's scale is multiplicative: its cheap and full values are compared as logs
        scale = math.log if args.metric == "ppl" else (lambda v: v)
        r = {
            s: statistics.correlation(
                [scale(passes[i]["value"]) for passes in grid.values()], [scale(v) for v in final.values()]
            )
            for i, s in enumerate(stages)
        }
        entry = {"configurations": len(grid), "grid_cost_s": cost, "importance_s": paid, "best": list(best_key),
                 f"best_{args.metric}": final[best_key], "cheap_cost_share": shares, "cheap_full_r": r}
        print(
            f"grid (calibration seed {calibration_seed}): {len(grid)} configurations, full-fidelity cost {cost:.1f} s"
            + (f" (of which importance passes {sum(paid.values()):.1f} s)" if paid else "")
            + f"; best {best_key} {args.metric} {final[best_key]:.4f}"
            + "".join(f"; {s} costs {shares[s]:.2f} of it, r = {r[s]:.2f}" for s in shares)
        )
        for judge, words in judges.items():
            good = within(final, args.tolerance, args.mode) if judge == "draw" else seed_mean_good
            entry[f"good_{judge}"] = sorted(map(list, good))
            print(
                f"  reaching {words}, or one within {args.tolerance * 100:.1f} "
                f"{'%' if args.mode == 'min' else 'points'} ({len(good)} configurations):"
            )
            entry[judge] = replays(grid, good, args, paid)
            for name in pooled[judge]:
                pooled[judge][name] += entry[judge][name].pop("fractions")
        result["grids"][calibration_seed] = entry
    if len(grids) > 1:
        result["pooled"] = {}
        for judge, fractions in pooled.items():
            result["pooled"][judge] = {
                name: {
                    "median_fraction": statistics.median(f),
                    "mean_fraction": statistics.fmean(f),
                    "reached": sum(math.isfinite(x) for x in f),
                    "runs": len(f),
                }
                for name, f in fractions.items()
            }
            print(
                f"pooled over the grids, reaching {judges[judge]}: "
                + "; ".join(
                    f"{name} median {statistics.median(f):.3f}, mean {statistics.fmean(f):.3f} (reached "
                    f"{sum(math.isfinite(x) for x in f)}/{len(f)})"
                    for name, f in fractions.items()
                )
            )
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
