"""Synthetic trial tables with answers built in, and Tune-format experiment folders written from them."""

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

TASKS = ("boolq", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")
METHODS = ("taylor", "layerwise", "blockwise")
SEQ_LENS = (16, 32, 64, 128, 256)
SAMPLES = (128, 256, 512)
# The built-in answers: per model, the method, seq_len and num_samples effects; the best cell gets a bonus.
EFFECTS = {
    "model-a": {
        "method": {"taylor": 0.00, "layerwise": -0.02, "blockwise": 0.03},
        "seq_len": {16: -0.04, 32: -0.02, 64: 0.0, 128: 0.01, 256: 0.005},
        "samples": {128: 0.0, 256: 0.002, 512: 0.004},
        "best": ("blockwise", 128, 512),
    },
    "model-b": {
        "method": {"taylor": 0.02, "layerwise": 0.04, "blockwise": -0.05},
        "seq_len": {16: 0.0, 32: 0.01, 64: 0.02, 128: 0.0, 256: -0.01},
        "samples": {128: 0.004, 256: 0.0, 512: 0.001},
        "best": ("layerwise", 64, 128),
    },
}


def synthetic_trials(seeds=(0,), noise: float = 0.002, n_items: int = 400, rng_seed: int = 0) -> pd.DataFrame:
    """One row per trial in the shape of Tune's results (the columns of docs/specification.md §3), with known best
    configurations."""
    rng = np.random.default_rng(rng_seed)
    rows = []
    for model, effects in EFFECTS.items():
        for method in METHODS:
            for seq_len in SEQ_LENS:
                for samples in SAMPLES:
                    for seed in seeds:
                        base = (
                            0.55 + effects["method"][method] + effects["seq_len"][seq_len] + effects["samples"][samples]
                        )
                        base += 0.03 if (method, seq_len, samples) == effects["best"] else 0.0
                        accs = np.clip(
                            base + rng.normal(0, noise, len(TASKS)) + np.linspace(-0.1, 0.1, len(TASKS)), 0, 1
                        )
                        row = {
                            "trial_id": f"{model}_{method}_{seq_len}_{samples}_{seed}",
                            "model": model,
                            "pruning_method": method,
                            "taylor_seq_len": seq_len,
                            "taylor_num_samples": samples,
                            "seed": seed,
                            "acc_mean": float(accs.mean()),
                            "ppl": float(30 - 20 * accs.mean() + rng.normal(0, 0.1)),
                            "params_count": 1000,
                            "pruning_ratio": 0.2,
                            "stage": "zero_shot_all",
                            "fidelity": 0,
                            "grad_mean_ratio": float(1 + 5 * accs.mean() + rng.normal(0, 0.01)),
                            "grad_norm_ratio": float(rng.uniform(1, 3)),
                            "grad_mean_range": 0.5,  # constant: undefined r
                            "grad_norm_range": float(rng.uniform(0, 1)),
                            "extreme_pruning_layers": int(rng.integers(0, 4)),
                            "time_total_s": 60.0,
                        }
                        for task, acc in zip(TASKS, accs):
                            row[f"acc_{task}"] = float(acc)
                            row[f"acc_{task}_stderr"] = float(np.sqrt(acc * (1 - acc) / (n_items - 1)))
                            sel = float(np.clip(acc + rng.normal(0, 0.01), 0, 1))
                            row[f"acc_{task}_sel"], row[f"acc_{task}_heldout"] = sel, 2 * acc - sel
                        rows.append(row)
    return pd.DataFrame(rows)


def write_tune_folder(rows: pd.DataFrame, root: Path, final_fidelity=None, objective: dict | None = None) -> Path:
    """An experiment folder as Tune writes it: one trial folder with params.json and result.json per row;
    `objective` ({"metric", "mode"}) is recorded in the fixed settings as a sweep records it."""
    root.mkdir(parents=True, exist_ok=True)
    fidelities = [final_fidelity]
    for i, row in enumerate(rows.to_dict(orient="records")):
        folder = root / f"sweep_trainable_abcde_{i:05d}_{i}_model={row['model']}_2026-11-21_00-00-00"
        folder.mkdir()
        config = {k: row[k] for k in ("model", "pruning_method", "taylor_seq_len", "taylor_num_samples", "seed")}
        config["fixed"] = {"evaluation": {"fidelities": fidelities}} | ({"objective": objective} if objective else {})
        (folder / "params.json").write_text(json.dumps(config))
        pruned = {k: v for k, v in row.items() if not k.startswith("acc_")} | {
            "stage": "pruned",
            "training_iteration": 1,
            "trial_id": f"abcde_{i:05d}",
        }
        final = row | {"training_iteration": 2, "trial_id": f"abcde_{i:05d}", "config": config}
        (folder / "result.json").write_text(json.dumps(pruned) + "\n" + json.dumps(final) + "\n")
        (folder / "layer_analysis.json").write_text(
            json.dumps(
                [
                    {
                        "layer": k,
                        "pruning_ratio": 0.1 * k,
                        "retention_ratio": 1 - 0.1 * k,
                        "grad_mean": 0.01 * (k + 1),
                        "grad_norm": 1.0 + k,
                    }
                    for k in range(4)
                ]
            )
        )
    return root


def latex_rows(tex: str) -> list[list[tuple[str, bool]]]:
    """The body rows of a booktabs table (between \\midrule and \\bottomrule, block rules skipped), each cell as
    (text without \\textbf, whether it was bold)."""
    body = tex.split("\\midrule", 1)[1].rsplit("\\bottomrule", 1)[0]
    rows = []
    for line in body.splitlines():
        line = line.strip()
        if not line.endswith("\\\\"):
            continue
        cells = [c.strip() for c in line.removesuffix("\\\\").split("&")]
        rows.append([(c.removeprefix("\\textbf{").removesuffix("}"), c.startswith("\\textbf{")) for c in cells])
    return rows


def by_hand(df, key, value="acc_mean"):
    """{group: (mean, stdev, min, max, n)} with the statistics module: no pandas."""
    groups = {}
    for k, v in zip(df[key], df[value]):
        groups.setdefault(k, []).append(v)
    return {k: (statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else float("nan"), min(v), max(v), len(v))
            for k, v in groups.items()}


def pearson_by_hand(x, y):
    x, y = np.asarray(x, float), np.asarray(y, float)
    r = float(np.corrcoef(x, y)[0, 1])
    t = r * math.sqrt((len(x) - 2) / (1 - r * r))
    return r, float(2 * scipy_stats.t.sf(abs(t), len(x) - 2))
