"""Properties of the core against independent references, for inputs Hypothesis draws (issue 43, build 3): each
property runs with few examples in the fast tier and many in the slow tier (the same body).

- the Pareto dominance relation against its definition written as a loop, for points with ties;
- the normal and Wilson intervals against scipy, acc_mean's stderr against a loop;
- the importance cache's key changes with every field;
- every global-ranking plan meets its target with an overshoot under one group, for any layout and sparsity;
- the uniform layout's MLP width against an enumeration of every allowed width's removal, in exact arithmetic;
- perplexity's token count and value against an unbatched loop over windows;
- the prefix scorer's packed, chunked scoring against one forward per request, the log-softmax split anywhere.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

FEW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MANY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def both_tiers(strategy_kwargs: dict, *, many: settings = MANY):
    """The decorated property as two tests: a few examples (fast tier) and many (slow tier)."""
    def wrap(body):
        fast = FEW(given(**strategy_kwargs)(body))
        slow = many(given(**strategy_kwargs)(body))

        def fast_test(**kw):
            fast(**kw)

        def slow_test(**kw):
            slow(**kw)
        fast_test.__name__, slow_test.__name__ = f"test_{body.__name__}", f"test_{body.__name__}_many"
        fast_test.__doc__ = slow_test.__doc__ = body.__doc__
        return fast_test, pytest.mark.slow(slow_test)
    return wrap


# --- Pareto dominance -------------------------------------------------------------------------------------------

points = st.integers(1, 3).flatmap(lambda k: st.tuples(
    st.lists(st.lists(st.integers(0, 4), min_size=k, max_size=k), min_size=1, max_size=12),  # small ints: ties
    st.lists(st.sampled_from(["max", "min"]), min_size=k, max_size=k)))


def dominance_by_definition(data):
    """The Pareto dominance relation (and the front) against its definition written as a loop: i dominates j when it
    is at least as good in every objective and strictly better in one."""
    from taylor_tune.reporting.pareto import dominance
    from taylor_tune.reporting.stats import Objective

    values, modes = data
    objectives = tuple(Objective(f"m{i}", mode) for i, mode in enumerate(modes))
    dom = dominance(np.array(values, dtype=float), objectives)
    good = [[v if mode == "max" else -v for v, mode in zip(row, modes)] for row in values]
    for i, a in enumerate(good):
        for j, b in enumerate(good):
            expected = all(x >= y for x, y in zip(a, b)) and any(x > y for x, y in zip(a, b))
            assert bool(dom[i, j]) == expected
    front = [j for j in range(len(good)) if not any(dom[i, j] for i in range(len(good)))]
    assert front  # a finite set always has a front


test_dominance_by_definition, test_dominance_by_definition_many = both_tiers({"data": points})(
    dominance_by_definition)


# --- intervals and stderr ---------------------------------------------------------------------------------------

def intervals_against_scipy(n, k, se, z):
    """Wilson's interval against scipy's binomtest (method wilson), the normal interval against scipy's norm, both
    clipped to [0, 1]."""
    from taylor_tune.reporting.stats import confidence_interval, wilson_interval

    k = min(k, n)
    low, high = wilson_interval(k / n, n, z)
    level = 2 * scipy_stats.norm.cdf(z) - 1
    ref = scipy_stats.binomtest(k, n).proportion_ci(confidence_level=level, method="wilson")
    assert low == pytest.approx(max(0.0, ref.low), abs=1e-9) and high == pytest.approx(min(1.0, ref.high), abs=1e-9)
    value = k / n
    a, b = scipy_stats.norm.interval(level, loc=value, scale=se) if se > 0 else (value, value)
    assert confidence_interval(value, se, z) == pytest.approx((max(0.0, a), min(1.0, b)), abs=1e-9)


test_intervals_against_scipy, test_intervals_against_scipy_many = both_tiers(
    {"n": st.integers(1, 5000), "k": st.integers(0, 5000), "se": st.floats(0, 0.3), "z": st.floats(0.5, 3.5)})(
    intervals_against_scipy)


def acc_mean_stderr_by_loop(stderrs):
    """acc_mean's stderr (the tasks' stderrs as independent) against sqrt(sum of squares) / count, by a loop."""
    import pandas as pd

    from taylor_tune.reporting.stats import acc_mean_stderr

    tasks = tuple(f"t{i}" for i in range(len(stderrs)))
    row = pd.DataFrame([{f"acc_{t}_stderr": s for t, s in zip(tasks, stderrs)}])
    total = 0.0
    for s in stderrs:
        total += s * s
    assert float(acc_mean_stderr(row, tasks).iloc[0]) == pytest.approx(math.sqrt(total) / len(stderrs), rel=1e-12)


test_acc_mean_stderr_by_loop, test_acc_mean_stderr_by_loop_many = both_tiers(
    {"stderrs": st.lists(st.floats(0, 0.1), min_size=1, max_size=7)})(acc_mean_stderr_by_loop)


# --- the importance cache's key ---------------------------------------------------------------------------------

field_values = st.one_of(st.integers(-5, 10**6), st.text(max_size=12), st.booleans(), st.floats(allow_nan=False))


def cache_key_changes_with_each_field(fields, which, new):
    """Changing any one field of a cache key's fields to a value that reads differently as JSON (what the key
    digests: 1 and 1.0 and true are three values) changes the key."""
    from taylor_tune.pruning.importance_cache import cache_key

    name = sorted(fields)[which % len(fields)]
    assume(json.dumps(new) != json.dumps(fields[name]))
    assert cache_key(**fields) != cache_key(**(fields | {name: new}))


test_cache_key_changes_with_each_field, test_cache_key_changes_with_each_field_many = both_tiers(
    {"fields": st.dictionaries(st.sampled_from(["model", "calibration", "seq_len", "seed", "dtype", "device",
                                                "micro_batch_size", "counts"]), field_values, min_size=1),
     "which": st.integers(0, 100), "new": field_values})(cache_key_changes_with_each_field)


# --- plans meet their target ------------------------------------------------------------------------------------

@st.composite
def layouts(draw):
    from taylor_tune.pruning.plan import ModelLayout

    layers = draw(st.integers(1, 6))
    attn = tuple(draw(st.lists(st.integers(1, 8), min_size=layers, max_size=layers)))
    mlp = tuple(draw(st.lists(st.integers(1, 48), min_size=layers, max_size=layers)))
    attn_params, mlp_params = draw(st.integers(1, 400)), draw(st.integers(1, 60))
    layer_params = tuple(a * attn_params + m * mlp_params + draw(st.integers(0, 50)) for a, m in zip(attn, mlp))
    total = sum(layer_params) + draw(st.integers(0, 5000))
    return ModelLayout(attn, mlp, attn_params, mlp_params, layer_params, total)


def global_plans_meet_their_target(layout, sparsity, seed, method, attention):
    """taylor (a global ranking of any scores), magnitude's and random's plans remove at least the target and less
    than one group more, never a block's last group; or say they cannot (PlanError) only when even every removable
    group falls short. Without attention (the servable layout) no attention group goes, and the MLP channels alone
    reach the target or the plan says it cannot."""
    from taylor_tune.errors import PlanError
    from taylor_tune.pruning.methods._base import PlanOptions, plan_global
    from taylor_tune.pruning.methods.random import drawn_scores
    from taylor_tune.pruning.plan import target_params

    scores = drawn_scores(layout, seed)
    target = target_params(layout, sparsity)
    removable = sum((a - 1) * layout.attn_group_params * attention + (m - 1) * layout.mlp_channel_params
                    for a, m in zip(layout.attn_groups, layout.mlp_channels))
    options = PlanOptions(sparsity=sparsity, layerwise_max_ratio=0.5, blockwise_layer_start=None,
                          blockwise_layer_end=None, blockwise_attention="mlp_only", criterion="taylor", seed=seed,
                          attention=attention)
    try:
        plan = plan_global(method, scores, layout, options)
    except PlanError:
        assert removable < target
        return
    removed = plan.params_removed(layout)
    largest = max(layout.attn_group_params * attention, layout.mlp_channel_params)
    assert target <= removed < target + largest
    for a, m, gone_a, gone_m in zip(layout.attn_groups, layout.mlp_channels, plan.attn_removed, plan.mlp_removed):
        assert len(gone_a) < a and len(gone_m) < m
        assert attention or not gone_a


test_global_plans_meet_their_target, test_global_plans_meet_their_target_many = both_tiers(
    {"layout": layouts(), "sparsity": st.floats(0.01, 0.9), "seed": st.integers(0, 1000),
     "method": st.sampled_from(["taylor", "magnitude", "random"]), "attention": st.booleans()}
)(global_plans_meet_their_target)


@st.composite
def uniform_layouts(draw):
    """A layout whose layers all have one shape, with a multiple that fits its MLP."""
    from taylor_tune.pruning.plan import ModelLayout

    layers, groups, channels = draw(st.integers(1, 6)), draw(st.integers(1, 8)), draw(st.integers(1, 80))
    attn_params, mlp_params = draw(st.integers(1, 400)), draw(st.integers(1, 60))
    per_layer = groups * attn_params + channels * mlp_params + draw(st.integers(0, 50))
    total = per_layer * layers + draw(st.integers(0, 5000))
    layout = ModelLayout((groups,) * layers, (channels,) * layers, attn_params, mlp_params, (per_layer,) * layers,
                         total)
    return layout, draw(st.integers(1, channels)), draw(st.integers(0, groups - 1))


def uniform_width_by_enumeration(shaped, sparsity):
    """mlp_width against every width a layer may keep (a multiple of `multiple`, or the full width), each one's
    removal compared with the target in exact fractions: the nearest wins, ties the wider; None exactly when the
    target asks for less than half a multiple of channels."""
    from fractions import Fraction

    from taylor_tune.pruning.plan import target_params
    from taylor_tune.pruning.uniform import mlp_width

    layout, multiple, attn_removed = shaped
    n, c = layout.num_layers, layout.mlp_channels[0]
    target = Fraction(target_params(layout, sparsity))
    removal = {w: n * attn_removed * layout.attn_group_params + n * (c - w) * layout.mlp_channel_params
               for w in range(1, c + 1) if w % multiple == 0 or w == c}
    wanted = c - (target - n * attn_removed * layout.attn_group_params) / (n * layout.mlp_channel_params)
    got = mlp_width(layout, sparsity, multiple, attn_removed)
    if wanted < Fraction(multiple, 2):
        assert got is None
        return
    best = min(removal, key=lambda w: (abs(removal[w] - target), -w))
    assert got == best


test_uniform_width_by_enumeration, test_uniform_width_by_enumeration_many = both_tiers(
    {"shaped": uniform_layouts(), "sparsity": st.floats(0.0, 0.95)})(uniform_width_by_enumeration)


# --- perplexity -------------------------------------------------------------------------------------------------

_TINY = {}


def tiny_model():
    if not _TINY:
        from taylor_tune.sources.models import load_model, load_tokenizer

        _TINY["model"] = load_model("tiny-llama-random", device="cpu", dtype=torch.float64).eval()
        _TINY["tokenizer"] = load_tokenizer("tiny-llama-random")
    return _TINY["model"], _TINY["tokenizer"]


def perplexity_by_window_loop(length, window, max_windows, batch_size, seed):
    """perplexity's tokens and value against a loop over windows, one forward each (a float64 tiny model; perplexity
    takes its logits in float32: 1e-6 relative)."""
    from taylor_tune.evaluation.perplexity import perplexity

    model, tokenizer = tiny_model()
    rng = np.random.default_rng(seed)
    text = "".join(rng.choice(list("abcdefgh ij.\n"), size=length))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assume(len(ids) >= window)
    out = perplexity(model, tokenizer, text, window=window, batch_size=batch_size, max_windows=max_windows)
    nll, tokens, count = 0.0, 0, 0
    for start in range(0, len(ids) - window + 1, window):
        if max_windows is not None and count == max_windows:
            break
        chunk = torch.tensor([ids[start:start + window]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=chunk).logits[0, :-1].double(), dim=-1)
        for t in range(window - 1):
            nll -= float(logp[t, chunk[0, t + 1]])
            tokens += 1
        count += 1
    assert out["ppl_tokens"] == tokens and out["ppl_windows"] == count
    assert out["ppl"] == pytest.approx(math.exp(nll / tokens), rel=1e-6)  # its logits in float32


test_perplexity_by_window_loop, test_perplexity_by_window_loop_many = both_tiers(
    {"length": st.integers(4, 300), "window": st.integers(2, 40), "max_windows": st.none() | st.integers(1, 6),
     "batch_size": st.integers(1, 4), "seed": st.integers(0, 10**6)},
    many=settings(max_examples=60, deadline=None))(perplexity_by_window_loop)


# --- the prefix scorer: packed, batched, the log-softmax chunked ------------------------------------------------

requests_ = st.lists(st.tuples(st.lists(st.integers(3, 250), min_size=1, max_size=20),
                               st.lists(st.integers(3, 250), min_size=1, max_size=6)), min_size=1, max_size=8)


def prefix_scorer_by_one_forward_each(requests, chunk_rows, batch_size):
    """The prefix scorer (requests packed into rows, several per batch, the log-softmax split every `chunk_rows`
    scored positions, across request boundaries) against one forward per request: log-likelihood and greedy."""
    from taylor_tune.evaluation import scorer

    model, tokenizer = tiny_model()
    lm = scorer.make_lm(model, tokenizer, batch_size, "prefix")
    before = scorer.SOFTMAX_ELEMENTS
    try:
        scorer.SOFTMAX_ELEMENTS = chunk_rows * model.config.vocab_size
        answers = lm._loglikelihood_tokens([(None, c, t) for c, t in requests], disable_tqdm=True)
    finally:
        scorer.SOFTMAX_ELEMENTS = before
    for (context, continuation), (ll, greedy) in zip(requests, answers, strict=True):
        ids = torch.tensor([context + continuation[:-1]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)[len(context) - 1:]
        target = torch.tensor(continuation)
        expected = float(logp[torch.arange(len(continuation)), target].sum())
        assert ll == pytest.approx(expected, rel=1e-6, abs=2e-6 * len(continuation))  # a float32 log-softmax
        assert greedy == bool((logp.argmax(-1) == target).all())


test_prefix_scorer_by_one_forward_each, test_prefix_scorer_by_one_forward_each_many = both_tiers(
    {"requests": requests_, "chunk_rows": st.integers(1, 9), "batch_size": st.integers(1, 4)},
    many=settings(max_examples=80, deadline=None))(prefix_scorer_by_one_forward_each)
