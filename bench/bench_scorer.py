"""The prefix-sharing scorer against lm-eval's HFLM: token positions forwarded, wall time, and agreement.

One process, one model, the seven real tasks at --limit items each in one lm-eval call per pass. The scorers
alternate (hflm, prefix, prefix, hflm, ...) so that slow phases of this noisy machine fall on both. Every pass
records its seconds and the token positions its scorer forwarded, padding included (`tokens_forwarded`);
the prefix scorer also without padding (`tokens_unpadded`). Agreement: every request's log-likelihood against the
first hflm pass (max absolute and
relative difference), is_greedy mismatches, and acc/acc_norm per task. A pass already in --json is skipped, so a
killed run continues.

    python bench/bench_scorer.py --model smollm2-135m --limit 100 --rounds 2 --json bench/scorer.json

`--baseline full_logits` compares the prefix scorer with itself computing the output layer on every position (as
it did before it passed transformers' `logits_to_keep`), then keeping the rows it needs: the cost of the full logits.

    python bench/bench_scorer.py --model qwen2.5-0.5b --baseline full_logits --limit 20 --json bench/scorer_logits.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from lm_eval import simple_evaluate

from taylor_tune.config import ZERO_SHOT_TASKS
from taylor_tune.evaluation.scorer import make_lm
from taylor_tune.evaluation.zero_shot import task_source
from taylor_tune.jsonio import write_json
from taylor_tune.sources.models import load_model, load_tokenizer


@contextmanager
def full_logits(model):
    """The model computes logits on every position and only then keeps the rows `logits_to_keep` names."""
    forward = model.forward

    def every_position(*args, logits_to_keep=0, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits[logits_to_keep] if isinstance(logits_to_keep, torch.Tensor) else out.logits
        return out

    model.forward = every_position
    try:
        yield
    finally:
        del model.forward  # the class's forward again


def one_pass(model, tokenizer, scorer: str, limit: int, batch_size: int) -> tuple[dict, dict]:
    if scorer == "prefix_full_logits":
        with full_logits(model):
            summary, responses = one_pass(model, tokenizer, "prefix", limit, batch_size)
        return summary | {"scorer": scorer}, responses
    lm = make_lm(model, tokenizer, batch_size, scorer)
    sources = [task_source(task, "real") for task in ZERO_SHOT_TASKS]
    start = time.perf_counter()
    result = simple_evaluate(model=lm, tasks=[s for s, _ in sources], task_manager=sources[0][1], limit=limit,
                             bootstrap_iters=0, log_samples=True, verbosity="ERROR")
    seconds = time.perf_counter() - start
    responses = {
        task: [[r[0] for r in sample["resps"]] for sample in samples] for task, samples in result["samples"].items()
    }
    scores = {task: {m: raw.get(f"{m},none") for m in ("acc", "acc_norm")} for task, raw in result["results"].items()}
    summary = {"scorer": scorer, "seconds": seconds, "tokens_forwarded": lm.tokens_forwarded,
               "tokens_unpadded": getattr(lm, "tokens_unpadded", None), "scores": scores,
               "requests": sum(len(r) for rs in responses.values() for r in rs),
               "items": sum(len(rs) for rs in responses.values())}
    return summary, responses


def agreement(reference: dict, other: dict) -> dict:
    abs_diff = rel_diff = 0.0
    greedy_mismatches = 0
    for task, items in reference.items():
        for ref_item, item in zip(items, other[task], strict=True):
            for (ref_ll, ref_greedy), (ll, greedy) in zip(ref_item, item, strict=True):
                abs_diff = max(abs_diff, abs(ll - ref_ll))
                rel_diff = max(rel_diff, abs(ll - ref_ll) / max(abs(ref_ll), 1e-12))
                greedy_mismatches += ref_greedy != greedy
    return {"max_abs_diff": abs_diff, "max_rel_diff": rel_diff, "greedy_mismatches": greedy_mismatches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2, help="each round runs both scorers, alternating the order")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--baseline", choices=["hflm", "full_logits"], default="hflm",
                        help="what the prefix scorer is compared with: lm-eval's HFLM, or itself on full logits")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()

    data = json.loads(args.json.read_text()) if args.json.is_file() else {}
    data.setdefault("machine", {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                                "platform": platform.platform(), "torch": torch.__version__})
    baseline = "hflm" if args.baseline == "hflm" else "prefix_full_logits"
    data.update(model=args.model, limit=args.limit, batch_size=args.batch_size, baseline=baseline)
    passes = data.setdefault("passes", [])
    model, tokenizer = load_model(args.model, dtype=torch.float32), load_tokenizer(args.model)
    model.eval()
    reference = None
    order = [s for r in range(args.rounds) for s in ((baseline, "prefix") if r % 2 == 0 else ("prefix", baseline))]
    for index, scorer in enumerate(order):
        if index < len(passes) and index > 0:
            continue  # done in an earlier run (the first pass is rerun: it is the reference for agreement)
        summary, responses = one_pass(model, tokenizer, scorer, args.limit, args.batch_size)
        if index == 0:
            reference = responses
        else:
            summary |= agreement(reference, responses)
            summary["scores_equal"] = summary["scores"] == passes[0]["scores"]
        summary["date"] = time.strftime("%Y-%m-%d %H:%M")
        passes[index:index + 1] = [summary]
        write_json(args.json, data)
        print(json.dumps({k: v for k, v in summary.items() if k != "scores"}), flush=True)
    by = {s: [p for p in passes if p["scorer"] == s] for s in (baseline, "prefix")}
    mean = {s: {k: sum(p[k] for p in ps) / len(ps) for k in ("seconds", "tokens_forwarded")} for s, ps in by.items()}
    data["ratio"] = {k: mean["prefix"][k] / mean[baseline][k] for k in ("seconds", "tokens_forwarded")}
    write_json(args.json, data)
    print(json.dumps(data["ratio"]))


if __name__ == "__main__":
    main()
