"""The unpruned real models on the real offline world: accuracy per task with stderr, wiki perplexity, and cost.

For each model: held-out wiki perplexity (tokens/s), then each of the seven real tasks alone at --limit items
(acc, acc_norm, stderr, items/s), one lm-eval call per task so that each task's cost is its own. Results go to
--json after every step; a killed run continues where it stopped (steps already in the file are skipped).
Fetch and conversion times are read from each asset's asset.json (what `taylor-tune fetch` measured).

    python bench/bench_real_world.py --models smollm2-135m qwen2.5-0.5b --limit 200 --json bench/out/real_world.json
    python bench/bench_real_world.py --models smollm2-135m --limit 5 --ppl-max-windows 4 --json /tmp/r.json   # a check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from taylor_tune.config import ZERO_SHOT_TASKS, EvalSpec
from taylor_tune.evaluation.perplexity import perplexity
from taylor_tune.evaluation.scorer import make_lm
from taylor_tune.evaluation.zero_shot import zero_shot
from taylor_tune.sources.assets import ASSETS, require
from taylor_tune.sources.data import load_ppl_text
from taylor_tune.sources.models import load_model, load_tokenizer


def save(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b"])
    parser.add_argument("--tasks", nargs="+", default=list(ZERO_SHOT_TASKS))
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--ppl-window", type=int, default=128)
    parser.add_argument("--ppl-max-windows", type=int, default=None)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()

    data = json.loads(args.json.read_text()) if args.json.is_file() else {}
    data.setdefault("machine", {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                                "platform": platform.platform(), "torch": torch.__version__})
    data["fetch"] = {name: json.loads((require(name) / "asset.json").read_text()).get("seconds") for name in ASSETS}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        entry = data.setdefault(name, {"tasks": {}})
        start = time.perf_counter()
        model, tokenizer = load_model(name, dtype=torch.float32), load_tokenizer(name)
        entry["load_s"] = time.perf_counter() - start
        key = f"ppl_{args.ppl_window}_{args.ppl_max_windows or 'all'}"
        if key not in entry:
            start = time.perf_counter()
            result = perplexity(
                model, tokenizer, load_ppl_text("wiki"), window=args.ppl_window, max_windows=args.ppl_max_windows
            )
            seconds = time.perf_counter() - start
            del result["window_nll"]  # the record keeps the summary
            entry[key] = result | {
                "seconds": seconds,
                "tokens_per_s": result["ppl_windows"] * args.ppl_window / seconds,
            }
            save(args.json, data)
            print(
                f"{name}: ppl {result['ppl']:.2f} over {result['ppl_tokens']} tokens, "
                f"{entry[key]['tokens_per_s']:.0f} tokens/s"
            )
        lm = make_lm(model, tokenizer, args.batch_size)
        for task in args.tasks:
            done = entry["tasks"].get(task)
            if done and done["limit"] == args.limit:
                continue
            spec = EvalSpec(tasks=[task], task_data="real", limit=args.limit, ppl=None, batch_size=args.batch_size)
            tasks, seconds, _ = zero_shot(lm, spec, "real")
            entry["tasks"][task] = tasks[task] | {
                "limit": args.limit,
                "seconds": seconds,
                "items_per_s": tasks[task]["n"] / seconds,
            }
            save(args.json, data)
            t = entry["tasks"][task]
            print(f"{name} {task}: acc {t['acc']:.3f}±{t['acc_stderr']:.3f}"
                  + (f" acc_norm {t['acc_norm']:.3f}±{t['acc_norm_stderr']:.3f}" if t["acc_norm"] is not None else "")
                  + f" (n={t['n']}, {t['items_per_s']:.2f} items/s)")
        del model, lm


if __name__ == "__main__":
    main()
