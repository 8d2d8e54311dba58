"""One process's call into the importance cache, with a fake compute step (for tests/pruning/test_importance_cache.py).

    python -m tests.cache_worker ROOT SECONDS OUT [--heartbeat-s H --stale-s S]
The compute step appends this pid to ROOT/computes, sleeps SECONDS and returns fixed scores; OUT gets the event
and the scores read back."""

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from taylor_tune.pruning.importance import Importance
from taylor_tune.pruning.importance_cache import ImportanceCache
from taylor_tune.pruning.plan import GroupScores


def fake_results() -> dict[int, Importance]:
    scores = GroupScores(attn=(np.array([1.0, 2.0]),), mlp=(np.array([3.0, 4.0, 5.0]),))
    return {8: Importance(8, scores, np.array([0.5]), np.array([0.25]))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("seconds", type=float)
    parser.add_argument("out", type=Path)
    parser.add_argument("--heartbeat-s", type=float, default=0.2)
    parser.add_argument("--stale-s", type=float, default=60)
    args = parser.parse_args()
    cache = ImportanceCache(args.root, poll_s=0.05, heartbeat_s=args.heartbeat_s, stale_s=args.stale_s)

    def compute():
        with open(args.root / "computes", "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(args.seconds)
        return fake_results()

    results = cache.get_or_compute({"model": "fake", "seq_len": 16}, [8], compute)
    args.out.write_text(json.dumps({"event": cache.last_event, "mlp": results[8].scores.mlp[0].tolist()}))


if __name__ == "__main__":
    main()
