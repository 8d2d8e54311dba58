"""Issue 83, must-show 3 (speed): is the free layout slow because of its widths? The same configuration (the real
demo's best: layerwise, seq_len 64, 32 samples, 20%) pruned as the free layout, as the free layout aligned to 64, 128
and 256 (`align`), as the servable one (`servable`: the attention kept, widths aligned to 256) and as the uniform
one, each timed against the unpruned model side by side in one run, in llama.cpp (f16 GGUF by taylor_tune's writer)
and in torch on this CPU.

Timing: `rounds` rounds, each timing every model once in a fresh random order (interleaved, so that the machine's
drift falls on all alike); prefill: a `prefill`-token prompt from an empty cache, tokens / s; decode: after an
8-token prompt, `decode` greedy single-token steps with the cache, tokens / s. Each round gives a ratio pruned /
unpruned per model and phase, reported as a trial's paired timing reports it (`evaluation.speed.paired_ratio`: the
geometric mean of the rounds' ratios with its 95% t interval). Resumable: the pruned models' GGUF and safetensors
files are kept under --folder and reused.

`--quality` (instead of the timing): every layout and the unpruned model evaluated on the same items (the seven real
tasks at `--limit` items each) and the same held-out wiki windows (128 tokens, `--windows`), each item's outcome and
each window's NLL written beside its folder (resumable: a layout with its outcomes is not evaluated again); each
layout's acc_mean and log perplexity are then compared with the free layout's, paired by item and by window
(`reporting.paired`: the task-stratified standard error; separated at 1.96 of it).

    .venv/bin/python bench/bench_aligned.py --model smollm2-135m --json bench/aligned_smollm2.json [--rounds 20]
    .venv/bin/python bench/bench_aligned.py --model smollm2-135m --quality --json bench/aligned_quality_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from bench_gguf_speed import speedups  # bench/ is the script's own folder on sys.path

from taylor_tune.config import build_prune_config
from taylor_tune.export.to_gguf import write_gguf
from taylor_tune.jsonio import write_json
from taylor_tune.pruning.apply import layer_shapes, save_pruned
from taylor_tune.pruning.prune import prune
from taylor_tune.sources.data import load_ppl_text
from taylor_tune.sources.models import load_model, load_tokenizer

BEST = {"method": "layerwise", "sparsity": 0.2, "seq_len": 64, "num_samples": 32, "calibration": "wiki",
        "micro_batch_size": 8, "device": "cpu", "dtype": "float32"}
LAYOUTS = {"free": {}, "aligned64": {"align": 64}, "aligned128": {"align": 128}, "aligned256": {"align": 256},
           "servable": {"servable": True},
           "uniform": {"uniform": True}}


def build(model: str, folder: Path) -> dict[str, dict]:
    """Each layout's pruned folder and f16 GGUF (kept and reused), and what it is."""
    built = {}
    unpruned = folder / "unpruned"
    if not (unpruned / "model.f16.gguf").exists():
        loaded, tokenizer = load_model(model), load_tokenizer(model)
        save_pruned(loaded, unpruned, tokenizer, source_model=model)
        write_gguf(loaded, tokenizer, unpruned / "model.f16.gguf", file_type="f16")
    built["unpruned"] = {"folder": unpruned}
    for name, extra in LAYOUTS.items():
        target, config = folder / name, {"model": model} | BEST | extra
        if (target / "bench.json").exists() and json.loads((target / "bench.json").read_text())["config"] != config:
            shutil.rmtree(target)  # made by another definition of the layout: made again, its quality with it
        if not (target / "model.f16.gguf").exists():
            start = time.perf_counter()
            result = prune(build_prune_config(config))
            save_pruned(result.model, target, result.tokenizer, source_model=model)
            write_gguf(result.model, result.tokenizer, target / "model.f16.gguf", file_type="f16")
            (target / "bench.json").write_text(json.dumps({
                "pruning_ratio": result.diagnostics["pruning_ratio"], "seconds": time.perf_counter() - start,
                "config": config}))
            print(f"{name}: pruned and written", flush=True)
        record = json.loads((target / "bench.json").read_text())
        built[name] = {"folder": target} | record
    return built


