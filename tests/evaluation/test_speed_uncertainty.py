"""Every speed carries its uncertainty (issue 40): the standard error of a median of repeated timings against a
numpy recomputation of the stated estimator, its propagation to rates and to speedups against the delta method
written out, the stored baseline's check, and the Pareto point's `_se` built from it."""

import math

import numpy as np
import pandas as pd
import pytest

from taylor_tune.config import SpeedSpec
from taylor_tune.evaluation.speed import RATES, checked_speed, measure_speed, median_and_se, speed_ratios
from taylor_tune.reporting import pareto
from taylor_tune.reporting.stats import Objective
from tests.helpers import tiny


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_the_median_s_standard_error_is_the_stated_mad_estimator(n):
    rng = np.random.default_rng(n)
    for _ in range(20):
        times = list(rng.lognormal(-3, 0.3, n))
        middle, se = median_and_se(times)
        mad = np.median(np.abs(np.array(times) - np.median(times)))
        assert middle == pytest.approx(np.median(times))
        assert se == pytest.approx(1.2533 * 1.4826 * mad / math.sqrt(n))
    assert median_and_se([0.5]) == (0.5, None)  # one run: no spread to estimate
    assert median_and_se([0.2, 0.2, 0.2])[1] == 0.0


def test_a_measurement_has_every_rate_s_error_and_the_speedups_carry_both():
    model = tiny("tiny-llama")
    spec = SpeedSpec(prefill_batch=1, prefill_len=16, decode_batch=2, prompt_len=4, new_tokens=3, repeats=4,
                     warmup=1)
    a, b = measure_speed(model, spec), measure_speed(model, spec, seed=1)
    for rate in RATES:
        assert a[f"{rate}_se"] is not None and 0 <= a[f"{rate}_se"] < a[rate]
    ratios = speed_ratios(a, b)
    for speedup, rate in (("prefill_speedup", "prefill_tokens_per_s"), ("decode_speedup", "decode_tokens_per_s"),
                          ("decode_batch_speedup", "decode_batch_tokens_per_s")):
        r = a[rate] / b[rate]
        delta = r * math.sqrt((a[f"{rate}_se"] / a[rate]) ** 2 + (b[f"{rate}_se"] / b[rate]) ** 2)
        assert ratios[speedup] == pytest.approx(r) and ratios[f"{speedup}_se"] == pytest.approx(delta)
    assert ratios["memory_ratio_se"] == 0.0
    once = measure_speed(model, spec.model_copy(update={"repeats": 1}))
    assert all(once[f"{rate}_se"] is None for rate in RATES)
    assert speed_ratios(once, b)["decode_speedup_se"] is None  # unknown on one side: unknown
    # a stored baseline keeps its errors; an older one without them still serves, a bad one is refused
    assert checked_speed(a) == a
    older = {k: v for k, v in a.items() if not k.endswith("_se")}
    assert checked_speed(older) == older
    with pytest.raises(ValueError, match="decode_tokens_per_s_se"):
        checked_speed(a | {"decode_tokens_per_s_se": -1.0})


def test_a_pareto_point_s_speed_error_combines_the_seeds_and_the_timing():
    rows = pd.DataFrame([
        {"trial_id": "a0", "model": "m", "pruning_method": "taylor", "seed": 0, "acc_mean": 0.5,
         "decode_speedup": 1.30, "decode_speedup_se": 0.03},
        {"trial_id": "a1", "model": "m", "pruning_method": "taylor", "seed": 1, "acc_mean": 0.52,
         "decode_speedup": 1.40, "decode_speedup_se": 0.04},
        {"trial_id": "b0", "model": "m", "pruning_method": "random", "seed": 0, "acc_mean": 0.4,
         "decode_speedup": 1.25, "decode_speedup_se": 0.05},
    ])
    table = pareto.configurations(rows, ["decode_speedup"]).set_index("point")
    seeds = np.std([1.30, 1.40], ddof=1) / math.sqrt(2)
    timing = math.sqrt((0.03**2 + 0.04**2) / 2)
    assert table.loc["a0", "decode_speedup_se"] == pytest.approx(math.hypot(seeds, timing))
    assert table.loc["b0", "decode_speedup_se"] == pytest.approx(0.05)  # one seed: the timing's alone
    front = pareto.pareto_front(rows, (Objective("acc_mean", "max"), Objective("decode_speedup", "max")))
    assert front.set_index("point").loc["b0", "decode_speedup_se"] == pytest.approx(0.05)


