"""The experts method on the offline world's four tiny trained mixtures: quality against the share of experts removed
for each expert criterion, and the calibration text, with paired intervals (BENCHMARKS.md, "Expert pruning").

Runs experiments/moe_bench.yaml through Ray (a sweep: resumed where it stopped), scores each unpruned model on the
same items, then reads the finished sweep as the report does and writes, per model:
- acc_mean of every criterion at every share (mean over the two calibration texts);
- each criterion against the best one, paired by configuration on the same items (`stats.paired_levels`: the
  difference in acc_mean and its task-stratified standard error);
- the calibration texts against each other, paired the same way.

    .venv/bin/python bench/bench_moe.py --storage runs/sweeps --out bench/moe_criteria.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def unpruned(model: str, experiment: dict) -> float:
    """The unpruned model's acc_mean on the sweep's own tasks and items."""
    import torch

    from taylor_tune.config import build_eval_spec
    from taylor_tune.evaluation.evaluate import evaluate
    from taylor_tune.sources.models import load_model, load_tokenizer

    fields = {k: v for k, v in experiment["evaluation"].items() if k not in ("fidelities", "speed")}
    spec = build_eval_spec(fields | {"ppl": None, "limit": None})
    loaded = load_model(model, device="cpu", dtype=torch.float32)
    return float(evaluate(loaded, load_tokenizer(model), spec, model_name=model)["acc_mean"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", default="runs/sweeps")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "moe_criteria.json")
    args = parser.parse_args()
    experiment_file = REPO / "experiments" / "moe_bench.yaml"
    subprocess.run([sys.executable, "-m", "taylor_tune", "sweep", str(experiment_file), "--storage", args.storage],
                   check=True)

    import yaml

    from taylor_tune.reporting import build_report, stats

    experiment = yaml.safe_load(experiment_file.read_text())
    report = build_report(str(Path(args.storage) / experiment["name"]))
    out = {}
    for model, ranked in sorted(report.models.items()):
        valid = ranked.valid.assign(criterion_label=stats.method_labels(ranked.valid))
        grid = valid.pivot_table(index="criterion_label", columns="expert_sparsity", values="acc_mean", aggfunc="mean")
        best = ranked.methods["best_method_by_mean"]
        criteria = stats.paired_levels(valid, "pruning_method", best, report.table.outcomes, report.z,
                                       labels=valid["criterion_label"])
        by_text = valid.groupby("calibration")["acc_mean"].mean()
        texts = stats.paired_levels(valid, "calibration", by_text.idxmax(), report.table.outcomes, report.z)
        out[model] = {
            "unpruned_acc_mean": unpruned(model, experiment),
            "acc_mean_by_criterion_and_share": {c: {str(s): round(float(v), 4) for s, v in row.items()}
                                                for c, row in grid.iterrows()},
            "best_criterion_by_mean": best,
            "criteria_against_best": criteria.round(4).to_dict(orient="records"),
            "best_calibration_by_mean": by_text.idxmax(),
            "calibration_against_best": texts.round(4).to_dict(orient="records"),
        }
        print(json.dumps({model: out[model]}, indent=1), flush=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
