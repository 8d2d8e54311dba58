"""Keep a sweep's results in the repository: each trial folder's JSON files (params, Tune's result lines, config,
evaluation, layer analysis) and its per-item outcomes and perplexity windows (parquet), without checkpoints,
TensorBoard events or the large pruning_summary.json, and the importance cache's events.jsonl (which pass was
computed, and in how many seconds), not its entries. bench/bench_search.py, bench/bench_race.py and `taylor-tune
report` read the copy as they read the sweep's folder. Run it again as a long sweep goes on: it copies what is new;
several sweeps of one grid (its configurations run in parts) export into one folder, their cache events merged.

    .venv/bin/python bench/export_grid.py runs/sweeps/real_paper_grid bench/real_paper_grid
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from taylor_tune.storage.cache import Store

KEEP = ("params.json", "result.json", "config.json", "evaluation.json", "layer_analysis.json")
KEEP_PATTERNS = ("outcomes_*.parquet", "ppl_windows*.parquet")


def export(source: Path, target: Path) -> int:
    # finished trials only (their evaluation written): a running one's files are copied on a later run, whole
    folders = sorted(p for p in source.iterdir() if (p / "params.json").is_file() and (p / "evaluation.json").is_file())
    for folder in folders:
        (target / folder.name).mkdir(parents=True, exist_ok=True)
        kept = [folder / name for name in KEEP] + [p for pattern in KEEP_PATTERNS for p in folder.glob(pattern)]
        for path in kept:
            if path.is_file():
                shutil.copy2(path, target / folder.name / path.name)
    events = Store(source / "importance_cache").events()
    if events:  # merged, not replaced: a grid finished in several sweeps keeps every sweep's passes (one log)
        kept = target / "importance_cache" / "events.jsonl"
        kept.parent.mkdir(parents=True, exist_ok=True)
        lines = kept.read_text().splitlines() if kept.is_file() else []
        seen = set(lines)
        new = [line for line in map(json.dumps, events) if line not in seen]
        kept.write_text("".join(f"{line}\n" for line in lines + new))
    return len(folders)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(f"{export(Path(sys.argv[1]), Path(sys.argv[2]))} trial folders copied to {sys.argv[2]}")