@pytest.mark.parametrize("warmup, repeats", [(0, 1), (2, 3)])
def test_the_rates_count_the_work_each_timed_forward_does(monkeypatch, warmup, repeats):
    # A clock that advances by the tokens each forward processes: every rate is then exactly 1 token per second if
    # (and only if) the measurement counts the work it times, and the forwards it makes are logged against the
    # sequence written out by hand: untimed prompts, greedy steps that feed the argmax back with the growing cache.
    import torch

    from taylor_tune.evaluation import speed

    model = tiny("tiny-llama")
    clock, log = {"t": 0.0}, []
    monkeypatch.setattr(speed.time, "perf_counter", lambda: clock["t"])

    def before(module, args, kwargs):
        ids, cache = kwargs["input_ids"], kwargs.get("past_key_values")
        log.append((tuple(ids.shape), 0 if cache is None else cache.get_seq_length(), kwargs.get("use_cache"), ids))
        clock["t"] += ids.numel()

    def after(module, args, kwargs, output):
        log[-1] = (*log[-1], output.logits[:, -1:].argmax(-1))

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)
    spec = SpeedSpec(prefill_batch=2, prefill_len=12, decode_batch=3, prompt_len=5, new_tokens=4, repeats=repeats,
                     warmup=warmup)
    got = measure_speed(model, spec)
    for rate in RATES:
        assert got[rate] == 1.0 and got[f"{rate}_se"] == (None if repeats == 1 else 0.0)
    runs = warmup + repeats
    expected = [((2, 12), 0, False)] * runs
    for batch in (1, 3):
        expected += [((batch, 5), 0, True), *[((batch, 1), 5 + i, True) for i in range(4)]] * runs
    assert [entry[:3] for entry in log] == expected
    for previous, step in zip(log, log[1:]):
        if step[0][1] == 1:  # a decode step reads the token its predecessor chose
            assert torch.equal(step[3], previous[4])


@pytest.mark.parametrize("work, seconds, se", [(64, 0.5, 0.01), (3, 2.0, 0.3), (1000, 0.02, 0.0)])
def test_a_rates_error_is_the_delta_method_taken_numerically(work, seconds, se):
    from taylor_tune.evaluation.speed import _rate

    rate, rate_se = _rate(work, (seconds, se))
    h = seconds * 1e-6
    slope = (work / (seconds + h) - work / (seconds - h)) / (2 * h)  # d(work / t) / dt at t = seconds
    assert rate == pytest.approx(work / seconds) and rate_se == pytest.approx(abs(slope) * se, rel=1e-6, abs=1e-12)
    assert _rate(work, (seconds, None)) == (work / seconds, None)


def test_on_cuda_a_run_is_timed_by_events_between_synchronizations(monkeypatch):
    # the GPU path on this CPU: events and synchronize stand in for the device's, a clock the run advances
    import torch

    from taylor_tune.evaluation import speed

    clock, log = {"ms": 0.0}, []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            self.at = clock["ms"]
            log.append("record")

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(f"sync {device}"))
    monkeypatch.setattr(speed.time, "perf_counter", lambda: pytest.fail("the wall clock times a CUDA run"))

    def run():
        log.append("run")
        clock["ms"] += 250.0

    assert speed._seconds(torch.device("cuda", 0), run) == 0.25
    assert log == ["sync cuda:0", "record", "run", "record", "sync cuda:0"]


def test_on_the_cpu_a_run_is_timed_by_the_wall_clock(monkeypatch):
    import torch

    from taylor_tune.evaluation import speed

    ticks = iter([10.0, 10.75])
    monkeypatch.setattr(speed.time, "perf_counter", lambda: next(ticks))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("a CPU run synchronizes CUDA"))
    assert speed._seconds(torch.device("cpu"), lambda: None) == 0.75


GOOD = {"prefill_tokens_per_s": 0.5, "decode_tokens_per_s": 3, "decode_batch_tokens_per_s": 12.0,
        "weight_bytes": 1024, "kv_cache_bytes": 64}


@pytest.mark.parametrize("value", [0, 0.0, -1.0, True, "fast", None, math.inf, math.nan])
def test_a_stored_rate_must_be_a_finite_positive_number(value):
    assert checked_speed(GOOD) == GOOD  # slow rates (half a token a second) are rates
    with pytest.raises(ValueError, match="^speed record: decode_tokens_per_s is .*, not a finite positive number$"):
        checked_speed(GOOD | {"decode_tokens_per_s": value})


@pytest.mark.parametrize("error", [None, 0.0, 0.5, 2])
def test_a_stored_rates_error_may_be_unknown_zero_or_any_finite_positive_number(error):
    assert checked_speed(GOOD | {"prefill_tokens_per_s_se": error})["prefill_tokens_per_s_se"] == error


@pytest.mark.parametrize("error", [-0.1, True, "x", math.inf, math.nan])
def test_a_stored_rates_error_that_is_no_number_or_negative_is_refused(error):
    with pytest.raises(ValueError, match="^speed record: prefill_tokens_per_s_se is .*, not a finite number >= 0 or "
                                         "null$"):
        checked_speed(GOOD | {"prefill_tokens_per_s_se": error})


def test_a_refused_value_is_shown_cut_to_40_characters():
    long = "x" * 100
    for field in ("weight_bytes", "decode_tokens_per_s_se"):
        with pytest.raises(ValueError) as refused:
            checked_speed(GOOD | {field: long})
        assert f"{field} is {'x' * 40!r}, not" in str(refused.value)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_bytes_are_every_parameters_and_buffers_bytes(dtype):
    import torch

    from taylor_tune.evaluation.speed import weight_bytes
    from taylor_tune.sources.models import load_model

    model = load_model("tiny-llama", device="cpu", dtype=getattr(torch, dtype))
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # a tied weight counts once
    assert weight_bytes(model) == sum(t.nbytes for t in tensors.values())
