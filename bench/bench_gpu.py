"""A trial and the seven-task evaluation at the seed models' published shapes, on the GPU they are for.

Each shape (LLaMA-3-8B, Qwen2-7B, Mistral-7B-v0.3: their published configs, random weights, bfloat16, no download)
is built from its config on the device and saved as a model folder (safetensors) with a tokenizer of its family
that the offline world has (Qwen2.5's for Qwen2, whose tokenizer it is; SmolLM2's for the other two, whose own are
gated: its token counts are close to, not equal to, theirs; Mistral's folder gets that tokenizer's 49,152 embeddings
instead of its 32,768, so that every id has one). Then, per shape:

- the evaluation alone on the unpruned model with both scorers (prefix, then lm-eval's HFLM) in the same run:
  seconds, of which building and tokenizing the requests, token positions forwarded, tokens/s and the achieved
  TFLOP/s (2 x parameters x tokens / seconds). The prefix pass stores its requests in a sweep's request cache, as a
  model's first trial does. `--passes` picks the passes; `prefix_flex` is the prefix scorer with FlexAttention's
  block mask instead of SDPA's additive mask (issue 30, point 5: the two side by side);
- with `--families SPARSITY`, what each family of cut buys at that sparsity (issue 40, point 5): prefill and decode
  speed at batch 1 and 16 with their standard errors, against the unpruned model measured first and last, of the
  shape each family leaves: depth (whole layers), width with the free layout (a global ranking) and with the uniform
  one, and mixed cuts at depth shares 0.25 and 0.5 (uniform width on the layers that stay). The weights are random,
  so the groups are ranked by the random method's seeded scores and the layers by `last`: on a homogeneous decoder
  every depth criterion removes the same number of equal layers, and the speed of a shape does not depend on which
  groups it kept;
- `prefix_fused`: the prefix scorer with its decoder layers compiled (`evaluation.fused`); passes may repeat (the
  first prefix pass builds the requests, the later ones read them, as a sweep's later trials do), and `--last` names
  passes to run after everything else;
- with `--profile LIMIT`, where the prefix scorer's time goes at LIMIT items per task (torch.profiler; each pass of
  `--profile-passes`): the time the device had a kernel running against the wall time, kernel time by kind (matmul,
  attention, other), the host's seconds in batch preparation and in enqueueing the forwards;
- `run_trial` as a sweep runs it, with that cache (its requests read back, as in every later trial of the model):
  taylor importance at each --importance SAMPLESxSEQ_LEN, prune, speed against the unpruned model, perplexity on the
  held-out Wikipedia text, the full zero-shot evaluation of the seven real tasks with the default settings; seconds
  per stage, the trial's wall time and its peak GPU memory.

`--peaks SAMPLESxSEQ_LEN` measures, before the shapes and for all three (at their published vocabularies), the peak
GPU memory of a trial's largest stage, taylor importance at that size, with the model built in memory.

Written as JSON (`--json`); `--table` prints its Markdown tables. The folder of each shape is deleted after it.

    python bench/bench_gpu.py --json bench/gpu.json                  # one H100 or H200: the three 8B shapes
    python bench/bench_gpu.py --small --json /tmp/gpu_small.json     # a tiny shape on CPU (the tests run this)
    python bench/bench_gpu.py --table bench/gpu.json
    python bench/bench_gpu.py --shapes llama-3-8b --passes prefix,prefix_flex --importance none --json /tmp/attn.json
    python bench/bench_gpu.py --shapes llama-3-8b --passes prefix,hflm --families 0.2 --importance 128x512 \
        --json bench/gpu_llama.json    # passes other than prefix run last: a time limit cuts them and nothing else
    python bench/bench_gpu.py --shapes llama-3-8b --passes prefix,hflm,prefix_flex --limit 1000 --importance none \
        --profile 300 --peaks 256x512 --json bench/gpu_profile.json   # where the time goes; the three shapes' peaks

A machine without the offline world's model assets (a bare GPU machine) gets the tokenizers as a small archive:
`--pack-tokenizers .device/tokenizers.tgz` here, then there `--tokenizers DIR` with the archive unpacked in DIR.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config

from taylor_tune import schema
from taylor_tune.config import EvalSpec, Evaluation, PruneConfig, RecoverySpec, SpeedSpec
from taylor_tune.evaluation.evaluate import Evaluator
from taylor_tune.evaluation.requests import RequestCache
from taylor_tune.evaluation.speed import measure_speed, speed_ratios
from taylor_tune.jsonio import write_json
from taylor_tune.pruning.apply import apply_plan
from taylor_tune.pruning.groups import describe_layout
from taylor_tune.pruning.importance import compute_importance
from taylor_tune.pruning.prune import make_plan
from taylor_tune.recovery.train import recover
from taylor_tune.sources.assets import require
from taylor_tune.sources.calibration import load_calibration
from taylor_tune.sources.models import load_tokenizer
from taylor_tune.sweep.trial import TrialConfig, run_trial

# The published configs (config.json on the hub), as the classes' keyword arguments.
SHAPES = {
    "llama-3-8b": (LlamaConfig, dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                                     rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
                   "smollm2-135m"),
    "qwen2-7b": (Qwen2Config, dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                   num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                                   rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
                 "qwen2.5-0.5b"),
    "mistral-7b": (MistralConfig, dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5,
                                       sliding_window=None, tie_word_embeddings=False),
                   "smollm2-135m"),
}
# SmolLM2's tokenizer needs 49,152 embeddings: wide MLPs and tied embeddings leave 20% of the parameters to prune
SMALL = {"tiny-llama-shape": (LlamaConfig, dict(vocab_size=49152, hidden_size=128, intermediate_size=2048,
                                                num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=2048, tie_word_embeddings=True),
                              "smollm2-135m")}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def pack_tokenizers(out: Path) -> None:
    """The tokenizer files of every shape's family, from the asset cache, as a .tgz of <asset>/<file>."""
    with tarfile.open(out, "w:gz") as archive:
        for name in sorted({tokenizer_of for _, _, tokenizer_of in SHAPES.values()}):
            for file in TOKENIZER_FILES:
                archive.add(require(name) / file, arcname=f"{name}/{file}")


