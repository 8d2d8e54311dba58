"""Issue 65, must-show 2's numbers: how close llama.cpp reads an exported GGUF. SmolLM2-135M (or --model) pruned
20% (taylor, seq_len 16, 4 samples, wiki) in three layouts, each written as f32 and f16 (or --types); every next
token's log-probability on the first 256 tokens of the real held-out text, llama.cpp (KV cache in f32, 1 thread)
against the pruned model in torch float32: the mean and the largest gap, in nats.

    .venv/bin/python bench/bench_gguf_fidelity.py --json bench/gguf_fidelity.json
    .venv/bin/python bench/bench_gguf_fidelity.py --model qwen2.5-0.5b --types f16 --json bench/gguf_fidelity_qwen.json
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from taylor_tune.config import build_prune_config
from taylor_tune.export.to_gguf import gguf_logprobs, torch_logprobs, write_gguf
from taylor_tune.jsonio import write_json
from taylor_tune.pruning.prune import prune
from taylor_tune.sources.data import load_ppl_text

LAYOUTS = {"uniform": {"method": "taylor", "uniform": True}, "depth": {"method": "depth", "depth_criterion": "angular"},
           "free": {"method": "taylor"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--types", default="f32,f16", help="GGUF file types, comma-separated")
    args = parser.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for layout, extra in LAYOUTS.items():
            result = prune(build_prune_config({"model": args.model, "sparsity": 0.2, "seq_len": 16,
                                               "num_samples": 4, "calibration": "wiki", "micro_batch_size": 4,
                                               "device": "cpu", "dtype": "float32"} | extra))
            tokens = result.tokenizer.encode(load_ppl_text("wiki"))[:256]
            ours = torch_logprobs(result.model, tokens)
            for file_type in args.types.split(","):
                path = Path(folder) / f"{layout}.{file_type}.gguf"
                written = write_gguf(result.model, result.tokenizer, path, file_type=file_type)
                gap = np.abs(gguf_logprobs(path, tokens) - ours)
                out[f"{layout} {file_type}"] = {"architecture": written["architecture"], "mean": float(gap.mean()),
                                                "max": float(gap.max()), "pre_tokenizer": written["pre_tokenizer"]}
                print(layout, file_type, out[f"{layout} {file_type}"], flush=True)
    write_json(Path(args.json), out)


if __name__ == "__main__":
    main()
