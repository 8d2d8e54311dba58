"""Keep a finished sweep's results in the repository: each trial folder's JSON files (params, Tune's result lines,
config, evaluation, layer analysis), without checkpoints, TensorBoard events or the large pruning_summary.json,
and the importance cache's events.jsonl (which pass was computed, and in how many seconds), not its entries.
bench/bench_search.py and `taylor-tune report` read the copy as they read the sweep's folder.

    .venv/bin/python bench/export_grid.py runs/sweeps/real_paper_grid bench/real_paper_grid
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

KEEP = ("params.json", "result.json", "config.json", "evaluation.json", "layer_analysis.json")


def export(source: Path, target: Path) -> int:
    folders = sorted(p for p in source.iterdir() if (p / "params.json").is_file())
    for folder in folders:
        (target / folder.name).mkdir(parents=True, exist_ok=True)
        for name in KEEP:
            if (folder / name).is_file():
                shutil.copy2(folder / name, target / folder.name / name)
    events = source / "importance_cache" / "events.jsonl"
    if events.is_file():
        (target / "importance_cache").mkdir(parents=True, exist_ok=True)
        shutil.copy2(events, target / "importance_cache" / "events.jsonl")
    return len(folders)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(f"{export(Path(sys.argv[1]), Path(sys.argv[2]))} trial folders copied to {sys.argv[2]}")
