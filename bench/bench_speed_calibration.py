"""Are the speedup intervals calibrated? One pruned real model timed again and again while the background load
changes, with the two ways the sweep has measured a speedup, side by side in each round:

- once: the unpruned model measured once, at the start, idle; each round's pruned measurement divided by it, the
  interval ± 1.96 × the delta-method `_se` of the two medians (`speed_ratios`, the sweep's method until issue 64);
- paired: the pruned and the unpruned model timed in turn in the round (`measure_paired`), the interval Student's t
  on the pairs' log ratios.

Round i runs beside `loads[i % 3]` CPU-bound busy loops (0, 1, 2 by default, so idle alternates with one and two),
started before the round and stopped after it; within a round the two methods go in alternating order. An interval
covers when it holds the median of the rounds' point estimates of its method (the value a quiet re-measurement would
settle at). The share that covers, per method and speedup, is the calibration: ≥ 80% for a nominal 95% interval is
the target (issue 64, must-show 3).

    python bench/bench_speed_calibration.py --model smollm2-135m --rounds 10 --json bench/speed_calibration.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from taylor_tune.config import PruneConfig, SpeedSpec
from taylor_tune.evaluation.speed import SPEEDUPS, measure_paired, measure_speed, speed_ratios
from taylor_tune.jsonio import write_json
from taylor_tune.pruning.prune import prune
from taylor_tune.sources.models import load_model

# the real demo's settings (experiments/real_demo.yaml): sized for 2 CPU cores
DEMO_SPEED = {"prefill_batch": 1, "prefill_len": 128, "decode_batch": 4, "prompt_len": 32, "new_tokens": 8,
              "repeats": 3, "warmup": 1}


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        p.kill()
        p.wait()


def covers(rounds: list[dict], speedup: str) -> dict:
    """The share of intervals that hold the median of the rounds' point estimates."""
    centre = statistics.median(r[speedup] for r in rounds)
    held = [r[f"{speedup}_low"] <= centre <= r[f"{speedup}_high"] for r in rounds if r[f"{speedup}_low"] is not None]
    widths = [r[f"{speedup}_high"] / r[f"{speedup}_low"] for r in rounds if r[f"{speedup}_low"] is not None]
    return {"median": centre, "covered": sum(held), "of": len(held), "share": sum(held) / len(held),
            "points": [r[speedup] for r in rounds], "median_width_ratio": statistics.median(widths)}


def once_interval(pruned: dict, unpruned: dict) -> dict:
    ratios = speed_ratios(pruned, unpruned)
    out = {}
    for speedup in SPEEDUPS:
        value, se = ratios[speedup], ratios[f"{speedup}_se"]
        out |= {speedup: value, f"{speedup}_low": None if se is None else value - 1.96 * se,
                f"{speedup}_high": None if se is None else value + 1.96 * se}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="taylor")
    parser.add_argument("--sparsity", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--loads", default="0,1,2", help="busy loops beside round i: the (i mod n)-th of these")
    parser.add_argument("--speed", default=json.dumps(DEMO_SPEED), help="SpeedSpec fields as a JSON object")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    spec = SpeedSpec(**json.loads(args.speed))
    loads = [int(n) for n in args.loads.split(",")]

    config = PruneConfig(model=args.model, method=args.method, sparsity=args.sparsity, seq_len=64, num_samples=16,
                         calibration="wiki" if args.model.startswith(("smollm", "qwen")) else "auto",
                         device="cpu", dtype="float32")
    pruned = prune(config).model.eval()
    unpruned = load_model(args.model, dtype=torch.float32).eval()
    baseline = measure_speed(unpruned, spec)  # the sweep's old way: once, at the start, idle

    rows = {"once": [], "paired": []}
    started = time.time()
    for i in range(args.rounds):
        background = busy(loads[i % len(loads)])
        try:
            time.sleep(1.0)  # the loops running before the timing starts
            order = ("once", "paired") if i % 2 == 0 else ("paired", "once")
            for method in order:
                begin = time.perf_counter()
                if method == "once":
                    row = once_interval(measure_speed(pruned, spec), baseline)
                else:
                    row = measure_paired(pruned, unpruned, spec)
                rows[method].append(row | {"load": loads[i % len(loads)], "seconds": time.perf_counter() - begin})
        finally:
            stop(background)
        print(f"round {i + 1}/{args.rounds} beside {loads[i % len(loads)]} busy loop(s): decode "
              f"once {rows['once'][-1]['decode_speedup']:.3f}, paired {rows['paired'][-1]['decode_speedup']:.3f}",
              flush=True)

    result = {"machine": f"{platform.node()} ({os.cpu_count()} cores), torch {torch.__version__}",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": time.time() - started,
              "model": args.model, "method": args.method, "sparsity": args.sparsity, "speed": spec.model_dump(),
              "loads": loads, "rounds": rows,
              "coverage": {method: {s: covers(r, s) for s in SPEEDUPS} for method, r in rows.items()}}
    print("| speedup | method | intervals holding the median of the points | median | median interval width "
          "(high / low) |\n|---|---|---:|---:|---:|")
    for speedup in SPEEDUPS:
        for method in rows:
            c = result["coverage"][method][speedup]
            print(f"| {speedup} | {method} | {c['covered']} of {c['of']} ({c['share']:.0%}) | {c['median']:.3f} | "
                  f"{c['median_width_ratio']:.2f} |")
    for method, r in rows.items():
        print(f"{method}: {statistics.median(x['seconds'] for x in r):.2f} s a measurement (median of the rounds)")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
