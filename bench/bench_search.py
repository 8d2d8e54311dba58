"""Search efficiency: replay TPE and TPE+ASHA against a complete grid result, offline.

Input: a finished grid sweep whose trials report a cheap zero-shot fidelity and then the full one
(`experiments/offline_paper_grid.yaml`). Every configuration's accuracy and evaluation seconds are read
from its trial's results; a replay then drives taylor_tune's own searcher (`PerModelSearcher`, the one a
TPE sweep runs, seeded) and "evaluates" each configuration it hands out by lookup:
- TPE: every configuration costs its full evaluation;
- TPE+ASHA: every configuration first costs the cheap fidelity; ASHA (Ray's rule, reduction factor 2, one
  rung) lets it continue only if its cheap score is at least the median of the cheap scores seen so far;
  a stopped trial reports its cheap score to the searcher, as Tune does.
A replay succeeds at the first fully evaluated configuration within `--tolerance` (0.5 points) of the
grid's best. Its cost is reported as a fraction of the grid's cost (every configuration at full fidelity).

    .venv/bin/python bench/bench_search.py runs/sweeps/offline_paper_grid --cheap-limit 40 --json bench/out/search.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from taylor_tune.tune.search import PerModelSearcher  # noqa: E402

NAMES = ("taylor_seq_len", "taylor_num_samples", "pruning_method")


def load_grid(path: Path, cheap_limit: int | None = None) -> dict[tuple, dict]:
    """(seq_len, num_samples, method) -> cheap/full accuracy and seconds, from each trial's result.json. The cheap
    fidelity is the pass at `cheap_limit` items per task, by default the trials' first."""
    table = {}
    for result_file in path.glob("*/result.json"):
        rows = [json.loads(line) for line in result_file.read_text().splitlines() if line.strip()]
        passes = [r for r in rows if r.get("stage", "").startswith("zero_shot_") and r["stage"] != "zero_shot_all"]
        cheap = next(r for r in passes if cheap_limit is None or r["stage"] == f"zero_shot_{cheap_limit}")
        full = next(r for r in rows if r.get("stage") == "zero_shot_all")
        key = (full["taylor_seq_len"], full["taylor_num_samples"], full["pruning_method"])
        cheap_s = cheap[cheap["stage"] + "_s"]
        table[key] = {"cheap": cheap["acc_mean"], "full": full["acc_mean"], "cheap_s": cheap_s, "full_s": full["zero_shot_all_s"]}
    return table


def replay(table: dict, *, seed: int, asha: bool, tolerance: float, n_startup_trials: int, cheap_share: float | None = None) -> dict:
    domains = {name: sorted({k[i] for k in table}, key=str) for i, name in enumerate(NAMES)}
    best = max(v["full"] for v in table.values())
    searcher = PerModelSearcher(["model"], domains, len(table), {}, metric="acc_mean", mode="max", seed=seed,
                                n_startup_trials=n_startup_trials)
    cost, rung = 0.0, []
    for n in range(1, len(table) + 1):
        config = searcher.suggest(str(n))
        row = table[tuple(config[name] for name in NAMES)]
        if asha:
            cost += row["cheap_s"] if cheap_share is None else cheap_share * row["full_s"]
            cutoff = np.nanpercentile(rung, 50) if rung else None
            rung.append(row["cheap"])
            if cutoff is not None and row["cheap"] < cutoff:
                searcher.on_trial_complete(str(n), {"acc_mean": row["cheap"]})
                continue
        cost += row["full_s"]
        searcher.on_trial_complete(str(n), {"acc_mean": row["full"]})
        if row["full"] >= best - tolerance:
            return {"reached": True, "trials": n, "cost_s": cost}
    return {"reached": False, "trials": len(table), "cost_s": cost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", type=Path)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--n-startup-trials", type=int, default=10, help="the experiment's search.n_startup_trials")
    parser.add_argument("--cheap-limit", type=int, help="the fidelity ASHA stops at (items per task); default: the first")
    parser.add_argument("--tolerance", type=float, default=0.005, help="accuracy points as a fraction (0.005 = 0.5 points)")
    parser.add_argument("--cheap-share", type=float, help="what-if: cost the cheap fidelity at this share of each trial's "
                        "full evaluation instead of its measured seconds (on a 7-8B model 40 items per task are ~1.4%% of the items)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    table = load_grid(args.experiment, args.cheap_limit)
    grid_cost = sum(v["full_s"] for v in table.values())
    best = max(table.items(), key=lambda kv: kv[1]["full"])
    within = sum(v["full"] >= best[1]["full"] - args.tolerance for v in table.values())
    cheap_share = sum(v["cheap_s"] for v in table.values()) / grid_cost
    print(f"grid: {len(table)} configurations, full-fidelity cost {grid_cost:.1f} s (the cheap fidelity costs {cheap_share:.2f} "
          f"of it); best {best[0]} acc_mean {best[1]['full']:.4f}; {within} configurations within {args.tolerance * 100:.1f} points")
    result = {"configurations": len(table), "grid_cost_s": grid_cost, "best": list(best[0]), "best_acc": best[1]["full"],
              "within_tolerance": within, "tolerance": args.tolerance, "cheap_over_full_cost": cheap_share,
              "n_startup_trials": args.n_startup_trials, "cheap_share_what_if": args.cheap_share}
    for name, asha in (("tpe", False), ("tpe_asha", True)):
        runs = [replay(table, seed=s, asha=asha, tolerance=args.tolerance, n_startup_trials=args.n_startup_trials,
                       cheap_share=args.cheap_share) for s in range(args.repeats)]
        fractions = [r["cost_s"] / grid_cost for r in runs]
        # a fixed budget of trials per model (experiments/tpe_asha.yaml runs 12): how often it contains the best
        within = {budget: sum(r["reached"] and r["trials"] <= budget for r in runs) for budget in (12, 20)}
        result[name] = {"runs": runs, "reached": sum(r["reached"] for r in runs), "median_fraction": statistics.median(fractions),
                        "mean_fraction": statistics.fmean(fractions), "max_fraction": max(fractions),
                        "reached_within_trials": within, "median_trials": statistics.median(r["trials"] for r in runs)}
        print(f"{name}: reached in {result[name]['reached']}/{args.repeats}; cost as a fraction of the grid: median "
              f"{result[name]['median_fraction']:.3f}, mean {result[name]['mean_fraction']:.3f}, max {result[name]['max_fraction']:.3f}; "
              f"median trials {result[name]['median_trials']:g}; within 12 trials {within[12]}/{args.repeats}, within 20 {within[20]}/{args.repeats}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
