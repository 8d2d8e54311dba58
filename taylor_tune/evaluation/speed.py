"""What a model costs to run, measured on its own device: prefill and decode throughput, weight and KV-cache memory.

Random token ids (the cost of a forward does not depend on which tokens), no padding. Decode is greedy with the KV
cache, one token per step, timed after an untimed prompt prefill. On CUDA each run is bracketed by CUDA events after
a synchronize; elsewhere by the wall clock. The KV cache's bytes at a context are its exact size as transformers'
dynamic cache holds it: 2 (keys, values) x the key/value rows of every layer x the element size, per token.

Every timing carries its uncertainty: the standard error of the median of the `repeats` runs, estimated as a normal
sample's, 1.2533 x 1.4826 x MAD / sqrt(repeats) (MAD: the median absolute deviation from the median; robust to the
one slow run a shared machine gives), carried to a rate by its relative size (`<rate>_se`) and to a speedup by
the delta method, sqrt of the sum of both rates' squared relative errors (`<speedup>_se`). With one repeat it is
unknown (None). Memory is counted, not timed: its ratio's error is 0.
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


def median_and_se(times: list[float]) -> tuple[float, float | None]:
    """The median of repeated timings and its standard error (the module docstring's estimator; None for one)."""
    middle = statistics.median(times)
    if len(times) < 2:
        return middle, None
    mad = statistics.median(abs(t - middle) for t in times)
    return middle, 1.2533 * 1.4826 * mad / math.sqrt(len(times))


def _median(spec: SpeedSpec, measure: Callable[[], float]) -> tuple[float, float | None]:
    for _ in range(spec.warmup):
        measure()
    return median_and_se([measure() for _ in range(spec.repeats)])


def _rate(work: float, timed: tuple[float, float | None]) -> tuple[float, float | None]:
    seconds, se = timed
    rate = work / seconds
    return rate, None if se is None else rate * se / seconds


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
RATES = SPEED_FIELDS[:3]
SPEEDUPS = {"prefill_speedup": "prefill_tokens_per_s", "decode_speedup": "decode_tokens_per_s",
            "decode_batch_speedup": "decode_batch_tokens_per_s"}


def checked_speed(record: object) -> dict[str, float]:
    """A stored `measure_speed` result, checked before it is used as a baseline: every field present, a finite
    positive number, and each rate's `_se` (when the record has one: older ones do not) None or finite and not
    negative (ValueError naming the first that is not)."""
    if not isinstance(record, dict):
        raise ValueError(f"a speed record is a mapping, not {type(record).__name__}")
    for field in SPEED_FIELDS:
        value = record.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"speed record: {field} is {str(value)[:40]!r}, not a finite positive number")
    errors = {}
    for field in (f"{rate}_se" for rate in RATES if f"{rate}_se" in record):
        value = record[field]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < 0):
            raise ValueError(f"speed record: {field} is {str(value)[:40]!r}, not a finite number >= 0 or null")
        errors[field] = value
    return {field: record[field] for field in SPEED_FIELDS} | errors


@torch.no_grad()
def measure_speed(model: torch.nn.Module, spec: SpeedSpec, *, seed: int = 0) -> dict[str, float]:
    """prefill_tokens_per_s, decode_tokens_per_s (batch 1), decode_batch_tokens_per_s (spec.decode_batch), each
    with its `_se`, weight_bytes and kv_cache_bytes (at spec.context)."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)

    def ids(batch: int, length: int) -> torch.Tensor:
        return torch.randint(0, model.config.vocab_size, (batch, length), generator=generator).to(device)

    prefill_ids = ids(spec.prefill_batch, spec.prefill_len)
    prefill = _rate(spec.prefill_batch * spec.prefill_len,
                    _median(spec, lambda: _seconds(device, lambda: model(input_ids=prefill_ids, use_cache=False))))

    def decode_seconds(prompt: torch.Tensor) -> float:
        out = model(input_ids=prompt, use_cache=True)
        state = {"cache": out.past_key_values, "token": out.logits[:, -1:].argmax(-1)}

        def steps() -> None:
            for _ in range(spec.new_tokens):
                step = model(input_ids=state["token"], past_key_values=state["cache"], use_cache=True)
                state["cache"], state["token"] = step.past_key_values, step.logits[:, -1:].argmax(-1)

        return _seconds(device, steps)

    rates = {"prefill_tokens_per_s": prefill}
    for key, batch in (("decode_tokens_per_s", 1), ("decode_batch_tokens_per_s", spec.decode_batch)):
        prompt = ids(batch, spec.prompt_len)
        rates[key] = _rate(batch * spec.new_tokens, _median(spec, lambda prompt=prompt: decode_seconds(prompt)))
    return {**{k: v for k, (v, _) in rates.items()}, **{f"{k}_se": se for k, (_, se) in rates.items()},
            "weight_bytes": weight_bytes(model), "kv_cache_bytes": kv_cache_bytes(model, spec.context)}


def speed_ratios(pruned: dict[str, float], unpruned: dict[str, float]) -> dict[str, float | None]:
    """The pruned model against the unpruned one: speedups (> 1 = faster) with their `_se` (None where either
    rate's is unknown) and the memory ratio (< 1 = smaller) of weights plus the KV cache at the stated context."""
    out: dict[str, float | None] = {}
    for speedup, rate in SPEEDUPS.items():
        out[speedup] = ratio = pruned[rate] / unpruned[rate]
        errors = pruned.get(f"{rate}_se"), unpruned.get(f"{rate}_se")
        out[f"{speedup}_se"] = None if None in errors else ratio * math.hypot(errors[0] / pruned[rate],
                                                                              errors[1] / unpruned[rate])
    return out | {"memory_ratio": (pruned["weight_bytes"] + pruned["kv_cache_bytes"])
                  / (unpruned["weight_bytes"] + unpruned["kv_cache_bytes"]), "memory_ratio_se": 0.0}