def family_tokenizer(name: str, tokenizers: Path | None):
    """The offline world's tokenizer `name`: from `tokenizers`/name when given (pack_tokenizers' files), else from
    the asset cache."""
    return load_tokenizer(name) if tokenizers is None else AutoTokenizer.from_pretrained(tokenizers / name)


def build_model(shape: tuple, device: torch.device, dtype: torch.dtype, tokenizer, *, embed_every_id: bool):
    """The shape with random weights (seed 0) on `device`. `embed_every_id`: at least one embedding per id of
    `tokenizer` (Mistral's 32,768 are fewer than the stand-in tokenizer's ids, and an evaluation feeds every id)."""
    config_class, fields, _ = shape
    if embed_every_id:
        fields = fields | {"vocab_size": max(fields["vocab_size"], len(tokenizer))}
    config = config_class(**fields, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def build_folder(shape: tuple, folder: Path, device: torch.device, dtype: torch.dtype,
                 tokenizers: Path | None = None) -> int:
    """The shape with random weights (seed 0) saved as a model folder; returns its parameter count."""
    tokenizer = family_tokenizer(shape[2], tokenizers)
    model = build_model(shape, device, dtype, tokenizer, embed_every_id=True)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    return params


def _peak(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _reset(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# --trial-layouts: each name's PruneConfig fields (issue 83: which layout a GPU serves fastest at the same quality)
TRIAL_LAYOUTS = {"free": {}, "uniform": {"uniform": True}, "align64": {"align": 64}, "align128": {"align": 128},
                 "align256": {"align": 256}, "servable": {"servable": True}}


def trial(folder: Path, params: int, samples: int, seq_len: int, args, device: torch.device, cache: Path,
          layout: str = "free") -> dict:
    """One `run_trial` at samples x seq_len with the product's defaults (speed, perplexity, full evaluation) and a
    sweep's caches under `cache`; the importance pass's TFLOP/s counts forward and backward as 6 x parameters x
    tokens."""
    config = PruneConfig(model=str(folder), method="taylor", sparsity=0.2, seq_len=seq_len, num_samples=samples,
                         calibration="wiki", micro_batch_size=args.micro_batch_size, device=args.device,
                         dtype=args.dtype, **TRIAL_LAYOUTS[layout])
    # item_seed null: a --limit scores the first N documents, the items whose requests the passes before it built
    # (every item, the default, is the same items either way)
    evaluation = Evaluation(tasks="all", task_data="real", ppl="wiki", ppl_max_windows=args.ppl_windows,
                            fidelities=(args.limit,), speed=SpeedSpec(**args.speed), item_seed=None)
    _reset(device)
    torch._dynamo.reset()  # as in a trial's own process: no compiled graph in memory (Inductor's disk cache stays)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as trial_dir:
        metrics = run_trial(TrialConfig(prune=config, evaluation=evaluation, cache_dir=str(cache / "importance_cache")),
                            trial_dir)
    final, stages = schema.zero_shot_stage(args.limit), schema.stage_seconds(metrics)
    return {"samples": samples, "seq_len": seq_len, "layout": layout, "wall_s": time.perf_counter() - start,
            "stages_s": stages,
            "requests_s": metrics[schema.requests_key(final)],
            "requests_built": metrics[schema.requests_key(final, "_built")],
            "importance_tflops": 6 * params * samples * seq_len / stages["importance"] / 1e12,
            "zero_shot_tokens": metrics.get(schema.tokens_key(final)),
            "ppl": metrics.get("ppl"), "acc_mean": metrics.get("acc_mean"), "peak_gib": _peak(device),
            "pruning_ratio": metrics.get("pruning_ratio"),
            "prefill_speedup": metrics.get("prefill_speedup"), "decode_speedup": metrics.get("decode_speedup")}


# (family, method, uniform, depth_share): the shapes --families measures
FAMILIES = (("depth", "depth", False, 0.0), ("width", "random", False, 0.0), ("width", "random", True, 0.0),
            ("mixed", "random", True, 0.25), ("mixed", "random", True, 0.5))


def families(folder: Path, sparsity: float, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Speed and memory of each FAMILIES shape at `sparsity` against the unpruned model (measured first and last;
    the ratios use the first, the last shows the drift), decode at batch 1 and args.family_speed's decode_batch."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map={"": device}).eval()
    layout, spec = describe_layout(model), SpeedSpec(**args.family_speed)
    rows = [{"family": "unpruned", "speed": measure_speed(model, spec)}]
    for family, method, uniform, share in FAMILIES:
        config = PruneConfig(model=str(folder), method=method, sparsity=sparsity, uniform=uniform, depth_share=share,
                             depth_criterion="last", device=args.device, dtype=args.dtype)
        plan = make_plan(config, None, layout)
        pruned = apply_plan(copy.deepcopy(model), plan)
        speed = measure_speed(pruned, spec)
        rows.append({"family": family, "method": method, "uniform": uniform, "depth_share": share,
                     "layers_removed": len(plan.layers_removed),
                     "pruning_ratio": plan.params_removed(layout) / layout.total_params,
                     "speed": speed, **speed_ratios(speed, rows[0]["speed"])})
        del pruned
        _reset(device)
    rows.append({"family": "unpruned (again)", "speed": measure_speed(model, spec)})
    del model
    return rows


# evaluation passes: (scorer, fused, attention). prefix is the default; prefix_fused the same scorer with its decoder
# layers compiled; prefix_flex FlexAttention's block mask; hflm lm-eval's own. (In bench/gpu_h200_fused.json, run
# while fused was the default on CUDA, "prefix" was fused and "prefix_eager" was today's "prefix": its rows say which.)
PASSES = {"prefix": ("prefix", False, "sdpa"), "prefix_fused": ("prefix", True, "sdpa"),
          "prefix_flex": ("prefix", False, "flex"), "hflm": ("hflm", False, "sdpa")}


def evaluator_for(model, folder: Path, name: str, cache: Path) -> Evaluator:
    """The Evaluator of pass `name` (PASSES) with a sweep's request cache under `cache` (every pass but hflm reads
    what the first stored)."""
    scorer, fused, attention = PASSES[name]
    spec = EvalSpec(tasks="all", task_data="real", ppl=None, scorer=scorer, fused=fused)
    requests = RequestCache(cache / "requests") if scorer == "prefix" else None
    evaluator = Evaluator(model, load_tokenizer(str(folder)), spec, model_name=str(folder), request_cache=requests)
    evaluator.lm.attention = attention
    return evaluator


def evaluation(folder: Path, params: int, args, device: torch.device, dtype: torch.dtype, cache: Path,
               passes: list[str]) -> dict:
    """The full evaluation of the unpruned model by each of `passes` (PASSES), with the default batch sizing; the
    first prefix pass stores its requests in the request cache of a sweep under `cache`, the later ones read them.
    Each pass starts as a sweep's later trial does, in a new process: the model loaded again and no compiled graph
    in memory (torch._dynamo.reset; Inductor's kernels on disk stay, as they do on a sweep's node)."""
    out = {}
    for name in passes:
        _reset(device)
        torch._dynamo.reset()
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map={"": device}).eval()
        load = time.perf_counter() - start
        evaluator = evaluator_for(model, folder, name, cache)
        shots = evaluator.zero_shot(args.limit)
        out[name] = {"seconds": shots.seconds, "requests_s": shots.requests_seconds,
                     "requests_built": shots.requests_built, "tokens": shots.tokens,
                     "tokens_per_s": shots.tokens / shots.seconds, "load_s": load,
                     "fused": bool(getattr(evaluator.lm, "fused", False)),
                     "compiled_graphs": getattr(evaluator.lm, "compiled_graphs", 0),
                     "tflops": 2 * params * shots.tokens / shots.seconds / 1e12, "acc_mean": shots.acc_mean,
                     "items": sum(e["n"] for e in shots.tasks.values()), "peak_gib": _peak(device)}
        del model, evaluator
    return out


def importance_peak(name: str, shape: tuple, samples: int, seq_len: int, args, device: torch.device,
                    dtype: torch.dtype) -> dict:
    """The peak memory of the trial's largest stage, taylor importance at samples x seq_len (forward and backward,
    float32 accumulators beside the weights), for a shape built in memory (no folder): weights alone, then the peak."""
    tokenizer = family_tokenizer(shape[2], args.tokenizers)
    _reset(device)
    model = build_model(shape, device, dtype, tokenizer, embed_every_id=False)
    weights = _peak(device)
    # taken modulo the shape's vocabulary: Mistral's 32,768 is smaller than the stand-in tokenizer's, and with random
    # weights which token an id is does not change the work or the memory
    ids = load_calibration(tokenizer, "wiki", seq_len=seq_len, num_samples=samples, seed=0) % shape[1]["vocab_size"]
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    compute_importance(model, describe_layout(model), ids, micro_batch_size=args.micro_batch_size)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    out = {"shape": name, "samples": samples, "seq_len": seq_len, "params": params, "seconds": seconds,
           "tflops": 6 * params * samples * seq_len / seconds / 1e12, "weights_gib": weights,
           "peak_gib": _peak(device), "micro_batch_size": args.micro_batch_size}
    del model
    _reset(device)
    return out


# kernel name fragments by kind of work (cuBLAS/CUTLASS names vary by version; the rest count as "other")
KERNEL_KINDS = (("matmul", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "cublas")),
                ("attention", ("fmha", "flash", "attention", "attn", "flex", "triton_tem")),
                ("softmax", ("softmax",)), ("copy", ("memcpy", "memset")))


# Inductor's fused pointwise, reduction and persistent kernels are named after the operations they feed, an attention
# among them: they are elementwise work ("other") whatever their name says
FUSED_ELEMENTWISE = ("triton_poi", "triton_red", "triton_per")


def recovery_steps(name: str, shape: tuple, micro: int, seq_len: int, steps: tuple[int, int], args,
                   device: torch.device, dtype: torch.dtype) -> dict:
    """Recovery's step time at the shape, as a trial runs it with `loss: kd`: the unpruned model (built in memory)
    as teacher, its free layout cut 20% by the random method as student, LoRA on every projection, one micro-batch
    of `micro` x `seq_len` random tokens per step. `recover` runs twice, for `steps[0]` and `steps[1]` optimizer
    steps, each on a fresh student: the difference of their times over the difference of their steps is the time of
    one step without the fixed costs (the held-out losses, attaching and merging the adapters). The peak is the
    longer run's, teacher and student together."""
    tokenizer = family_tokenizer(shape[2], args.tokenizers)
    teacher = build_model(shape, device, dtype, tokenizer, embed_every_id=False).eval()
    layout = describe_layout(teacher)
    plan = make_plan(PruneConfig(model=name, method="random", sparsity=0.2, device=args.device, dtype=args.dtype),
                     None, layout)
    vocab = teacher.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    runs = []
    for count in steps:
        student = apply_plan(copy.deepcopy(teacher), plan)
        spec = RecoverySpec(loss="kd", micro_batch_size=micro, seq_len=seq_len, steps=count, warmup_steps=0,
                            heldout_windows=micro)
        ids = torch.randint(vocab, (spec.sequences, seq_len), generator=generator)
        held = torch.randint(vocab, (micro, seq_len), generator=generator)
        _reset(device)
        recovered = recover(student, ids, held, spec, teacher=teacher)
        runs.append({"steps": count, "seconds": recovered.seconds, "peak_gib": _peak(device),
                     "train_loss_first": recovered.train_loss[0], "train_loss_last": recovered.train_loss[-1],
                     "heldout_before": recovered.loss_before, "heldout_after": recovered.loss_after})
        del student, recovered
    (short, long) = runs
    del teacher
    _reset(device)
    return {"shape": name, "loss": "kd", "micro_batch_size": micro, "seq_len": seq_len, "runs": runs,
            "step_s": (long["seconds"] - short["seconds"]) / (long["steps"] - short["steps"]),
            "peak_gib": long["peak_gib"], "pruning_ratio": plan.params_removed(layout) / layout.total_params}


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    if lowered.startswith(FUSED_ELEMENTWISE):
        return "other"
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lowered for m in marks)), "other")


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals in microseconds, in seconds: the time the device had work."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total / 1e6


