"""Report build time and peak memory for a large synthetic experiment (issue 5: 10,000 trials, target <= 30 s).

Two inputs, timed separately in one run: a DataFrame of N trials, and the same trials written as a Tune
experiment folder (one trial folder with params.json and result.json each), which is what
`taylor-tune report PATH` reads. Each phase: load (folder only), build (all statistics incl. fANOVA),
render (text + Markdown), write (every file: CSVs, JSON, LaTeX, PNGs). Peak memory is the process's
max RSS (getrusage), reported with the RSS after imports so that the report's own share is visible.

    .venv/bin/python bench/bench_report.py --trials 10000 --json bench/out/report.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from taylor_tune.reporting import build_report, load_trials, render_markdown, render_text, write_report

TASKS = ("boolq", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")


def synthetic(n: int, seed: int = 0) -> pd.DataFrame:
    """n trials over 3 models x the paper grid (45 configurations), calibration seeds repeating the grid."""
    rng = np.random.default_rng(seed)
    grid = [
        (m, s, k) for m in ("taylor", "layerwise", "blockwise") for s in (16, 32, 64, 128, 256) for k in (128, 256, 512)
    ]
    rows = []
    for i in range(n):
        model = ("llama", "qwen", "mistral")[i % 3]
        method, seq_len, samples = grid[(i // 3) % len(grid)]
        accs = np.clip(rng.normal(0.55, 0.05, len(TASKS)), 0, 1)
        row = {"trial_id": f"t{i:06d}", "model": model, "pruning_method": method, "taylor_seq_len": seq_len,
               "taylor_num_samples": samples, "seed": i // (3 * len(grid)), "acc_mean": float(accs.mean()),
               "ppl": float(rng.normal(12, 1)), "params_count": 6_400_000_000, "pruning_ratio": 0.2, "fidelity": 0,
               "grad_mean_ratio": float(rng.uniform(1, 3)), "grad_norm_ratio": float(rng.uniform(1, 12)),
               "grad_mean_range": float(rng.uniform(0, 1)), "grad_norm_range": float(rng.uniform(0, 1)),
               "extreme_pruning_layers": int(rng.integers(0, 10)), "time_total_s": 2100.0, "stage": "zero_shot_all"}
        for task, acc in zip(TASKS, accs):
            sel = float(np.clip(acc + rng.normal(0, 0.01), 0, 1))
            row |= {f"acc_{task}": float(acc), f"acc_{task}_stderr": float(np.sqrt(acc * (1 - acc) / 999)),
                    f"acc_{task}_sel": sel, f"acc_{task}_heldout": 2 * acc - sel}
        rows.append(row)
    return pd.DataFrame(rows)


def write_folder(df: pd.DataFrame, root: Path) -> None:
    root.mkdir(parents=True)
    for i, row in enumerate(df.to_dict(orient="records")):
        folder = root / f"sweep_trainable_bench_{i:05d}_{i}_model={row['model']}"
        folder.mkdir()
        config = {k: row[k] for k in ("model", "pruning_method", "taylor_seq_len", "taylor_num_samples", "seed")}
        (folder / "params.json").write_text(json.dumps(config | {"fixed": {"evaluation": {"fidelities": [None]}}}))
        (folder / "result.json").write_text(
            json.dumps({k: v for k, v in row.items() if not k.startswith("acc_")} | {"stage": "pruned"})
            + "\n"
            + json.dumps(row)
            + "\n"
        )


def timed(phases: dict, name: str, fn):
    start = time.perf_counter()
    value = fn()
    phases[name] = round(time.perf_counter() - start, 3)
    return value


def run(source, out: Path) -> dict:
    phases: dict = {}
    table = timed(phases, "load", lambda: load_trials(source))
    report = timed(phases, "build", lambda: build_report(table))
    timed(phases, "render", lambda: (render_text(report), render_markdown(report)))
    files = timed(phases, "write", lambda: write_report(report, out))
    phases["total"] = round(sum(phases.values()), 3)
    phases["files"] = len(files)
    phases["valid_trials"] = len(report.table.valid)
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rss_after_imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    df = synthetic(args.trials)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        from_frame = run(df, tmp / "report-frame")
        start = time.perf_counter()
        write_folder(df, tmp / "experiment")
        folder_write_s = time.perf_counter() - start
        from_folder = run(str(tmp / "experiment"), tmp / "report-folder")
    result = {
        "trials": args.trials, "machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
        "date": time.strftime("%Y-%m-%d"), "from_dataframe_s": from_frame, "from_tune_folder_s": from_folder,
        "writing_the_synthetic_folder_s": round(folder_write_s, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_after_imports_mib": round(rss_after_imports, 1),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
