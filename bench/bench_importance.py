"""Importance-stage benchmarks on a >= 100M-parameter Llama built from a config (random weights).

Measures, in one run so that the ratios are side by side:
  1. importance pass vs a plain forward+backward over the same tokens and micro-batches (target <= 1.2);
  2. one nested pass giving 128/256/512 vs three separate passes (target >= 1.6x less wall time);
  3. peak memory of the importance stage vs the model's fp32 weight bytes (target <= 2.5x), measured in a
     fresh child process as peak RSS minus the RSS before the model was built; plus the projected peak
     for an 8B model in bf16 on one 80 GB GPU from the same accounting.

CPU (what the project's machines have; ~10 min on 2 cores):
    .venv/bin/python bench/bench_importance.py --seq-len 16
GPU (a >= 1B model; also prints tokens/s and model FLOP utilisation):
    python bench/bench_importance.py --device cuda --dtype bfloat16 --hidden 2048 --intermediate 5632 \
        --layers 22 --heads 32 --kv-heads 4 --vocab 32000 --seq-len 128 --micro-batch 16
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from taylor_tune.pruning.groups import describe_layout, prunable_parameters  # noqa: E402
from taylor_tune.pruning.importance import compute_importance  # noqa: E402

SNAPSHOTS = [128, 256, 512]


def build(args) -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(2048, args.seq_len), tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).to(args.device).eval()


def tokens(args, n: int) -> torch.Tensor:
    return torch.randint(0, args.vocab, (n, args.seq_len), generator=torch.Generator().manual_seed(1))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def plain_forward_backward(model, ids, micro_batch: int) -> None:
    """What a training step costs without an optimizer: every parameter gets its .grad."""
    for p in model.parameters():
        p.requires_grad_(True)
    for start in range(0, ids.shape[0], micro_batch):
        batch = ids[start : start + micro_batch].to(next(model.parameters()).device)
        model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)


def timed(fn, device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def proc_status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise KeyError(field)


def memory_child(args) -> dict:
    """Runs in a fresh process: peak memory of the importance stage relative to the fp32 weight bytes.

    Stage peak = the model's weight bytes + the most the stage added on top of what was resident when it
    began (CPU: VmHWM after resetting it through /proc/self/clear_refs; CUDA: max_memory_allocated after
    reset_peak_memory_stats, which already counts the weights).
    """
    model = build(args)
    layout = describe_layout(model)
    ids = tokens(args, args.memory_samples)
    weights = sum(p.numel() for p in model.parameters())
    weight_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    start = proc_status_mb("VmRSS")
    compute_importance(model, layout, ids, micro_batch_size=args.memory_micro_batch)
    if args.device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = weight_mb + proc_status_mb("VmHWM") - start
    prunable = sum(p.numel() for params in prunable_parameters(model) for _, p in params)
    return {"stage_peak_mb": peak, "weight_mb": weight_mb, "fp32_weight_mb": weights * 4 / 2**20, "params": weights,
            "prunable_params": prunable, "expected_weights_plus_fp32_accumulators_mb": weight_mb + prunable * 4 / 2**20,
            "micro_batch": args.memory_micro_batch, "samples": args.memory_samples}


def project_8b_bf16(micro_batch: int = 4, seq_len: int = 256) -> dict:
    """LLaMA-3-8B in bf16: weights (2 B) + fp32 accumulators of the prunable weights (4 B) + one bf16 grad
    and two fp32 temporaries of the largest matrix + saved activations of one micro-batch (bf16, ~34
    hidden-sized and 3 intermediate-sized tensors per layer, as autograd keeps them) + fp32 logits and their grad."""
    hidden, inter, layers, vocab, kv = 4096, 14336, 32, 128256, 1024
    params = 8_030_261_248
    prunable = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter)
    largest = hidden * inter
    tok = micro_batch * seq_len
    parts = {
        "weights_bf16": 2 * params,
        "fp32_accumulators": 4 * prunable,
        "transient_grad_and_temporaries": 2 * largest + 2 * 4 * largest,
        "activations": layers * tok * (34 * hidden + 3 * inter) * 2,
        "logits_fp32_and_grad": 2 * tok * vocab * 4,
    }
    total = sum(parts.values())
    return {"micro_batch": micro_batch, "seq_len": seq_len, **{k: round(v / 2**30, 2) for k, v in parts.items()},
            "total_gib": round(total / 2**30, 2), "fits_80gb": total < 80e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--memory-micro-batch", type=int, default=2)
    parser.add_argument("--memory-samples", type=int, default=8)
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.memory_child:
        print(json.dumps(memory_child(args)))
        return

    torch.manual_seed(0)
    model = build(args)
    layout = describe_layout(model)
    ids = tokens(args, SNAPSHOTS[-1])
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {params / 1e6:.1f}M parameters, {args.layers} layers, hidden {args.hidden}; "
        f"{ids.numel()} tokens per 512-sample pass; {args.device} {args.dtype}, {torch.get_num_threads()} threads",
        flush=True,
    )
    plain_forward_backward(model, ids[: args.micro_batch], args.micro_batch)  # warm-up
    times = {}
    times["plain_fwd_bwd_512"] = timed(lambda: plain_forward_backward(model, ids, args.micro_batch), args.device)
    times["importance_nested_128_256_512"] = timed(
        lambda: compute_importance(model, layout, ids, micro_batch_size=args.micro_batch, snapshots=SNAPSHOTS),
        args.device,
    )
    times["importance_separate_128_256_512"] = sum(
        timed(lambda n=n: compute_importance(model, layout, ids[:n], micro_batch_size=args.micro_batch), args.device)
        for n in SNAPSHOTS)
    times["importance_512"] = timed(
        lambda: compute_importance(model, layout, ids, micro_batch_size=args.micro_batch), args.device
    )
    for k, v in times.items():
        print(f"  {k}: {v:.2f} s", flush=True)

    child = subprocess.run(
        [sys.executable, __file__, "--memory-child", *sys.argv[1:]], capture_output=True, text=True, check=True
    )
    memory = json.loads(child.stdout.strip().splitlines()[-1])
    flops = 6 * params * ids.numel()  # forward + backward, dense, attention ignored (short sequences)
    results = {
        "machine": {
            "platform": platform.platform(),
            "cpu": _cpu_name(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        },
        "model": {
            "params": params,
            **{
                k: getattr(args, k)
                for k in (
                    "hidden",
                    "intermediate",
                    "layers",
                    "heads",
                    "kv_heads",
                    "vocab",
                    "seq_len",
                    "micro_batch",
                    "dtype",
                )
            },
        },
        "times_s": times,
        "ratio_importance_vs_plain": times["importance_512"] / times["plain_fwd_bwd_512"],
        "speedup_nested_vs_separate": times["importance_separate_128_256_512"] / times["importance_nested_128_256_512"],
        "tokens_per_s_importance": ids.numel() / times["importance_512"],
        "model_tflops_per_s": flops / times["importance_512"] / 1e12,
        "memory": memory,
        "peak_over_fp32_weights": memory["stage_peak_mb"] / memory["fp32_weight_mb"],
        "projection_llama3_8b_bf16": project_8b_bf16(),
    }
    print(json.dumps({k: v for k, v in results.items() if k != "machine"}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