def llama_rates(path: Path, threads: int, prefill: int, decode: int):
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=prefill + decode + 16, n_batch=prefill, logits_all=True,
                n_threads=threads, n_threads_batch=threads, verbose=False)

    def prefill_rate(prompt):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        return len(prompt) / (time.perf_counter() - start)

    def decode_rate(prompt):
        llm.reset()
        llm.eval(prompt)
        start = time.perf_counter()
        for _ in range(decode):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        return decode / (time.perf_counter() - start)

    return prefill_rate, decode_rate


def torch_rates(model, decode: int):
    @torch.no_grad()
    def prefill_rate(prompt):
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        model(input_ids=ids, use_cache=False)
        return len(prompt) / (time.perf_counter() - start)

    @torch.no_grad()
    def decode_rate(prompt):
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(decode):
            step = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache, token = step.past_key_values, step.logits[:, -1:].argmax(-1)
        return decode / (time.perf_counter() - start)

    return prefill_rate, decode_rate


def timed(runners: dict, prompt: list[int], short: list[int], rounds: int, label: str) -> dict:
    for prefill_rate, decode_rate in runners.values():  # warm-up: page the weights in, settle the allocator
        prefill_rate(prompt)
        decode_rate(short)
    rates = {name: {"prefill": [], "decode": []} for name in runners}
    order, rng = list(runners), random.Random(0)
    for round_ in range(rounds):
        rng.shuffle(order)
        for name in order:
            prefill_rate, decode_rate = runners[name]
            rates[name]["prefill"].append(prefill_rate(prompt))
            rates[name]["decode"].append(decode_rate(short))
        print(f"{label}: round {round_ + 1}/{rounds}", flush=True)
    speedup = speedups(rates)  # the estimator bench_gguf_speed reports, a trial's paired timing's
    for key, found in speedup.items():
        print(f"{label} {key}: {found['ratio']:.3f}x [{found['low']:.3f}, {found['high']:.3f}]", flush=True)
    return {"speedup": speedup, "vs_uniform": against_uniform(rates, label),
            "tokens_per_s": {n: {p: float(np.median(v)) for p, v in ph.items()} for n, ph in rates.items()},
            "rates": rates}


def against_uniform(rates: dict, label: str) -> dict:
    """Must-show 3's target read directly: each layout's speed over the uniform layout's, paired by round."""
    found = speedups(rates, base="uniform")
    for key, ratio in found.items():
        print(f"{label} {key} / uniform: {ratio['ratio']:.3f}x [{ratio['low']:.3f}, {ratio['high']:.3f}]", flush=True)
    return found


def evaluated(name: str, folder: Path, model: str, limit: int, windows: int) -> dict:
    """One model's quality on the shared items and windows: its outcomes written under folder/quality (reused)."""
    from taylor_tune.config import EvalSpec
    from taylor_tune.evaluation.evaluate import Evaluator

    where, record = folder / "quality", folder / "quality" / "quality.json"
    if not record.exists():
        start = time.perf_counter()
        spec = EvalSpec(task_data="real", limit=limit, ppl="wiki", ppl_window=128, ppl_max_windows=windows)
        evaluator = Evaluator(load_model(str(folder)), load_tokenizer(model), spec, model_name=model)
        ppl, shots = evaluator.perplexity(), evaluator.zero_shot(limit)
        ppl.write_outcomes(where)
        shots.write_outcomes(where)
        write_json(record, {"ppl": ppl.ppl, "acc_mean": shots.acc_mean, "seconds": time.perf_counter() - start,
                            "tasks": {t: {k: e[k] for k in ("score", "score_stderr", "n", "metric")}
                                      for t, e in shots.tasks.items()}})
        print(f"{name}: evaluated", flush=True)
    return json.loads(record.read_text())


