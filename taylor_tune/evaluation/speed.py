"""What a model costs to run, measured on its own device: prefill and decode throughput, weight and KV-cache memory.

Random token ids (the cost of a forward does not depend on which tokens), no padding. Decode is greedy with the KV
cache, one token per step, timed after an untimed prompt prefill. On CUDA each run is bracketed by CUDA events after
a synchronize; elsewhere by the wall clock. The KV cache's bytes at a context are its exact size as transformers'
dynamic cache holds it: 2 (keys, values) x the key/value rows of every layer x the element size, per token.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from taylor_tune.config import SpeedSpec


def _seconds(device: torch.device, run: Callable[[], object]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1000
    start_s = time.perf_counter()
    run()
    return time.perf_counter() - start_s


def _median(spec: SpeedSpec, measure: Callable[[], float]) -> float:
    for _ in range(spec.warmup):
        measure()
    return statistics.median(measure() for _ in range(spec.repeats))


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def kv_cache_bytes(model: torch.nn.Module, tokens: int) -> int:
    """Bytes of the KV cache holding `tokens` tokens of one sequence."""
    size = next(model.parameters()).element_size()
    rows = sum(layer.self_attn.k_proj.out_features + layer.self_attn.v_proj.out_features
               for layer in model.model.layers)  # Llama, Qwen2, Mistral; pruned or not
    return rows * size * tokens


SPEED_FIELDS = ("prefill_tokens_per_s", "decode_tokens_per_s", "decode_batch_tokens_per_s", "weight_bytes",
                "kv_cache_bytes")


def checked_speed(record: object) -> dict[str, float]:
    """A stored `measure_speed` result, checked before it is used as a baseline: every field present, a finite
    positive number (ValueError naming the first that is not)."""
    if not isinstance(record, dict):
        raise ValueError(f"a speed record is a mapping, not {type(record).__name__}")
    for field in SPEED_FIELDS:
        value = record.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"speed record: {field} is {str(value)[:40]!r}, not a finite positive number")
    return {field: record[field] for field in SPEED_FIELDS}


@torch.no_grad()
def measure_speed(model: torch.nn.Module, spec: SpeedSpec, *, seed: int = 0) -> dict[str, float]:
    """prefill_tokens_per_s, decode_tokens_per_s (batch 1), decode_batch_tokens_per_s (spec.decode_batch),
    weight_bytes and kv_cache_bytes (at spec.context)."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)

    def ids(batch: int, length: int) -> torch.Tensor:
        return torch.randint(0, model.config.vocab_size, (batch, length), generator=generator).to(device)

    prefill_ids = ids(spec.prefill_batch, spec.prefill_len)
    prefill_s = _median(spec, lambda: _seconds(device, lambda: model(input_ids=prefill_ids, use_cache=False)))

    def decode_seconds(prompt: torch.Tensor) -> float:
        out = model(input_ids=prompt, use_cache=True)
        state = {"cache": out.past_key_values, "token": out.logits[:, -1:].argmax(-1)}

        def steps() -> None:
            for _ in range(spec.new_tokens):
                step = model(input_ids=state["token"], past_key_values=state["cache"], use_cache=True)
                state["cache"], state["token"] = step.past_key_values, step.logits[:, -1:].argmax(-1)

        return _seconds(device, steps)

    rates = {}
    for key, batch in (("decode_tokens_per_s", 1), ("decode_batch_tokens_per_s", spec.decode_batch)):
        prompt = ids(batch, spec.prompt_len)
        rates[key] = batch * spec.new_tokens / _median(spec, lambda prompt=prompt: decode_seconds(prompt))
    return {"prefill_tokens_per_s": spec.prefill_batch * spec.prefill_len / prefill_s, **rates,
            "weight_bytes": weight_bytes(model), "kv_cache_bytes": kv_cache_bytes(model, spec.context)}


def speed_ratios(pruned: dict[str, float], unpruned: dict[str, float]) -> dict[str, float]:
    """The pruned model against the unpruned one: speedups (> 1 = faster) and the memory ratio (< 1 = smaller) of
    weights plus the KV cache at the stated context."""
    return {
        "prefill_speedup": pruned["prefill_tokens_per_s"] / unpruned["prefill_tokens_per_s"],
        "decode_speedup": pruned["decode_tokens_per_s"] / unpruned["decode_tokens_per_s"],
        "decode_batch_speedup": pruned["decode_batch_tokens_per_s"] / unpruned["decode_batch_tokens_per_s"],
        "memory_ratio": (pruned["weight_bytes"] + pruned["kv_cache_bytes"])
        / (unpruned["weight_bytes"] + unpruned["kv_cache_bytes"]),
    }
