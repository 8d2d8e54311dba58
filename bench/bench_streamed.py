"""Issue 92, must-show 3 (the 8B part): an 8B-shaped Llama (Llama-3-8B's config, random bf16 weights, written to
disk one layer at a time) scored, pruned and evaluated streamed on this machine (2 cores, 24 GB, no GPU): the Taylor
pass over 8 x 128 calibration tokens layer by layer from the folder, the plan, the pruned folder written shard by
shard, and the pruned folder's perplexity on a few windows, streamed in turn. Each step's seconds and the process's
peak memory: anonymous (what the process allocated) and file-backed (the memory-mapped safetensors pages the page
cache holds for it, which the kernel can drop), read from /proc/self/status by a sampling thread. The in-memory pass of
the same model goes to the preflight's memory check, which refuses it with `streaming: off` (its reason is recorded)
and takes it with `streaming: auto` (the trial would stream).

With `--pair MODEL` instead (must-shows 3 and 4 on a real model): the Taylor pass in memory and streamed, interleaved,
each run in a fresh process (its own peak), `--repeats` pairs: each side's seconds and peaks, the streamed over the
in-memory time per pair with a bootstrap interval of the median ratio, and the streamed pass's peak beside the bound
`sweep.memory.streamed_importance` states for it.

    python bench/bench_streamed.py --pair qwen2.5-0.5b --out bench/host/streamed_pair_qwen.jsonl

With `--random-shape SHAPE --device cuda` (issue 95's must-show 3, `bench/gpu_all.sh streamed`): a random model of
that shape made on the device one layer at a time (`RandomLayers`, no folder), its streamed pass's seconds and peak
device memory, and with `--compare` the in-memory pass of the same weights beside it and how far the two disagree.

Resumable: the model folder is built once (kept under the asset home's bench/), each step's result is appended to
the JSON lines file as it ends, and a step already there is not run again.

    python bench/bench_streamed.py --out bench/host/streamed_8b.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from taylor_tune.compat.transformers import building, no_init_weights
from taylor_tune.evaluation.perplexity import perplexity, windows_of
from taylor_tune.sources.assets import home
from taylor_tune.sources.data import load_ppl_text
from taylor_tune.sources.models import load_tokenizer

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


LLAMA3_70B = LLAMA3_8B | dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
SHAPES = {"llama-3-8b": LLAMA3_8B, "llama-3-70b": LLAMA3_70B,
          "tiny": LLAMA3_8B | dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=8,
                                   num_key_value_heads=2, vocab_size=512)}


class RandomLayers:
    """A Llama of `config`'s shapes held as `sources.streaming.Checkpoint` holds a folder's, with no folder: its head
    made on the device with N(0, 0.02) weights (norms at 1), each layer made on the device when asked for, seeded by
    its index, so that the gradient pass's second read of a layer gives the first read's weights. A 70B's streamed
    pass on one GPU without its 140 GB on disk (issue 95's must-show 3)."""

    def __init__(self, config, device, dtype):
        import copy

        from taylor_tune.sources.streaming import _rebuilt_buffers

        self.device, self.dtype, self.scratch, self._copy = torch.device(device), dtype, None, copy.deepcopy
        with building(), no_init_weights(), torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        self.shells = list(self.model.model.layers)
        self.num_layers = len(self.shells)
        for name in ("embed_tokens", "norm"):
            self.model.model.get_submodule(name).to_empty(device=self.device)
        self.model.lm_head.to_empty(device=self.device)
        self._fill([self.model.model.embed_tokens, self.model.model.norm, self.model.lm_head], seed=-1)
        _rebuilt_buffers(self.model, self.device)
        self.model.requires_grad_(False).eval()

    def _fill(self, modules, seed: int) -> None:
        generator = torch.Generator(device=self.device).manual_seed(seed + 1)
        with torch.no_grad():
            for module in modules:
                for param in module.parameters():
                    if param.dim() == 1:
                        param.fill_(1.0)
                    else:
                        param.normal_(0.0, 0.02, generator=generator)

    def layer(self, index: int):
        layer = self._copy(self.shells[index]).to_empty(device=self.device)
        self._fill([layer], seed=index)
        layer.requires_grad_(False).eval()
        self.model.model.layers[index] = layer
        return layer

    def release(self, index: int) -> None:
        self.model.model.layers[index] = self.shells[index]


def random_shape(args) -> None:
    """The streamed Taylor pass of a random model of a named shape on `--device` (the in-memory pass beside it with
    `--compare`: the same weights, every layer made at once), seconds and peak device memory; on CPU the peaks are
    the process's anonymous memory."""
    from taylor_tune.pruning.groups import describe_layout
    from taylor_tune.pruning.importance import compute_importance
    from taylor_tune.pruning.streamed import compute_importance_streamed

    config = LlamaConfig(**SHAPES[args.random_shape], dtype=args.dtype)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    on_gpu = device.type == "cuda"
    ids = torch.randint(0, min(49152, config.vocab_size), (args.samples, args.seq_len),
                        generator=torch.Generator().manual_seed(0))
    peaks = None if on_gpu else Peaks()

    def peak() -> float:
        return (torch.cuda.max_memory_allocated(device) if on_gpu else peaks.anon) / 2**30

    def reset() -> None:
        if on_gpu:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            peaks.reset()

    results, out = {}, Path(args.out)
    for side in ("streamed", "memory") if args.compare else ("streamed",):
        reset()
        begin = time.perf_counter()
        held = RandomLayers(config, device, dtype)
        layout = describe_layout(_layout_model(config, dtype))
        if side == "memory":  # every layer made at once: the loaded model the in-memory pass needs
            for index in range(held.num_layers):
                held.layer(index)
        made = time.perf_counter()
        scored = (compute_importance(held.model, layout, ids, micro_batch_size=args.micro_batch) if side == "memory"
                  else compute_importance_streamed(held, layout, ids, micro_batch_size=args.micro_batch))
        if on_gpu:
            torch.cuda.synchronize(device)
        done = time.perf_counter()
        results[side] = scored[args.samples]
        row = {"shape": args.random_shape, "side": side, "device": torch.cuda.get_device_name(device) if on_gpu else
               f"{platform.node()} cpu", "dtype": args.dtype, "tokens": int(ids.numel()), "make_s": made - begin,
               "pass_s": done - made, "peak_gib": peak(), "params": layout.total_params,
               "date": datetime.now(UTC).isoformat(timespec="seconds"), "torch": torch.__version__}
        del held, scored
        with out.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    if args.compare:  # the two passes agree (the equality the tests hold on CPU, here on this device and dtype)
        import numpy as np

        a, b = results["memory"].scores, results["streamed"].scores
        worst = max(float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(x))), 1e-30))
                    for x, y in zip((*a.attn, *a.mlp), (*b.attn, *b.mlp), strict=True))
        with out.open("a") as handle:
            handle.write(json.dumps({"shape": args.random_shape, "agree_max_rel": worst}) + "\n")
        print(json.dumps({"agree_max_rel": worst}), flush=True)


