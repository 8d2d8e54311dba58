"""The host's share of a zero-shot pass: everything but the model, over the seven real tasks at every item.

On a GPU the device waits while the host builds lm-eval's tasks, reads the requests from the sweep's cache, plans and
prepares the batches and scores the answers (BENCHMARKS: a third of the 8B pass's wall time). This measures that
work alone, on any machine: the prefix scorer's `_forward` (the model's forward and the scoring on the device) is
replaced by zeros of the answer's shape, so a pass times only the host's part. The requests are built once into a
request cache (`--cache`, kept between runs) and read back in every timed pass, as in a sweep's later trial. Each
timed pass is one line of JSON on stdout (seconds, of which reading the requests); `--json` also writes them.

    .venv/bin/python bench/bench_host.py --cache /tmp/host_cache --repeats 3
    # two checkouts side by side, alternating (the script taken from this one, the package from each):
    for i in 1 2 3; do for tree in /tmp/before .; do PYTHONPATH=$tree .venv/bin/python bench/bench_host.py \\
        --cache /tmp/host_cache --repeats 1 --label $tree; done; done
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="the request cache's folder (built on first use)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label", default="")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

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
    build = evaluator.zero_shot(None)  # builds the cache's entries, or reads them if an earlier run did
    rows = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        shots = evaluator.zero_shot(None)
        rows.append({"label": args.label, "seconds": time.perf_counter() - start, "requests_s": shots.requests_seconds,
                     "items": sum(e["n"] for e in shots.tasks.values()), "first_pass_built": build.requests_built})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
