"""Are two reports of the same sweep the same numbers? Compares each model's consolidated table
(all_methods_results.csv) of two report folders, trial by trial (matched by their configuration), column by column,
exactly: every column but the measured speeds and seconds (which no two runs share), the paths and trial ids, and
the importance cache's event (hit or computed: which trial of a model came first).

    python bench/compare_reports.py runs/reports/real_demo OTHER/runs/reports/real_demo

Exit 0 and one line per model when every compared value is equal; exit 1 naming each column that differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

# what no two runs share: timings, speeds, where and when
VARYING = ("speed", "tokens_per_s", "timed", "unpruned_", "memory_ratio", "peak", "trial_id", "_dir", "date",
           "timestamp", "time_", "pid", "hostname", "node_ip", "importance_cache")
KEYS = ("model", "pruning_method", "taylor_seq_len", "taylor_num_samples", "seed")


def compared(frame: pd.DataFrame) -> pd.DataFrame:
    columns = [c for c in frame.columns if not c.endswith("_s") and not any(part in c for part in VARYING)]
    keys = [k for k in KEYS if k in columns]
    return frame[columns].sort_values(keys).reset_index(drop=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    args = parser.parse_args()
    differ = 0
    for table in sorted(args.a.glob("consolidated_*/all_methods_results.csv")):
        a = compared(pd.read_csv(table))
        b = compared(pd.read_csv(args.b / table.relative_to(args.a)))
        if list(a.columns) != list(b.columns) or len(a) != len(b):
            print(f"{table.parent.name}: other columns or trials ({a.shape} against {b.shape})")
            differ += 1
            continue
        columns = [c for c in a.columns if not a[c].equals(b[c])]
        print(f"{table.parent.name}: {len(a)} trials x {len(a.columns)} columns, "
              + ("every value equal" if not columns else "differ in " + ", ".join(columns)))
        differ += bool(columns)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
