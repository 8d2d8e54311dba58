"""The trial's peak-memory estimate (`taylor_tune.sweep.memory`) against each stage's measured peak: every stage run
for real on random LLaMA-shaped models in a fresh process each (`tests/sweep/memory_probe.py`: what the stage adds
to the resident high-water mark, glibc's mmap threshold fixed), and the estimate's share of it. The estimate is a
lower bound: every share must be at most 1.

    python bench/bench_memory.py --json bench/out/memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.sweep.test_memory import STAGES, estimate  # noqa: E402  (the test's own estimate of a stage)

# (dtype, hidden, intermediate, layers, vocab, batch, seq_len)
SHAPES = {"vocab-bound fp32": ("float32", 128, 512, 2, 32000, 8, 256),
          "wide-mlp fp32": ("float32", 512, 2048, 4, 1000, 8, 512),
          "layer-bound fp32": ("float32", 1024, 1024, 4, 1000, 4, 1024),
          "vocab-bound bf16": ("bfloat16", 128, 512, 2, 32000, 8, 256),
          "layer-bound bf16": ("bfloat16", 1024, 1024, 4, 1000, 4, 1024)}


def measure(stage: str, dtype: str, sizes) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "tests.sweep.memory_probe", stage, dtype, *map(str, sizes)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    rows = []
    for name, (dtype, *sizes) in SHAPES.items():
        for stage in STAGES:
            measured = measure(stage, dtype, sizes)
            predicted = estimate(stage, dtype, *sizes, measured["params"], measured["layer_params"])
            rows.append({"shape": name, "stage": stage, "measured_mib": measured["added"] / 2**20,
                         "estimate_mib": predicted / 2**20, "share": predicted / measured["added"]})
            print(f"{name:18} {stage:20} measured {rows[-1]['measured_mib']:8.1f} MiB  estimate "
                  f"{rows[-1]['estimate_mib']:8.1f} MiB  share {rows[-1]['share']:.2f}", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": platform.node(), "cpus": os.cpu_count(),
                                           "date": datetime.now(UTC).isoformat(timespec="seconds"),
                                           "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
