"""Issue 65, must-show 5: the exported SmolLM2-135M best (the real demo's best configuration: layerwise, seq_len 64,
32 samples, 20%) in llama.cpp on this CPU, free layout (`deci`) and the same configuration with `uniform: true`
(`llama`), against the unpruned model, all written as f16 GGUF by taylor_tune's writer (the unpruned one too, so that
the file format is not what differs), and the unpruned model written as `deci` (whether a free layout's speed comes
from the `deci` graph or from its widths). The speed a laptop user would see.

Timing: llama-cpp-python, one `Llama` per file, all loaded before timing; `rounds` rounds, each timing every model
once in a fresh random order (interleaved, so that the machine's state drifts over all three alike):
- prefill: `eval` of a `prefill`-token prompt from a reset context, tokens / s;
- decode: after an 8-token prompt, `decode` single-token `eval` calls (the model's own greedy tokens), tokens / s.
Each round gives a ratio pruned / unpruned per model and phase; reported as a trial's paired timing reports it (the
geometric mean of the rounds' ratios with its 95% t interval, `evaluation.speed.paired_ratio`), and each model's
median tokens/s.

    .venv/bin/python bench/bench_gguf_speed.py --json bench/gguf_speed.json [--rounds 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from taylor_tune.config import build_prune_config
from taylor_tune.evaluation.speed import paired_ratio
from taylor_tune.export import to_gguf
from taylor_tune.export.to_gguf import write_gguf
from taylor_tune.jsonio import write_json
from taylor_tune.pruning.prune import prune
from taylor_tune.sources.data import load_ppl_text
from taylor_tune.sources.models import load_model, load_tokenizer

BEST = {"model": "smollm2-135m", "method": "layerwise", "sparsity": 0.2, "seq_len": 64, "num_samples": 32,
        "calibration": "wiki", "micro_batch_size": 8, "device": "cpu", "dtype": "float32"}


def build(folder: Path) -> dict[str, Path]:
    files = {"unpruned": folder / "unpruned.f16.gguf", "unpruned_deci": folder / "unpruned_deci.f16.gguf",
             "free": folder / "free.f16.gguf", "uniform": folder / "uniform.f16.gguf"}
    if not files["unpruned"].exists() or not files["unpruned_deci"].exists():
        model, tokenizer = load_model("smollm2-135m", dtype=torch.float32), load_tokenizer("smollm2-135m")
        write_gguf(model, tokenizer, files["unpruned"], file_type="f16")
        # The unpruned model under the free layout's architecture: whether a free layout's speed comes from the
        # `deci` graph or from its widths.
        chosen = to_gguf.architecture
        to_gguf.architecture = lambda model_type, uniform, biased: "deci"
        try:
            write_gguf(model, tokenizer, files["unpruned_deci"], file_type="f16")
        finally:
            to_gguf.architecture = chosen
    for layout, extra in (("free", {}), ("uniform", {"uniform": True})):
        if not files[layout].exists():
            result = prune(build_prune_config(BEST | extra))
            written = write_gguf(result.model, result.tokenizer, files[layout], file_type="f16")
            print(layout, written["architecture"], f"{sum(p.numel() for p in result.model.parameters()):,} params")
    return files


def prefill_rate(llm, prompt: list[int]) -> float:
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    return len(prompt) / (time.perf_counter() - start)


def decode_rate(llm, prompt: list[int], steps: int) -> float:
    llm.reset()
    llm.eval(prompt)
    start = time.perf_counter()
    for _ in range(steps):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([token])
    return steps / (time.perf_counter() - start)


def speedups(rates: dict[str, dict[str, list[float]]], base: str = "unpruned") -> dict[str, dict[str, float]]:
    """Each model's speedup per phase against `base` (the unpruned one), paired by round, with the estimator a trial's
    paired timing reports (`evaluation.speed.paired_ratio`: the geometric mean of the rounds' ratios, a t interval)."""
    out = {}
    for name in [n for n in rates if n not in ("unpruned", base)]:
        for phase in ("prefill", "decode"):
            ratio, _, low, high = paired_ratio([1 / r for r in rates[base][phase]],
                                               [1 / r for r in rates[name][phase]])
            out[f"{name}_{phase}"] = {"ratio": ratio, "low": low, "high": high}
    return out


def main() -> None:
    from llama_cpp import Llama, __version__

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--folder", default="bench/out/gguf_speed")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = build(folder)
    tokens = load_tokenizer("smollm2-135m").encode(load_ppl_text("wiki"))
    prompt, short = tokens[: args.prefill], tokens[: 8]
    models = {name: Llama(model_path=str(path), n_ctx=args.prefill + args.decode + 16, n_batch=args.prefill,
                          logits_all=True, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
              for name, path in files.items()}
    for llm in models.values():  # warm-up: page the weights in, let the allocator settle
        prefill_rate(llm, prompt)
        decode_rate(llm, short, 8)
    rates = {name: {"prefill": [], "decode": []} for name in models}
    order = list(models)
    rng = random.Random(0)
    for round_ in range(args.rounds):
        rng.shuffle(order)
        for name in order:
            rates[name]["prefill"].append(prefill_rate(models[name], prompt))
            rates[name]["decode"].append(decode_rate(models[name], short, args.decode))
        print(f"round {round_ + 1}/{args.rounds}", flush=True)
    result = {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads available, "
                         f"llama.cpp threads {args.threads}",
              "date": datetime.now(UTC).isoformat(timespec="seconds"), "llama_cpp_python": __version__,
              "configuration": BEST, "settings": vars(args),
              "files_mb": {name: round(path.stat().st_size / 2**20, 1) for name, path in files.items()},
              "tokens_per_s": {name: {phase: float(np.median(values)) for phase, values in phases.items()}
                               for name, phases in rates.items()},
              "speedup": speedups(rates), "rates": rates}
    for key, found in result["speedup"].items():
        print(f"{key}: {found['ratio']:.3f}x [{found['low']:.3f}, {found['high']:.3f}]")
    write_json(Path(args.json), result)


if __name__ == "__main__":
    main()
