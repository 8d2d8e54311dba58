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
    errors = {field: _error(record, field) for field in (f"{rate}_se" for rate in RATES) if field in record}
    return {field: record[field] for field in SPEED_FIELDS} | errors


def _error(record: dict, field: str) -> float | None:
    """A stored uncertainty: None (unknown) or a finite number >= 0 (ValueError otherwise, or when missing)."""
    if field not in record:
        raise ValueError(f"speed record: {field} is missing")
    value = record[field]
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value < 0):
        raise ValueError(f"speed record: {field} is {str(value)[:40]!r}, not a finite number >= 0 or null")
    return value


def _timings(model: torch.nn.Module, spec: SpeedSpec, seed: int) -> dict[str, tuple[int, Callable[[], float]]]:
    """Each rate's work (tokens) and a function timing one run of it, on inputs drawn from `seed` (the same inputs
    for every model of one vocabulary)."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)

    def ids(batch: int, length: int) -> torch.Tensor:
        return torch.randint(0, model.config.vocab_size, (batch, length), generator=generator).to(device)

    prefill_ids = ids(spec.prefill_batch, spec.prefill_len)

    def decode_seconds(prompt: torch.Tensor) -> float:
        out = model(input_ids=prompt, use_cache=True)
        state = {"cache": out.past_key_values, "token": out.logits[:, -1:].argmax(-1)}

        def steps() -> None:
            for _ in range(spec.new_tokens):
                step = model(input_ids=state["token"], past_key_values=state["cache"], use_cache=True)
                state["cache"], state["token"] = step.past_key_values, step.logits[:, -1:].argmax(-1)

        return _seconds(device, steps)

    timings = {"prefill_tokens_per_s": (spec.prefill_batch * spec.prefill_len, lambda: _seconds(
        device, lambda: model(input_ids=prefill_ids, use_cache=False)))}
    for key, batch in (("decode_tokens_per_s", 1), ("decode_batch_tokens_per_s", spec.decode_batch)):
        prompt = ids(batch, spec.prompt_len)
        timings[key] = (batch * spec.new_tokens, lambda prompt=prompt: decode_seconds(prompt))
    return timings


def _sizes(model: torch.nn.Module, spec: SpeedSpec) -> dict[str, int]:
    return {"weight_bytes": weight_bytes(model), "kv_cache_bytes": kv_cache_bytes(model, spec.context)}


@torch.no_grad()
def measure_speed(model: torch.nn.Module, spec: SpeedSpec, *, seed: int = 0) -> dict[str, float]:
    """prefill_tokens_per_s, decode_tokens_per_s (batch 1), decode_batch_tokens_per_s (spec.decode_batch), each
    with its `_se`, weight_bytes and kv_cache_bytes (at spec.context)."""
    rates = {key: _rate(work, _median(spec, run)) for key, (work, run) in _timings(model, spec, seed).items()}
    return {**{k: v for k, (v, _) in rates.items()}, **{f"{k}_se": se for k, (_, se) in rates.items()},
            **_sizes(model, spec)}


# The two-sided level of a paired speedup's interval (`<speedup>_low`, `<speedup>_high`)
PAIRED_LEVEL = 0.95


def paired_ratio(baseline_seconds: list[float], seconds: list[float],
                 level: float = PAIRED_LEVEL) -> tuple[float, float | None, float | None, float | None]:
    """The speedup of timed pairs (the baseline's seconds over the model's, run by run): the geometric mean of the
    pairs' ratios, its standard error (delta method: ratio x the standard error of the mean log ratio) and its
    `level` interval (Student's t on the log ratios, pairs - 1 degrees of freedom); None for one pair."""
    from scipy import stats  # only here: the rest of the module is torch's

    logs = [math.log(b / m) for b, m in zip(baseline_seconds, seconds, strict=True)]
    ratio = math.exp(statistics.fmean(logs))
    if len(logs) < 2:
        return ratio, None, None, None
    se = statistics.stdev(logs) / math.sqrt(len(logs))
    half = float(stats.t.ppf(0.5 + level / 2, len(logs) - 1)) * se
    return ratio, ratio * se, ratio * math.exp(-half), ratio * math.exp(half)


@torch.no_grad()
def measure_paired(model: torch.nn.Module, baseline: torch.nn.Module, spec: SpeedSpec, *,
                   seed: int = 0) -> dict[str, float | None]:
    """`model` (the pruned one) and `baseline` (the unpruned one, on the same device) timed in turn in one window, on
    the same inputs: for each rate, `warmup` untimed runs of each, then `repeats` pairs, the order alternating (A B,
    B A, ...) so that a change of load between the two runs of a pair weighs on both orders alike. Each pair's ratio
    of times is one sample of the speedup (`paired_ratio`): a load that slows both runs of a pair cancels out.
    Returns measure_speed's fields for the model, the same for the baseline under `unpruned_`, and per speedup its
    value, `_se`, `_low` and `_high`, `memory_ratio` (counted: `_se` 0), `speed_pairs`."""
    ours, theirs = _timings(model, spec, seed), _timings(baseline, spec, seed)
    out: dict[str, float | None] = {}
    for speedup, key in SPEEDUPS.items():
        (work, run), other = ours[key], theirs[key][1]
        for _ in range(spec.warmup):
            run(), other()
        times, base = [], []
        for pair in range(spec.repeats):
            if pair % 2:
                base.append(other())
                times.append(run())
            else:
                times.append(run())
                base.append(other())
        for prefix, seconds in (("", times), ("unpruned_", base)):
            out[prefix + key], out[f"{prefix}{key}_se"] = _rate(work, median_and_se(seconds))
        ratio, se, low, high = paired_ratio(base, times)
        out |= {speedup: ratio, f"{speedup}_se": se, f"{speedup}_low": low, f"{speedup}_high": high}
    sizes, baseline_sizes = _sizes(model, spec), _sizes(baseline, spec)
    memory = sum(sizes.values()) / sum(baseline_sizes.values())
    return (out | sizes | {f"unpruned_{k}": v for k, v in baseline_sizes.items()}
            | {"memory_ratio": memory, "memory_ratio_se": 0.0, "speed_pairs": spec.repeats})


# A speedup beyond this factor either way is read as a damaged record, not a measurement: no structured pruning the
# tool allows makes a model twenty times faster or slower
PLAUSIBLE_SPEEDUP = 20.0
# The ratio of the two models' median rates and the pairs' speedup are two summaries of the same timed runs: apart by
# more than this factor, a rate was not measured with the pairs (an edited or damaged record)
RATES_AGREE = 3.0
ONE_PAIR_AGREES = 1 + 1e-9


def checked_paired(record: object) -> dict[str, float | None]:
    """A stored `measure_paired` result, checked before it is reused: both models' fields as `checked_speed` checks
    them, each speedup a finite number within PLAUSIBLE_SPEEDUP of 1 either way and within RATES_AGREE of the ratio
    of the two models' rates, its `_se`, `_low` and `_high` None or finite and not negative (ValueError naming the
    first that is not)."""
    if not isinstance(record, dict):
        raise ValueError(f"a speed record is a mapping, not {type(record).__name__}")
    checked = checked_speed(record) | {f"unpruned_{k}": v for k, v in checked_speed(
        {k.removeprefix("unpruned_"): v for k, v in record.items() if k.startswith("unpruned_")}).items()}
    pairs = record.get("speed_pairs")
    if isinstance(pairs, bool) or not isinstance(pairs, int) or pairs < 1:
        raise ValueError(f"speed record: speed_pairs is {str(pairs)[:40]!r}, not a positive count")
    # one pair: its ratio of times is the ratio of the two rates, to rounding; any other gap is damage
    agree = ONE_PAIR_AGREES if pairs == 1 else RATES_AGREE
    for speedup in SPEEDUPS:
        value = record.get(speedup)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                1 / PLAUSIBLE_SPEEDUP <= value <= PLAUSIBLE_SPEEDUP):
            raise ValueError(f"speed record: {speedup} is {str(value)[:40]!r}, not a speedup within "
                             f"{PLAUSIBLE_SPEEDUP:g}x of 1")
        checked[speedup] = value
        checked |= {speedup + part: _error(record, speedup + part) for part in ("_se", "_low", "_high")}
        rate = SPEEDUPS[speedup]
        rates = checked[rate] / checked[f"unpruned_{rate}"]
        if not 1 / agree <= rates / value <= agree:
            raise ValueError(f"speed record: {rate} {checked[rate]:.4g} against unpruned_{rate} "
                             f"{checked[f'unpruned_{rate}']:.4g} is {rates:.3g}x, but its pairs measured "
                             f"{speedup} {value:.3g}x: not one measurement")
    memory = record.get("memory_ratio")
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not 0 < memory <= PLAUSIBLE_SPEEDUP:
        raise ValueError(f"speed record: memory_ratio is {str(memory)[:40]!r}, not a positive ratio")
    return checked | {"memory_ratio": memory, "memory_ratio_se": 0.0, "speed_pairs": pairs}


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
