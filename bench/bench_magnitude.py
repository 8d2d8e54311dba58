"""Where the magnitude baseline's damage sits: its plan (SmolLM2-135M at 20% by default) applied in parts.

The magnitude method removes the groups with the smallest mean squared weight, globally. On SmolLM2-135M at 20% that
plan reaches wiki perplexity ~148,000 where a random plan of the same size reaches ~2,700 (BENCHMARKS.md). This
script applies pieces of that one plan to fresh copies of the model and measures wiki perplexity on the first
--windows windows of 128 tokens: the whole plan, its attention part, its MLP part, each layer's part alone, and the
whole plan without each of the --worst layers whose part alone hurts most, and without them together (and the
random plan without the same layers). Then a data-aware yardstick the weight norm cannot see: each MLP channel's
output energy on wiki text, mean over tokens of (its input to down_proj)^2 x ||its down_proj column||^2, and the
share of every layer's MLP output energy that each plan's removed channels carry. Rerunning skips measured runs.

    .venv/bin/python bench/bench_magnitude.py --json bench/magnitude.json          # ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

from taylor_tune.config import build_prune_config
from taylor_tune.evaluation.perplexity import perplexity
from taylor_tune.jsonio import write_json
from taylor_tune.pruning.apply import apply_plan
from taylor_tune.pruning.groups import describe_layout
from taylor_tune.pruning.importance import magnitude_scores
from taylor_tune.pruning.methods import METHODS, PlanOptions
from taylor_tune.pruning.plan import PrunePlan
from taylor_tune.sources.data import load_ppl_text
from taylor_tune.sources.models import load_model, load_tokenizer


def part(plan: PrunePlan, layers: set[int], attention: bool = True, mlp: bool = True) -> PrunePlan:
    """The plan's removals in `layers` only (and only the kinds asked for)."""
    return PrunePlan(
        plan.method,
        tuple(r if attention and l in layers else () for l, r in enumerate(plan.attn_removed)),
        tuple(r if mlp and l in layers else () for l, r in enumerate(plan.mlp_removed)),
    )


def mlp_energy(model, tokenizer, text: str, windows: int) -> list[torch.Tensor]:
    """Per layer, per MLP channel: mean over tokens of x_c^2 * ||W_down[:, c]||^2, x the input of down_proj."""
    layers = model.model.layers
    sums = [torch.zeros(layer.mlp.down_proj.in_features, dtype=torch.float64) for layer in layers]
    count = [0]

    def hook(index):
        def record(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[index] += (x**2).sum(0)
            if index == 0:
                count[0] += x.shape[0]
        return record

    handles = [layer.mlp.down_proj.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][: windows * 128]).view(windows, 128)
        with torch.no_grad():
            for start in range(0, windows, 8):
                model(input_ids=ids[start:start + 8], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [s / count[0] * (layer.mlp.down_proj.weight.detach().double() ** 2).sum(0) for s, layer in zip(sums, layers)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sparsity", type=float, default=0.2)
    parser.add_argument("--windows", type=int, default=32, help="perplexity windows of 128 tokens")
    parser.add_argument("--worst", type=int, default=3, help="layers to leave out of the whole plan, one at a time")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()

    base, tokenizer = load_model(args.model, dtype=torch.float32), load_tokenizer(args.model)
    base.eval()
    layout = describe_layout(base)
    text = load_ppl_text("wiki")
    plans = {}
    for method in ("magnitude", "random"):
        config = build_prune_config(
            dict(model=args.model, method=method, sparsity=args.sparsity, seed=0, device="cpu", dtype="float32")
        )
        scores = magnitude_scores(base, layout, p=2) if method == "magnitude" else None
        plans[method] = METHODS[method].plan(scores, layout, PlanOptions.of(config))

    import json

    out = json.loads(args.json.read_text()) if args.json.is_file() else {}
    out |= {"model": args.model, "sparsity": args.sparsity, "windows": args.windows}
    out.setdefault("runs", {})

    def measure(name: str, plan: PrunePlan) -> float:
        if name in out["runs"]:
            return out["runs"][name]["ppl"]
        start = time.perf_counter()
        model = apply_plan(copy.deepcopy(base), plan) if plan is not None else base
        with torch.no_grad():
            ppl = perplexity(model, tokenizer, text, window=128, max_windows=args.windows)["ppl"]
        removed = 0 if plan is None else plan.params_removed(layout)
        out["runs"][name] = {"ppl": ppl, "params_removed": removed, "share_of_model": removed / layout.total_params}
        write_json(args.json, out)
        print(
            f"{name}: ppl {ppl:.2f} ({removed / layout.total_params:.4f} of the model removed, "
            f"{time.perf_counter() - start:.0f} s)",
            flush=True,
        )
        return ppl

    every = set(range(layout.num_layers))
    measure("unpruned", None)
    measure("random", plans["random"])
    magnitude = plans["magnitude"]
    measure("magnitude", magnitude)
    measure("magnitude attention only", part(magnitude, every, mlp=False))
    measure("magnitude mlp only", part(magnitude, every, attention=False))
    alone = {l: measure(f"magnitude layer {l} only", part(magnitude, {l})) for l in range(layout.num_layers)
             if magnitude.attn_removed[l] or magnitude.mlp_removed[l]}
    worst = sorted(alone, key=alone.get, reverse=True)[: args.worst]
    for l in worst:
        measure(f"magnitude without layer {l}", part(magnitude, every - {l}))
    measure(f"magnitude without layers {sorted(worst)}", part(magnitude, every - set(worst)))
    measure(f"random without layers {sorted(worst)}", part(plans["random"], every - set(worst)))

    energy = mlp_energy(base, tokenizer, text, args.windows)
    out["mlp_energy_removed"] = {}
    for method, plan in plans.items():
        per_layer = [float(e[list(r)].sum() / e.sum()) for e, r in zip(energy, plan.mlp_removed)]
        channels = [len(r) / len(e) for e, r in zip(energy, plan.mlp_removed)]
        out["mlp_energy_removed"][method] = {
            "per_layer": per_layer,
            "channels_removed_per_layer": channels,
            "total": float(
                sum(e[list(r)].sum() for e, r in zip(energy, plan.mlp_removed)) / sum(e.sum() for e in energy)
            ),
        }
        print(
            f"{method}: MLP output energy removed {out['mlp_energy_removed'][method]['total']:.4f} of the model's; "
            f"per layer "
            + ", ".join(f"{l}: {v:.3f} ({c:.2f} of channels)" for l, (v, c) in enumerate(zip(per_layer, channels))),
            flush=True,
        )
    out["plan"] = {"attn_removed_per_layer": [len(r) for r in magnitude.attn_removed],
                   "mlp_removed_per_layer": [len(r) for r in magnitude.mlp_removed]}
    write_json(args.json, out)


if __name__ == "__main__":
    main()