def _layout_model(config, dtype):
    """The model's shapes on the meta device, for its layout."""
    with building(), no_init_weights(), torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


class Peaks:
    """The largest RssAnon and RssFile (KiB in /proc/self/status) seen since `reset`, sampled every 50 ms."""

    def __init__(self):
        self.anon = self.file = 0
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def now() -> tuple[int, int]:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return (int(fields["RssAnon"].split()[0]) * 1024, int(fields["RssFile"].split()[0]) * 1024)

    def _run(self):
        while not self._stop.wait(0.05):
            anon, file = self.now()
            self.anon, self.file = max(self.anon, anon), max(self.file, file)

    def reset(self):
        self.anon, self.file = self.now()


def build(folder: Path, tokenizer_from: str) -> None:
    """Llama-3-8B's shapes with N(0, 0.02) bf16 weights (norms at 1), one safetensors shard per layer."""
    if (folder / "model.safetensors.index.json").is_file():
        return
    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**LLAMA3_8B, dtype="bfloat16")
    with building(), no_init_weights(), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    groups: dict[str, list[tuple[str, torch.Size]]] = {}
    for name, p in model.state_dict().items():
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "head"
        groups.setdefault(key, []).append((name, p.shape))
    weight_map = {}
    for number, (key, tensors) in enumerate(groups.items()):
        shard = f"model-{number:05d}.safetensors"
        state = {name: (torch.ones(shape, dtype=torch.bfloat16) if len(shape) == 1 else
                        (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)) for name, shape in tensors}
        save_file(state, folder / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(state, shard)
        print(f"built {key}", flush=True)
    config.save_pretrained(folder)
    load_tokenizer(tokenizer_from).save_pretrained(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def one_pass(model: str, side: str, samples: int, seq_len: int, micro_batch: int) -> dict:
    """One Taylor pass over `samples` x `seq_len` wiki tokens in float32, in memory or streamed, in this process:
    its load and pass seconds and the process's peaks."""
    from taylor_tune.pruning.groups import describe_layout
    from taylor_tune.pruning.importance import compute_importance
    from taylor_tune.pruning.streamed import compute_importance_streamed
    from taylor_tune.sources.models import load_model, stream_model

    peaks = Peaks()
    tokenizer = load_tokenizer(model)
    ids = windows_of(tokenizer, load_ppl_text("wiki"), seq_len, samples)
    peaks.reset()
    begin = time.perf_counter()
    held = load_model(model, dtype=torch.float32) if side == "memory" else stream_model(model, dtype=torch.float32)
    layout = describe_layout(held if side == "memory" else held.skeleton())
    loaded = time.perf_counter()
    compute = compute_importance if side == "memory" else compute_importance_streamed
    compute(held, layout, ids, micro_batch_size=micro_batch)
    done = time.perf_counter()
    time.sleep(0.1)  # one more sample of the peaks
    return {"side": side, "load_s": loaded - begin, "pass_s": done - loaded, "peak_anon_gib": peaks.anon / 2**30,
            "peak_file_gib": peaks.file / 2**30}


def pair(args) -> None:
    """The in-memory and the streamed pass, interleaved, each in a fresh process; then the summary row."""
    import subprocess
    import sys

    import numpy as np

    from taylor_tune.pruning.prune import meta_layout
    from taylor_tune.sources.models import load_model_config
    from taylor_tune.sweep import memory

    out = Path(args.out)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []
    for repeat in range(args.repeats):
        for side in ("memory", "streamed") if repeat % 2 == 0 else ("streamed", "memory"):
            if any(r.get("repeat") == repeat and r.get("side") == side for r in rows):
                continue
            proc = subprocess.run([sys.executable, __file__, "--one", side, "--pair", args.pair, "--samples",
                                   str(args.samples), "--seq-len", str(args.seq_len)], capture_output=True,
                                  text=True, check=True)
            row = json.loads(proc.stdout.strip().splitlines()[-1]) | {"repeat": repeat}
            rows.append(row)
            with out.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    sides = {side: sorted((r for r in rows if r.get("side") == side), key=lambda r: r["repeat"])
             for side in ("memory", "streamed")}
    ratios = np.array([s["pass_s"] / m["pass_s"] for m, s in zip(sides["memory"], sides["streamed"], strict=True)])
    rng = np.random.default_rng(0)
    boot = [np.median(rng.choice(ratios, len(ratios))) for _ in range(10000)]
    config, layout = load_model_config(args.pair), meta_layout(args.pair)
    shape = memory.Shape.of(config, layout.total_params, sum(layout.layer_params))
    bound = memory.streamed_importance(shape, args.samples, 4, args.seq_len, 4)
    summary = {"summary": True, "model": args.pair, "tokens": args.samples * args.seq_len, "pairs": len(ratios),
               "time_ratio_median": float(np.median(ratios)),
               "time_ratio_95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
               "memory_peak_anon_gib": max(r["peak_anon_gib"] for r in sides["memory"]),
               "streamed_peak_anon_gib": max(r["peak_anon_gib"] for r in sides["streamed"]),
               "streamed_peak_file_gib": max(r["peak_file_gib"] for r in sides["streamed"]),
               "streamed_bound_gib": bound.total / 2**30,
               "bound_parts_gib": {k: round(v / 2**30, 3) for k, v in bound.parts.items()},
               "machine": f"{platform.node()} {platform.machine()}, {torch.get_num_threads()} threads",
               "date": datetime.now(UTC).isoformat(timespec="seconds"), "torch": torch.__version__}
    with out.open("a") as handle:
        handle.write(json.dumps(summary) + "\n")
    print(json.dumps(summary), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/host/streamed_8b.jsonl")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--sparsity", type=float, default=0.2)
    parser.add_argument("--pair", help="a real model: the in-memory and the streamed pass side by side")
    parser.add_argument("--one", choices=("memory", "streamed"), help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--random-shape", choices=sorted(SHAPES), help="a random model of this shape, made on "
                        "--device layer by layer (no folder): the streamed pass's seconds and peak")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--compare", action="store_true", help="with --random-shape: the in-memory pass beside it")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.one:
        print(json.dumps(one_pass(args.pair, args.one, args.samples, args.seq_len, 4)))
        return
    if args.pair:
        pair(args)
        return
    if args.random_shape:
        random_shape(args)
        return
    out = Path(args.out)
    done = {json.loads(line)["step"] for line in out.read_text().splitlines()} if out.is_file() else set()
    folder, pruned = home() / "bench" / "llama3-8b-random", home() / "bench" / "llama3-8b-random-pruned"
    peaks = Peaks()
    torch.set_num_threads(2)

    def record(step: str, seconds: float, **extra) -> None:
        row = {"step": step, "seconds": round(seconds, 1), "peak_anon_gib": round(peaks.anon / 2**30, 2),
               "peak_file_gib": round(peaks.file / 2**30, 2), **extra,
               "machine": f"{platform.node()} {platform.machine()}, {torch.get_num_threads()} threads",
               "date": datetime.now(UTC).isoformat(timespec="seconds"), "torch": torch.__version__}
        with out.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    if "build" not in done:
        peaks.reset()
        begin = time.perf_counter()
        build(folder, "smollm2-135m")  # its ids (< 49,152) are all within Llama-3's vocabulary
        record("build", time.perf_counter() - begin)
    if "in_memory_preflight" not in done:
        from taylor_tune.errors import ConfigError
        from taylor_tune.sweep.experiment import Experiment
        from taylor_tune.sweep.preflight import check_memory

        for streaming in ("off", "auto"):  # refused whole; taken streamed (auto decides from the same estimate)
            experiment = Experiment(
                name="eight-b", models=[str(folder)], search={"algorithm": "grid"},
                search_space={"pruning_method": {"grid": ["taylor"]}, "taylor_seq_len": {"grid": [args.seq_len]},
                              "taylor_num_samples": {"grid": [args.samples]}},
                prune={"device": "cpu", "dtype": "bfloat16", "calibration": "wiki", "micro_batch_size": 4,
                       "streaming": streaming},
                evaluation={"tasks": [], "ppl": "wiki", "ppl_window": args.seq_len, "speed": None},
                resources={"cpu": 2, "gpu": 0})
            try:
                check_memory(experiment)
                refusal = None
            except ConfigError as error:
                refusal = str(error)
            record("in_memory_preflight" if streaming == "off" else "streamed_preflight", 0.0, refused=refusal)
    from taylor_tune.pruning.groups import describe_layout
    from taylor_tune.pruning.streamed import compute_importance_streamed
    from taylor_tune.sources.models import stream_model

    tokenizer = load_tokenizer(str(folder))
    text = load_ppl_text("wiki")
    if "score" not in done or "prune" not in done:
        stream = stream_model(str(folder), dtype=torch.bfloat16)
        layout = describe_layout(stream.skeleton())
        ids = windows_of(tokenizer, text, args.seq_len, args.samples)
        peaks.reset()
        begin = time.perf_counter()
        importance = compute_importance_streamed(stream, layout, ids, micro_batch_size=4)[args.samples]
        if "score" not in done:
            record("score", time.perf_counter() - begin, tokens=int(ids.numel()),
                   layers=layout.num_layers, params=layout.total_params)
        from taylor_tune.config import build_prune_config
        from taylor_tune.pruning.apply import save_pruned_streamed
        from taylor_tune.pruning.prune import make_plan

        config = build_prune_config({"model": str(folder), "method": "taylor", "sparsity": args.sparsity,
                                     "device": "cpu", "dtype": "bfloat16"})
        peaks.reset()
        begin = time.perf_counter()
        plan = make_plan(config, importance.scores, layout)
        save_pruned_streamed(stream, plan, pruned, tokenizer)
        kept = sum(int(p.numel()) for p in stream_model(str(pruned)).skeleton().parameters())
        record("prune", time.perf_counter() - begin, params_before=layout.total_params, params_after=kept)
    if "perplexity" not in done:
        peaks.reset()
        begin = time.perf_counter()
        result = perplexity(stream_model(str(pruned), dtype=torch.bfloat16), tokenizer, text, window=args.seq_len,
                            batch_size=2, max_windows=args.windows)
        record("perplexity", time.perf_counter() - begin, ppl=result["ppl"], windows=result["ppl_windows"])


if __name__ == "__main__":
    main()
