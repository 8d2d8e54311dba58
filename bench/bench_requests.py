"""What a zero-shot pass costs outside the model: lm-eval's own request building against building once per pass and
once per sweep (issue 30, point 4).

The seven real tasks, every item (or --limit), with a model's tokenizer and a scorer that answers from the tokens
without a forward pass, so that the seconds are the pass's own: task set-up, building the requests (prompt templates),
tokenizing them, scoring the answers (lm-eval's process_results) and aggregating. Side by side in one process:

- `stock`: lm-eval's simple_evaluate as it comes (templates compiled for every document, requests built and
  tokenized in every pass);
- `per_pass`: taylor_tune's pass without a cache (templates compiled once, each request tokenized once);
- `first_trial`: with a sweep's request cache, empty (the requests built and stored);
- `later_trial`: the same cache again (the requests read back; lm-eval builds none).

Each mode's results (every task's acc and acc_norm) must equal stock's. Seconds per pass and, for taylor_tune's
passes, the seconds of it spent on the requests; the JSON also records the cache's size on disk.

    python bench/bench_requests.py --models smollm2-135m,qwen2.5-0.5b --json bench/requests.json
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch
from lm_eval import simple_evaluate

from taylor_tune.compat.lm_eval import without_environment_record
from taylor_tune.config import EvalSpec
from taylor_tune.evaluation import zero_shot
from taylor_tune.evaluation.requests import PassRequests, RequestCache
from taylor_tune.evaluation.scorer import PrefixLM
from taylor_tune.jsonio import write_json
from taylor_tune.sources.models import load_model, load_tokenizer


class TokensOnly(PrefixLM):
    """Answers every request from its tokens alone (deterministic, no model): the pass without its forward passes."""

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
        return [(-len(context) - sum(continuation) / 1e4, len(continuation) % 2 == 0)
                for _, context, continuation in requests]


def scores(result: dict) -> dict:
    return {task: (r.get("acc,none"), r.get("acc_norm,none")) for task, r in result["results"].items()}


def measure(tokenizer_of: str, limit: int | None) -> dict:
    spec = EvalSpec(task_data="real", limit=limit, ppl=None)
    sources = [zero_shot.task_source(task, "real") for task in spec.tasks]
    lm = TokensOnly(pretrained=load_model("tiny-llama-random", device="cpu"), tokenizer=load_tokenizer(tokenizer_of),
                    device="cpu", batch_size=16)
    lm.scorer = "prefix"
    cache_dir = Path(tempfile.mkdtemp(prefix="requests-"))
    out = {}
    try:
        start = time.perf_counter()
        with without_environment_record():
            stock = simple_evaluate(model=lm, tasks=[s for s, _ in sources], task_manager=sources[0][1], limit=limit,
                                    bootstrap_iters=1000, log_samples=True, verbosity="ERROR")
        out["stock"] = {"seconds": time.perf_counter() - start}
        for mode, cache in (("per_pass", None), ("first_trial", RequestCache(cache_dir)),
                            ("later_trial", RequestCache(cache_dir))):
            requests = PassRequests(lm, cache)
            start = time.perf_counter()
            result = zero_shot._simple_evaluate(lm, spec, sources, requests)
            out[mode] = {"seconds": time.perf_counter() - start, "requests_s": requests.seconds,
                         "tasks_built": requests.built}
            if scores(result) != scores(stock):
                raise SystemExit(f"{tokenizer_of} {mode}: results differ from lm-eval's own")
            print(f"{tokenizer_of} {mode}: {out[mode]}", flush=True)
        out["cache_bytes"] = sum(f.stat().st_size for f in cache_dir.glob("*.json"))
        out["requests"] = sum(len(s["arguments"]) for task in stock["samples"].values() for s in task)
        out["items"] = sum(len(s) for s in stock["samples"].values())
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m", help="comma-separated: whose tokenizers")
    parser.add_argument("--limit", type=int, default=None, help="items per task (default every item)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    os.environ["TQDM_DISABLE"] = "1"
    data = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
            "date": time.strftime("%Y-%m-%d %H:%M"), "limit": args.limit, "tokenizers": {}}
    for model in args.models.split(","):
        data["tokenizers"][model] = measure(model, args.limit)
        write_json(args.json, data)


if __name__ == "__main__":
    main()
