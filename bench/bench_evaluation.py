"""Evaluation cost on the offline world: the time-versus-limit curve, one lm-eval call versus one per task.

The multi-fidelity search (ASHA) relies on a cheap low-limit evaluation predicting the full one, so this
measures how wall time grows with lm-eval's `limit` (items per task) on a tiny trained model, plus the
fixed costs (HFLM set-up, perplexity). One run measures every limit back to back.

    .venv/bin/python bench/bench_evaluation.py --json bench/out/evaluation.json
On a GPU, lm-eval throughput with batch size auto versus fixed, on a model folder of >= 1B parameters:
    python bench/bench_evaluation.py --device cuda --model DIR --batch-size auto
    python bench/bench_evaluation.py --device cuda --model DIR --batch-size 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("TQDM_DISABLE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from taylor_tune.config import build_eval_spec  # noqa: E402
from taylor_tune.evaluation.evaluate import evaluate  # noqa: E402
from taylor_tune.evaluation.perplexity import perplexity  # noqa: E402
from taylor_tune.evaluation.scorer import make_lm  # noqa: E402
from taylor_tune.evaluation.zero_shot import zero_shot  # noqa: E402
from taylor_tune.sources.data import load_ppl_text  # noqa: E402
from taylor_tune.sources.models import load_model, load_tokenizer  # noqa: E402

LIMITS = [10, 25, 50, 100, 200]


def curve(model, tokenizer, batch_size) -> list[dict]:
    """Per limit, side by side: every task in one simple_evaluate call (what taylor_tune does) and one call
    per task (what it did before; lm-eval's per-call set-up is then paid seven times)."""
    lm = make_lm(model, tokenizer, batch_size)
    zero_shot(lm, build_eval_spec({"task_data": "world", "limit": 5, "ppl": None}), "world")  # warm-up
    rows = []
    for limit in LIMITS:
        spec = build_eval_spec({"task_data": "world", "limit": limit, "ppl": None})
        start = time.perf_counter()
        tasks, _, _ = zero_shot(lm, spec, "world")
        total = time.perf_counter() - start
        start = time.perf_counter()
        for task in spec.tasks:
            zero_shot(lm, build_eval_spec({"task_data": "world", "limit": limit, "ppl": None, "tasks": task}), "world")
        per_task = time.perf_counter() - start
        items = sum(t["n"] for t in tasks.values())
        rows.append({"limit": limit, "seconds": total, "seconds_one_call_per_task": per_task, "items": items,
                     "items_per_s": items / total, "acc_mean": sum(t["score"] for t in tasks.values()) / len(tasks)})
        print(
            f"limit {limit:4d}: one call {total:6.2f} s, one call per task {per_task:6.2f} s "
            f"({per_task / total:.2f}x), "
            f"{items} items, acc_mean {rows[-1]['acc_mean']:.4f}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", default="16")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    batch = args.batch_size if args.batch_size == "auto" else int(args.batch_size)

    start = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device), load_tokenizer(args.model)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    make_lm(model, tokenizer, batch)
    hflm_s = time.perf_counter() - start
    text = load_ppl_text("world")
    start = time.perf_counter()
    ppl = perplexity(model, tokenizer, text)
    ppl_s = time.perf_counter() - start
    print(
        f"load {load_s:.2f}s, HFLM {hflm_s:.2f}s, ppl {ppl['ppl']:.3f} over {ppl['ppl_tokens']} tokens in {ppl_s:.2f}s"
    )
    rows = curve(model, tokenizer, batch)
    start = time.perf_counter()
    evaluate(model, tokenizer, build_eval_spec({"task_data": "world", "ppl": "world"}), model_name=args.model)
    full_s = time.perf_counter() - start
    print(f"full evaluate() (ppl + 7 tasks, all items, fresh HFLM): {full_s:.2f}s")
    result = {
        "machine": {
            "platform": platform.platform(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "device": args.device,
        },
        "model": args.model,
        "batch_size": batch,
        "load_s": load_s,
        "hflm_s": hflm_s,
        "ppl_s": ppl_s,
        "ppl_tokens_per_s": ppl["ppl_tokens"] / ppl_s,
        "curve": rows,
        "full_evaluate_s": full_s,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