def quality(built: dict, model: str, limit: int, windows: int) -> dict:
    """Each model's quality and its paired differences against the free layout (see the module's docstring)."""
    from taylor_tune.paired import paired_difference, paired_log_ppl
    from taylor_tune.reporting.stats import Z95
    from taylor_tune.schema import zero_shot_stage
    from taylor_tune.storage.folder import read_outcomes, read_ppl_windows

    # the target's layouts first, so that a run cut short still answers it (--only summarizes those evaluated)
    first = ["free", "aligned64", "uniform", "servable"]
    order = first + [name for name in built if name not in first]
    rows = {name: evaluated(name, built[name]["folder"], model, limit, windows) for name in order if name in built}

    def items(name):  # each item's score in its task's reported metric (acc or acc_norm)
        outcomes = read_outcomes(str(built[name]["folder"] / "quality"), zero_shot_stage(limit))
        metric = {t: e["metric"] for t, e in rows[name]["tasks"].items()}
        return pd.Series([row[metric[task]] for (task, _), row in outcomes.iterrows()], index=outcomes.index)

    scored = {name: items(name) for name in rows}
    for name, row in rows.items():
        if not math.isclose(scored[name].groupby(level="task").mean().mean(), row["acc_mean"], abs_tol=1e-12):
            raise SystemExit(f"{name}: the stored outcomes do not reproduce its acc_mean")
        acc = paired_difference(scored[name], scored["free"])
        ppl = paired_log_ppl(read_ppl_windows(str(built[name]["folder"] / "quality")),
                             read_ppl_windows(str(built["free"]["folder"] / "quality")))
        row["vs_free"] = {"acc_mean": acc.difference, "acc_mean_se": acc.stderr, "items": acc.items,
                          "acc_separated": acc.separated(Z95), "log_ppl": ppl.difference, "log_ppl_se": ppl.stderr,
                          "windows": ppl.items, "ppl_separated": ppl.separated(Z95)}
        print(f"{name}: acc_mean {row['acc_mean']:.4f} ({acc.difference:+.4f} ± {acc.stderr:.4f} vs free), "
              f"ppl {row['ppl']:.3f} (log {ppl.difference:+.4f} ± {ppl.stderr:.4f})", flush=True)
    return rows


def main() -> None:
    from llama_cpp import __version__

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json", required=True)
    parser.add_argument("--folder", default=None)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--torch-rounds", type=int, default=10)
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quality", action="store_true", help="the quality comparison instead of the timing")
    parser.add_argument("--limit", type=int, default=300, help="items per task (--quality)")
    parser.add_argument("--windows", type=int, default=64, help="wiki windows of 128 tokens (--quality)")
    parser.add_argument("--only", nargs="+", default=None, help="these layouts (and free) alone")
    parser.add_argument("--against-uniform", action="store_true",
                        help="add each layout's speed over the uniform layout's to the timing --json, from its rates")
    args = parser.parse_args()
    if args.against_uniform:
        result = json.loads(Path(args.json).read_text())
        for runtime, label in (("llama_cpp", "llama.cpp"), ("torch_cpu", "torch")):
            result[runtime]["vs_uniform"] = against_uniform(result[runtime]["rates"], label)
        write_json(Path(args.json), result)
        return
    folder = Path(args.folder or f"bench/out/aligned_{args.model}")
    folder.mkdir(parents=True, exist_ok=True)
    built = build(args.model, folder)
    if args.only:
        built = {name: b for name, b in built.items() if name in {"free", *args.only}}
    if args.quality:
        torch.set_num_threads(args.threads)
        result = {"machine": f"{platform.machine()}, {args.threads} torch threads",
                  "date": datetime.now(UTC).isoformat(timespec="seconds"), "settings": vars(args),
                  "layouts": quality(built, args.model, args.limit, args.windows)}
        write_json(Path(args.json), result)
        return
    tokens = load_tokenizer(args.model).encode(load_ppl_text("wiki"))
    prompt, short = tokens[: args.prefill], tokens[:8]
    result = {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, llama.cpp threads "
                         f"{args.threads}", "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "llama_cpp_python": __version__, "settings": vars(args),
              "layouts": {name: {"mlp_widths": [s["intermediate_size"] for s in layer_shapes(
                  load_model(str(b["folder"])))], **{k: v for k, v in b.items() if k != "folder"}}
                  for name, b in built.items()}}
    llama = {name: llama_rates(b["folder"] / "model.f16.gguf", args.threads, args.prefill, args.decode)
             for name, b in built.items()}
    result["llama_cpp"] = timed(llama, prompt, short, args.rounds, "llama.cpp")
    write_json(Path(args.json), result)
    del llama
    torch.set_num_threads(args.threads)
    models = {name: load_model(str(b["folder"])) for name, b in built.items()}
    result["torch_cpu"] = timed({n: torch_rates(m, args.decode) for n, m in models.items()}, prompt, short,
                                args.torch_rounds, "torch")
    write_json(Path(args.json), result)


if __name__ == "__main__":
    main()
