"""The host's share of a zero-shot pass: everything but the model, over the seven real tasks at every item.

On a GPU the device waits while the host builds lm-eval's tasks, reads the requests from the sweep's cache, plans and
prepares the batches and scores the answers (BENCHMARKS: a third of the 8B pass's wall time). This measures that
work alone, on any machine: the prefix scorer's `_forward` (the model's forward and the scoring on the device) is
replaced by zeros of the answer's shape, so a pass times only the host's part. The requests are built once into a
request cache (`--cache`, kept between runs) and read back in every timed pass, as in a sweep's later trial. A
process's first pass (`first_s`: what a worker's first trial pays, the tasks built and the cache read) is timed
apart from the later ones (`seconds`: a reused worker's later trials). Each timed pass is one line of JSON on stdout
(seconds, of which reading the requests); `--json` also writes them. `--limit`: items per task (default: every item).

    .venv/bin/python bench/bench_host.py --cache /tmp/host_cache --repeats 3
    # two checkouts side by side, alternating (the script taken from this one, the package from each):
    for i in 1 2 3; do for tree in /tmp/before .; do PYTHONPATH=$tree .venv/bin/python bench/bench_host.py \\
        --cache /tmp/host_cache --repeats 1 --label $tree; done; done >> runs.jsonl
    .venv/bin/python bench/bench_host.py --summarize runs.jsonl --base /tmp/before   # ratios against that label
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def summarize(paths: list[Path], base: str) -> dict:
    """Per label and measure (`seconds`: a later pass, `first_s`: a process's first), the median and range, and each
    label's median over the base label's with a 95% bootstrap interval (the passes of each side resampled) and the
    two-sided Mann-Whitney p."""
    import numpy as np
    from scipy.stats import mannwhitneyu

    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.startswith("{")]
    out, rng = {}, np.random.default_rng(0)
    for measure in ("seconds", "first_s"):
        by_label: dict[str, list[float]] = {}
        seen = set()
        for row in rows:
            if measure == "first_s" and (row["label"], row["pid"]) in seen:
                continue  # a process's first pass is on each of its rows: counted once
            seen.add((row["label"], row["pid"]))
            by_label.setdefault(row["label"], []).append(row[measure])
        reference = np.array(by_label[base])
        for label, values in by_label.items():
            values = np.array(values)
            entry = {"n": len(values), "median": float(np.median(values)), "min": float(values.min()),
                     "max": float(values.max())}
            if label != base:
                draws = [np.median(rng.choice(values, len(values))) / np.median(rng.choice(reference, len(reference)))
                         for _ in range(4000)]
                entry |= {"ratio": float(np.median(values) / np.median(reference)),
                          "low": float(np.percentile(draws, 2.5)), "high": float(np.percentile(draws, 97.5)),
                          "p": float(mannwhitneyu(values, reference).pvalue)}
            out[f"{label} {measure}"] = entry
            print(f"{label} {measure}: " + json.dumps(entry), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summarize", type=Path, nargs="+", help="JSON-lines files of earlier runs: summarize them")
    parser.add_argument("--base", default="", help="the label the others are compared with (--summarize)")
    parser.add_argument("--cache", type=Path, help="the request cache's folder (built on first use)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label", default="")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize, args.base)
        return
    if args.cache is None:
        parser.error("--cache is required to run passes")

    from taylor_tune.config import EvalSpec
    from taylor_tune.evaluation import scorer
    from taylor_tune.evaluation.evaluate import Evaluator
    from taylor_tune.evaluation.requests import RequestCache
    from taylor_tune.sources.models import load_model, load_tokenizer

    def no_model(self, prepared):  # the device's part of a batch: its answers, [2, requests]
        return torch.zeros(2, len(prepared.requests), dtype=torch.float64)

    scorer.PrefixLM._forward = no_model
    # SmolLM2's tokenizer and model class; the weights never run
    evaluator = Evaluator(load_model("smollm2-135m"), load_tokenizer("smollm2-135m"),
                          EvalSpec(tasks="all", task_data="real", ppl=None), model_name="smollm2-135m",
                          request_cache=RequestCache(args.cache))
    start = time.perf_counter()
    build = evaluator.zero_shot(args.limit)  # builds the cache's entries, or reads them if an earlier run did
    first = time.perf_counter() - start
    rows = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        shots = evaluator.zero_shot(args.limit)
        rows.append({"label": args.label, "limit": args.limit, "seconds": time.perf_counter() - start,
                     "requests_s": shots.requests_seconds, "items": sum(e["n"] for e in shots.tasks.values()),
                     "first_s": first, "first_pass_built": build.requests_built, "pid": os.getpid()})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
