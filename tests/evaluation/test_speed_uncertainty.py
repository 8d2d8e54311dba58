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
