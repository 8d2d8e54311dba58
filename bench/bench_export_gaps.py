"""The gaps docs/export.md quotes beside the GGUF fidelity bench (bench_gguf_fidelity.py): each next token's
log-probability in llama.cpp against the model's in torch, mean and max over the tokens, in nats.

- Gemma 2 (a random tiny one with a real tokenizer, as tests/export/test_gguf.py builds it), uniform and depth
  layouts written as llama.cpp's `gemma2` in f32: against torch's model, and against the same model with
  llama.cpp's CPU GELU written out in torch (its f32 input rounded to f16, read from an f16 table).
- DeciLM: the tiny servable Llama 3 vocabulary model of tests/export/test_decilm.py, aligned (MLP widths 512, 256,
  768) and depth (a layer removed), exported as DeciLM and converted by llama.cpp's own `convert_hf_to_gguf.py`
  from the pinned llama-cpp-python source distribution (fetched into the asset cache once).

    .venv/bin/python bench/bench_export_gaps.py --json bench/export_gaps.json

Deterministic: the models are built from fixed seeds, llama.cpp runs on one thread.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def gaps(theirs, ours) -> dict:
    gap = np.abs(np.asarray(theirs) - np.asarray(ours))
    return {"mean": float(gap.mean()), "max": float(gap.max()), "tokens": int(gap.size)}


def gemma2(layout: str, scratch: Path) -> dict:
    from taylor_tune.export.to_gguf import gguf_logprobs, torch_logprobs
    from taylor_tune.pruning.plan import PrunePlan
    from tests.export.test_gguf import F16TableGelu, by_layout, gemma2_with_a_real_tokenizer, written

    model, tokenizer = gemma2_with_a_real_tokenizer()
    path = scratch / f"gemma2-{layout}.gguf"
    model, tokens = written(model, tokenizer, path,
                            by_layout(layout, PrunePlan("hand", ((1, 2),) * 4, ((0, 5),) * 4), (1, 2)), "gemma2")
    theirs = gguf_logprobs(path, tokens)
    stock = gaps(theirs, torch_logprobs(model, tokens))
    model.model.layers.apply(lambda m: setattr(m, "act_fn", F16TableGelu()) if hasattr(m, "act_fn") else None)
    return {"torch": stock, "f16_table_gelu": gaps(theirs, torch_logprobs(model, tokens))}


def decilm(layout: str, scratch: Path) -> dict:
    from taylor_tune.export.to_decilm import write_decilm
    from taylor_tune.export.to_gguf import gguf_logprobs, torch_logprobs
    from taylor_tune.pruning.apply import apply_plan
    from taylor_tune.pruning.plan import PrunePlan
    from tests.export.test_decilm import convert, converter, llama3_tokenizer, servable

    vendor = converter()
    tokenizer = llama3_tokenizer(vendor, scratch / f"tokenizer-{layout}")
    plan = (PrunePlan("hand", ((),) * 3, (tuple(range(0, 512, 2)), tuple(range(512)), ()))
            if layout == "aligned" else PrunePlan("hand", ((),) * 3, ((),) * 3, layers_removed=(1,)))
    model = apply_plan(servable(), plan)
    folder = write_decilm(model, tokenizer, scratch / f"decilm-{layout}")
    run = convert(vendor, folder, scratch / f"decilm-{layout}.gguf")
    if run.returncode != 0:
        raise SystemExit(run.stderr[-3000:])
    tokens = tokenizer.encode("The river rises in the hills north of the town and flows south through farmland "
                              "for about forty miles before it reaches the sea.")
    return gaps(gguf_logprobs(scratch / f"decilm-{layout}.gguf", tokens), torch_logprobs(model, tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = {"gemma2": {}, "decilm": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for layout in ("uniform", "depth"):
            results["gemma2"][layout] = gemma2(layout, Path(scratch))
        for layout in ("aligned", "depth"):
            results["decilm"][layout] = decilm(layout, Path(scratch))
    for layout, row in results["gemma2"].items():
        print(f"gemma2 {layout}: torch {row['torch']['mean']:.1e} / {row['torch']['max']:.1e}, "
              f"f16-table GELU {row['f16_table_gelu']['mean']:.1e} / {row['f16_table_gelu']['max']:.1e} "
              f"({row['torch']['tokens']} tokens)")
    for layout, row in results["decilm"].items():
        print(f"decilm {layout}: {row['mean']:.1e} / {row['max']:.1e} ({row['tokens']} tokens)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