def profile_prefix(folder: Path, limit: int, args, device: torch.device, dtype: torch.dtype, cache: Path,
                   name: str = "prefix") -> dict:
    """Where pass `name`'s time goes (PASSES: prefix or prefix_fused), at `limit` items per task: a first pass builds
    the requests and warms the kernels (compiles them, fused), a second is timed plainly, a third under
    torch.profiler. From the third: the time the device had a kernel running (union of kernel intervals) against the
    wall time, the kernels' time by kind and the longest kernels, the host's own operators, and the host seconds in
    batch preparation and in enqueueing forwards."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map={"": device}).eval()
    evaluator = evaluator_for(model, folder, name, cache)
    evaluator.zero_shot(limit)
    plain = evaluator.zero_shot(limit)
    lm, host = evaluator.lm, {"prepare": 0.0, "forward": 0.0}
    calls = {"forward": 0}

    def timed(method, key):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                host[key] += time.perf_counter() - start
                calls[key] = calls.get(key, 0) + 1
        return wrapper

    lm._prepare, lm._forward = timed(lm._prepare, "prepare"), timed(lm._forward, "forward")
    forwarded, unpadded = lm.tokens_forwarded, lm.tokens_unpadded
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        shots = evaluator.zero_shot(limit)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    del lm._prepare, lm._forward
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_kind: dict[str, float] = {}
    by_name: dict[str, list] = {}
    for e in kernels:
        seconds = (e.time_range.end - e.time_range.start) / 1e6
        kind = kernel_kind(e.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + seconds
        entry = by_name.setdefault(e.name, [0.0, 0])
        entry[0] += seconds
        entry[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:15]
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    busy = busy_seconds([(e.time_range.start, e.time_range.end) for e in kernels])
    out = {"pass": name, "fused": bool(lm.fused), "limit": limit, "items": sum(e["n"] for e in shots.tasks.values()),
           "plain_seconds": plain.seconds, "plain_requests_s": plain.requests_seconds,
           "profiled_seconds": wall, "profiled_requests_s": shots.requests_seconds,
           "tokens_forwarded": lm.tokens_forwarded - forwarded, "tokens_unpadded": lm.tokens_unpadded - unpadded,
           "forwards": calls["forward"], "host_prepare_s": host["prepare"], "host_forward_s": host["forward"],
           "device_busy_s": busy, "kernels_s": sum(by_kind.values()), "kernels_by_kind_s": by_kind,
           "top_kernels": [{"name": n[:160], "seconds": v[0], "count": v[1], "kind": kernel_kind(n)} for n, v in top],
           "top_host_ops": [{"name": e.key[:160], "self_cpu_s": e.self_cpu_time_total / 1e6, "count": e.count}
                            for e in ops]}
    del model, evaluator
    _reset(device)
    return out


def attempt(measure, device: torch.device) -> dict:
    """measure()'s result, or {"error": ...}: one failed measurement of a lease does not cost the ones after it."""
    try:
        return measure()
    except Exception as error:  # noqa: BLE001 - recorded, and the run goes on
        _reset(device)
        return {"error": f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"}


def _gib(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def trial_layout(row: dict) -> str:
    """A trial row's layout name (rows of the earlier files say `uniform` only)."""
    return row.get("layout") or ("uniform" if row.get("uniform") else "free")


def table(data: dict) -> str:
    lines = [f"{data['machine']['device']} · torch {data['machine']['torch']} · {data['date']}", "",
             "| shape | parameters | pass | fused | items | seconds | of which requests | requests built | "
             "graphs compiled | tokens | tokens/s | TFLOP/s | peak GiB |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    recovery = [f"| {r['shape']} | {r.get('error', '')} | | | |" if "error" in r else
                f"| {r['shape']} | kd, {r['micro_batch_size']} x {r['seq_len']} | {r['step_s']:.3f} | "
                f"{_gib(r['peak_gib'])} | {r['pruning_ratio']:.3f} |" for r in data.get("recovery", [])]
    if recovery:
        lines[1:1] = ["| shape | recovery | seconds per step | peak GiB | pruned |", "|---|---|---:|---:|---:|",
                      *recovery, ""]
    for name, shape in data["shapes"].items():
        for scorer, e in shape.get("evaluation", {}).items():
            if "seconds" not in e:  # failed, or started and cut by a time limit
                lines.append(f"| {name} | {shape['params'] / 1e9:.2f}B | {scorer} | | {e.get('error', 'not finished')} "
                             "| | | | | | | | |")
                continue
            fused = {True: "yes", False: "no"}.get(e.get("fused"), "–")
            lines.append(f"| {name} | {shape['params'] / 1e9:.2f}B | {scorer} | {fused} | {e['items']} | "
                         f"{e['seconds']:.1f} | "
                         f"{e['requests_s']:.1f} | {e.get('requests_built', '–')} | {e.get('compiled_graphs', '–')} | "
                         f"{e['tokens']:,} | {e['tokens_per_s']:,.0f} | {e['tflops']:.1f} | {_gib(e['peak_gib'])} |")
    lines += ["", "| shape | samples × seq_len | layout | trial s | unpruned speed | load | importance (TFLOP/s) | "
              "prune | speed | ppl | zero-shot (requests) | peak GiB | prefill speedup |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, shape in data["shapes"].items():
        for t in shape.get("trials", []):
            if "error" in t:
                lines.append(f"| {name} | {t['error']} |")
                continue
            s = t["stages_s"]
            shot = next((v for k, v in s.items() if k.startswith("zero_shot_")), 0)
            lines.append(f"| {name} | {t['samples']} × {t['seq_len']} | "
                         f"{trial_layout(t)} | {t['wall_s']:.1f} | "
                         f"{s.get('unpruned_speed', 0):.1f} | {s.get('load', 0):.1f} | {s.get('importance', 0):.1f} "
                         f"({t['importance_tflops']:.1f}) | {s.get('prune', 0):.1f} | {s.get('speed', 0):.1f} | "
                         f"{s.get('ppl', 0):.1f} | {shot:.1f} ({t['requests_s']:.1f}) | {_gib(t['peak_gib'])} | "
                         f"{_ratio(t.get('prefill_speedup'))} |")
    for name, shape in data["shapes"].items():
        rows = shape.get("families")
        if not rows:
            continue
        drift = rows[-1]["speed"]["decode_tokens_per_s"] / rows[0]["speed"]["decode_tokens_per_s"]
        lines += ["", f"{name} at sparsity {shape['families_sparsity']:.0%} (unpruned measured again last: decode b1 "
                  f"{drift:.3f}× the first)", "",
                  "| family | layout | layers removed | reached | prefill speedup | decode speedup b1 | "
                  f"decode speedup b{shape['families_decode_batch']} | memory ratio |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows[1:-1]:
            layout = "–" if r["family"] == "depth" else ("uniform" if r["uniform"] else "free")
            share = f" (share {r['depth_share']})" if r["depth_share"] else ""
            lines.append(f"| {r['family']}{share} | {layout} | {r['layers_removed']} | {r['pruning_ratio']:.3f} | "
                         f"{_pm(r, 'prefill_speedup')} | {_pm(r, 'decode_speedup')} | "
                         f"{_pm(r, 'decode_batch_speedup')} | {r['memory_ratio']:.3f} |")
    peaks = data.get("peaks", [])
    if peaks:
        lines += ["", "| shape | parameters | taylor importance at | micro-batch | seconds | TFLOP/s | weights GiB | "
                  "peak GiB |", "|---|---:|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['shape']} | {r['params'] / 1e9:.2f}B | {r['samples']} × {r['seq_len']} | "
                  f"{r['micro_batch_size']} | {r['seconds']:.1f} | {r['tflops']:.1f} | {_gib(r['weights_gib'])} | "
                  f"{_gib(r['peak_gib'])} |" if "error" not in r else f"| {r['shape']} | – | {r['samples']} × "
                  f"{r['seq_len']} | – | – | – | – | {r['error']} |" for r in peaks]
    profiles = [(name, prof) for name, shape in data["shapes"].items()
                for prof in ([shape["profile"]] if "profile" in shape else list(shape.get("profiles", {}).values()))]
    for name, prof in profiles:
        if "error" in prof:
            lines += ["", f"{name}: profile failed: {prof['error']}"]
            continue
        wall = prof["profiled_seconds"]
        lines += ["", f"{name}: where the {prof.get('pass', 'prefix')} pass's time goes ({prof['items']} items, "
                  f"{prof['limit']} per task; "
                  f"plain pass {prof['plain_seconds']:.1f} s of which requests {prof['plain_requests_s']:.1f} s; "
                  f"under the profiler {wall:.1f} s, {prof['forwards']} forwards, "
                  f"{prof['tokens_forwarded']:,} tokens forwarded of which padding "
                  f"{1 - prof['tokens_unpadded'] / max(prof['tokens_forwarded'], 1):.1%})", "",
                  "| where | seconds | share of the profiled wall |", "|---|---:|---:|",
                  f"| device busy (any kernel running) | {prof['device_busy_s']:.2f} | "
                  f"{prof['device_busy_s'] / wall:.1%} |"]
        lines += [f"| kernels: {kind} | {sec:.2f} | {sec / wall:.1%} |"
                  for kind, sec in sorted(prof["kernels_by_kind_s"].items(), key=lambda kv: -kv[1])]
        lines += [f"| host: batch preparation | {prof['host_prepare_s']:.2f} | {prof['host_prepare_s'] / wall:.1%} |",
                  f"| host: enqueueing forwards | {prof['host_forward_s']:.2f} | "
                  f"{prof['host_forward_s'] / wall:.1%} |",
                  f"| requests read | {prof['profiled_requests_s']:.2f} | {prof['profiled_requests_s'] / wall:.1%} |"]
    return "\n".join(lines)


def _pm(row: dict, key: str) -> str:
    se = row.get(f"{key}_se")
    return f"{row[key]:.2f}" + ("" if se is None else f" ± {se:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="where the results go")
    parser.add_argument("--table", type=Path, help="print the Markdown tables of an earlier --json and exit")
    parser.add_argument("--small", action="store_true", help="a tiny shape on CPU, few items: the tests' mode")
    parser.add_argument("--shapes", default=None, help="comma-separated subset of the shapes")
    parser.add_argument("--importance", default=None, help="SAMPLESxSEQ_LEN,... (default 128x512,256x512); none: "
                        "no trial")
    parser.add_argument("--passes", default="prefix,hflm", help="evaluation passes in order, any of prefix, "
                        "prefix_fused, prefix_flex, hflm, repeats allowed (the first prefix pass builds the "
                        "requests, the later ones read them); hflm and prefix_flex run after the trials; none: only "
                        "the trials")
    parser.add_argument("--last", default=None, help="passes run after everything else (e.g. a baseline a time "
                        "limit may cut)")
    parser.add_argument("--profile-passes", default="prefix", help="the passes --profile profiles, any of prefix, "
                        "prefix_fused")
    parser.add_argument("--trial-layouts", default="free", help="the trials' width layouts, comma-separated: "
                        + ", ".join(TRIAL_LAYOUTS))
    parser.add_argument("--families", type=float, default=None, metavar="SPARSITY",
                        help="the speed of depth, width and mixed cuts at this sparsity (decode at batch 1 and 16)")
    parser.add_argument("--limit", type=int, default=None, help="items per task (default every item)")
    parser.add_argument("--ppl-windows", type=int, default=None, help="perplexity windows (default every one)")
    parser.add_argument("--profile", type=int, default=None, metavar="LIMIT",
                        help="profile the prefix scorer at LIMIT items per task (after the evaluation passes)")
    parser.add_argument("--peaks", default=None, metavar="SAMPLESxSEQ_LEN,...",
                        help="the importance stage's peak memory of every shape (not only --shapes) at these sizes")
    parser.add_argument("--recovery", default=None, metavar="MICROxSEQ_LEN",
                        help="recovery's seconds per kd step and peak memory at this micro-batch (before the shapes)")
    parser.add_argument("--recovery-steps", default="2,10", metavar="SHORT,LONG",
                        help="the two recovery runs' optimizer steps (their difference times one step)")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--tokenizers", type=Path, help="a folder of <asset>/tokenizer files (--pack-tokenizers'), "
                        "for a machine without the asset cache")
    parser.add_argument("--pack-tokenizers", type=Path, metavar="OUT.tgz", help="write the shapes' tokenizers as an "
                        "archive for --tokenizers and exit")
    args = parser.parse_args()
    if args.pack_tokenizers:
        pack_tokenizers(args.pack_tokenizers)
        return
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    if args.json is None:
        parser.error("--json is required (or --table)")
    shapes = SMALL if args.small else SHAPES
    if args.shapes:
        shapes = {k: shapes[k] for k in args.shapes.split(",")}
    runs = [tuple(int(v) for v in pair.split("x")) for pair in (args.importance or (
        "8x32" if args.small else "128x512,256x512")).split(",") if pair != "none"]
    args.passes = [name for name in args.passes.split(",") if name != "none"]
    args.last = [name for name in (args.last or "").split(",") if name]
    args.trial_layouts = args.trial_layouts.split(",")
    if not set(args.trial_layouts) <= set(TRIAL_LAYOUTS):
        parser.error(f"--trial-layouts: any of {', '.join(TRIAL_LAYOUTS)}, not {','.join(args.trial_layouts)}")
    for flag, names in (("--passes", args.passes), ("--last", args.last),
                        ("--profile-passes", args.profile_passes.split(","))):
        if not set(names) <= set(PASSES):
            parser.error(f"{flag}: any of {', '.join(PASSES)} (or none), not {','.join(names)}")
    if args.small:
        args.limit, args.ppl_windows = args.limit or 3, args.ppl_windows or 4
        args.device, args.dtype = "cpu", "float32"
        args.speed = {"prefill_batch": 1, "prefill_len": 16, "decode_batch": 2, "prompt_len": 8, "new_tokens": 4,
                      "repeats": 1, "warmup": 0}
        args.family_speed = args.speed | {"repeats": 3}
    else:
        args.device, args.dtype, args.speed = "cuda", "bfloat16", {}
        args.family_speed = {"decode_batch": 16, "new_tokens": 32, "repeats": 7, "warmup": 2}
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    data = {"machine": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        "cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
            "date": time.strftime("%Y-%m-%d %H:%M"), "limit": args.limit, "ppl_windows": args.ppl_windows,
            "shapes": {}}
    for pair in (args.peaks or "").split(","):  # first: built in memory, no folder; a failure is recorded
        if not pair:
            continue
        samples, seq_len = (int(v) for v in pair.split("x"))
        for name, shape in (SMALL if args.small else SHAPES).items():
            try:
                row = importance_peak(name, shape, samples, seq_len, args, device, dtype)
            except torch.OutOfMemoryError as error:
                row = {"shape": name, "samples": samples, "seq_len": seq_len, "error": str(error).splitlines()[0]}
                _reset(device)
            data.setdefault("peaks", []).append(row)
            write_json(args.json, data)
    if args.recovery:  # built in memory, no folder; a failure is recorded
        micro, seq_len = (int(v) for v in args.recovery.split("x"))
        steps = tuple(int(v) for v in args.recovery_steps.split(","))
        for name, shape in shapes.items():
            data.setdefault("recovery", []).append({"shape": name} | attempt(lambda: recovery_steps(
                name, shape, micro, seq_len, steps, args, device, dtype), device))
            write_json(args.json, data)
    if not (args.passes or args.last or runs or args.profile is not None or args.families is not None):
        shapes = {}  # nothing measured on a folder: none is built
    for name, shape in shapes.items():
        folder = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        cache = Path(tempfile.mkdtemp(prefix=f"{name}-sweep-"))  # the caches a sweep of this model would share
        try:
            start = time.perf_counter()
            params = build_folder(shape, folder, device, dtype, args.tokenizers)
            entry = data["shapes"][name] = {"params": params, "build_s": time.perf_counter() - start, "trials": []}
            late = [p for p in args.passes if p in ("hflm", "prefix_flex")]  # after the trials, in the order given

            def run_passes(names: list[str]) -> None:
                for pass_name in names:  # one at a time: a pass cut by a time limit still says when it started
                    evaluations = entry.setdefault("evaluation", {})
                    key = pass_name if pass_name not in evaluations else f"{pass_name}#{len(evaluations)}"
                    evaluations[key] = {"started": time.time()}
                    write_json(args.json, data)
                    evaluations[key] = attempt(lambda: evaluation(folder, params, args, device, dtype, cache,
                                                                  [pass_name])[pass_name], device)
                    write_json(args.json, data)

            run_passes([p for p in args.passes if p not in late])
            write_json(args.json, data)
            if args.profile is not None:
                for pass_name in args.profile_passes.split(","):
                    entry.setdefault("profiles", {})[pass_name] = attempt(lambda: profile_prefix(
                        folder, args.profile, args, device, dtype, cache, pass_name), device)
                    write_json(args.json, data)
            if args.families is not None:
                entry["families_sparsity"] = args.families
                entry["families_decode_batch"] = args.family_speed["decode_batch"]
                entry["families"] = families(folder, args.families, args, device, dtype)
                write_json(args.json, data)
            for samples, seq_len in runs:
                for layout in args.trial_layouts:
                    entry["trials"].append(attempt(lambda: trial(folder, params, samples, seq_len, args, device,
                                                                 cache, layout), device))
                    write_json(args.json, data)
            run_passes(late + args.last)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)
    write_json(args.json, data)
    print(table(data))


if __name__ == "__main__":
    main()
