"""The report's bootstrap interval of Kendall's tau-b (`stats.kendall_tau`, 2000 resamples) against the same bootstrap
with one scipy call per resample (what it was before), side by side in one process: the two alternate, RUNS times
each, per number of configurations; the ratio is taken pair by pair (median, min, max). Both give the same interval
(checked here to 1e-12, and in tests/reporting/test_stats_references.py).

    .venv/bin/python bench/bench_kendall.py --json bench/out/kendall.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
from scipy import stats as scipy_stats

from taylor_tune.jsonio import write_json
from taylor_tune.reporting.stats import kendall_tau


def per_resample(x, y, draws: int = 2000, seed: int = 0) -> list[float]:
    rng, taus = np.random.default_rng(seed), []
    for _ in range(draws):
        pick = rng.integers(0, len(x), len(x))
        if len(set(pick.tolist())) > 2:
            value = scipy_stats.kendalltau(x[pick], y[pick]).statistic
            if np.isfinite(value):
                taus.append(value)
    return [float(v) for v in np.percentile(taus, [2.5, 97.5])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rng, rows = np.random.default_rng(0), []
    for n in (12, 45, 135):
        x = np.round(rng.normal(0, 3, n))
        y = np.round(x + rng.normal(0, 3, n))
        assert np.allclose(kendall_tau(x, y)["ci95"], per_resample(x, y), rtol=0, atol=1e-12)
        new, old = [], []
        for _ in range(args.runs):
            begin = time.perf_counter()
            kendall_tau(x, y)
            new.append(time.perf_counter() - begin)
            begin = time.perf_counter()
            per_resample(x, y)
            old.append(time.perf_counter() - begin)
        ratios = sorted(o / w for o, w in zip(old, new))
        rows.append({"configurations": n, "vectorized_s": statistics.median(new),
                     "per_resample_s": statistics.median(old), "speedup_median": statistics.median(ratios),
                     "speedup_min": ratios[0], "speedup_max": ratios[-1]})
        print(rows[-1], flush=True)
    if args.json:
        write_json(args.json, {"rows": rows, "runs": args.runs, "machine": {"platform": platform.platform()},
                               "date": time.strftime("%Y-%m-%d %H:%M")})


if __name__ == "__main__":
    main()
