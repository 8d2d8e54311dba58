"""Issue 64, must-show 5: on the 300-item protocol (bench/bench_families.py --outcomes), how many configuration pairs
the paired test separates against the independent one, and how much tighter the paired standard error is.

For every pair of configurations of one model (the pruned rows, and each of them against the unpruned model):
- independent: acc_mean(a) - acc_mean(b) against 1.96 * sqrt(se_a^2 + se_b^2), se the task-stratified stderr the
  report uses (lm-eval's per-task stderrs, `stats.acc_mean_stderr`);
- paired: the same difference from the per-item outcomes on the shared items, its task-stratified standard error
  (`paired.paired_difference`, the delta method), checked against the paired bootstrap (`paired_bootstrap`);
- perplexity, paired by window in log ppl (`paired.paired_log_ppl`); perplexity has no independent bound;
- per task, the exact McNemar test (`paired.mcnemar`) at 0.05.

    .venv/bin/python bench/paired_protocol.py --json bench/baselines_paired.json [--out bench/paired_protocol.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from taylor_tune.jsonio import write_json
from taylor_tune.paired import mcnemar, paired_bootstrap, paired_difference, paired_log_ppl
from taylor_tune.reporting.frame import scored_items
from taylor_tune.reporting.stats import Z95, acc_mean_stderr
from taylor_tune.schema import task_key, zero_shot_stage
from taylor_tune.storage.folder import read_outcomes, read_ppl_windows


def configurations(data: dict, model: str, folder: Path) -> dict[str, dict]:
    """name -> {acc_mean, se, items, windows, ppl} for the unpruned model and every run of `model` with outcomes."""
    limit = data["settings"]["eval_limit"]
    rows = {"unpruned": data["unpruned_quality"][model]} | {
        key.split("|")[2]: run for key, run in data["runs"].items()
        if key.startswith(f"{model}|") and key.endswith("|none") and "outcomes" in run}
    out = {}
    for name, row in rows.items():
        where = str(folder / row["outcomes"])
        reported = pd.Series({task_key(t): e["score"] for t, e in row["tasks"].items()})
        items = scored_items(read_outcomes(where, zero_shot_stage(limit)), reported)
        if items is None:
            raise SystemExit(f"{model} {name}: the stored outcomes do not reproduce the reported task scores")
        stderr = pd.DataFrame([{task_key(t, "_stderr"): e["score_stderr"] for t, e in row["tasks"].items()}])
        out[name] = {"acc_mean": row["acc_mean"], "se": float(acc_mean_stderr(stderr, tuple(row["tasks"])).iloc[0]),
                     "items": items, "windows": read_ppl_windows(where), "ppl": row["ppl"]}
    return out


def compare(a: dict, b: dict) -> dict:
    pair = paired_difference(a["items"], b["items"])
    boot = paired_bootstrap(a["items"], b["items"], draws=2000, seed=0)
    independent = math.hypot(a["se"], b["se"])
    ppl = paired_log_ppl(a["windows"], b["windows"])
    tasks = sorted(set(a["items"].index.get_level_values(0)))
    exact = {t: mcnemar(a["items"].xs(t, drop_level=False), b["items"].xs(t, drop_level=False)) for t in tasks}
    return {
        "difference": pair.difference, "reported_difference": a["acc_mean"] - b["acc_mean"],
        "independent_se": independent, "paired_se": pair.stderr, "bootstrap_se": boot.stderr,
        "se_ratio": pair.stderr / independent,
        "separated_independent": bool(abs(a["acc_mean"] - b["acc_mean"]) > Z95 * independent),
        "separated_paired": pair.separated(Z95),
        "discordant_share": float((a["items"] != b["items"].reindex(a["items"].index)).mean()),
        "log_ppl_difference": None if ppl is None else ppl.difference,
        "log_ppl_se": None if ppl is None else ppl.stderr,
        "ppl_separated_paired": None if ppl is None else ppl.separated(Z95),
        "tasks_mcnemar_below_005": sum(1 for r in exact.values() if r and r["p"] < 0.05),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, help="bench_families.py's record, run with --outcomes")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    data = json.loads(args.json.read_text())
    folder = args.json.with_suffix(".outcomes")
    result = {"source": str(args.json), "models": {}}
    for model in data["settings"]["models"]:
        if model not in data.get("unpruned_quality", {}) or "outcomes" not in data["unpruned_quality"][model]:
            continue
        configs = configurations(data, model, folder)
        pairs = {f"{x} vs {y}": compare(configs[x], configs[y]) for x, y in itertools.combinations(configs, 2)}
        result["models"][model] = {"configurations": {n: {"acc_mean": c["acc_mean"], "se": c["se"], "ppl": c["ppl"]}
                                                      for n, c in configs.items()}, "pairs": pairs}
        print(f"\n**{model}** ({len(configs)} configurations with outcomes, {len(pairs)} pairs)\n")
        print("| pair | difference | independent se | paired se (bootstrap) | ratio | discordant | separated: "
              "independent / paired | log ppl difference ± se | tasks McNemar p < 0.05 |")
        print("|---|---:|---:|---:|---:|---:|---|---:|---:|")
        for name, p in pairs.items():
            ppl = "–" if p["log_ppl_difference"] is None else f"{p['log_ppl_difference']:+.4f} ± {p['log_ppl_se']:.4f}"
            print(f"| {name} | {p['difference']:+.4f} | {p['independent_se']:.4f} | {p['paired_se']:.4f} "
                  f"({p['bootstrap_se']:.4f}) | {p['se_ratio']:.2f} | {p['discordant_share']:.3f} | "
                  f"{'yes' if p['separated_independent'] else 'no'} / {'yes' if p['separated_paired'] else 'no'} | "
                  f"{ppl} | {p['tasks_mcnemar_below_005']} |")
        for among, selected in (("pruned configurations", {k: v for k, v in pairs.items() if "unpruned" not in k}),
                                ("with the unpruned model", {k: v for k, v in pairs.items() if "unpruned" in k})):
            if not selected:
                continue
            ratios = np.array([p["se_ratio"] for p in selected.values()])
            summary = {"pairs": len(selected),
                       "separated_independent": sum(p["separated_independent"] for p in selected.values()),
                       "separated_paired": sum(p["separated_paired"] for p in selected.values()),
                       "separated_paired_only": sum(p["separated_paired"] and not p["separated_independent"]
                                                    for p in selected.values()),
                       "ppl_separated_paired": sum(bool(p["ppl_separated_paired"]) for p in selected.values()),
                       "se_ratio_median": float(np.median(ratios)), "se_ratio_min": float(ratios.min()),
                       "se_ratio_max": float(ratios.max())}
            result["models"][model][among] = summary
            print(f"\n{among}: {summary}")
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
