"""Method semantics on hand-built layouts and scores (pure planning: no model, milliseconds)."""

import numpy as np
import pytest

from taylor_tune.config import PruneConfig
from taylor_tune.errors import PlanError
from taylor_tune.pruning.methods import METHODS, WIDTH_METHODS, PlanOptions, Scoring
from taylor_tune.pruning.methods.blockwise import plan_blockwise
from taylor_tune.pruning.methods.layerwise import allocate_layer_ratios, layer_importance, plan_layerwise
from taylor_tune.pruning.methods.taylor import plan_taylor
from taylor_tune.pruning.plan import GroupScores, ModelLayout, PrunePlan
from tests.helpers import equal_layers

G, C, A, M, NORMS = 8, 64, 50, 15, 10  # groups, channels, group sizes (MLP outweighs attention, as in LLMs), norms


def layout(layers: int = 8, embeddings: int = 500) -> ModelLayout:
    per_layer = G * A + C * M + NORMS
    return ModelLayout((G,) * layers, (C,) * layers, A, M, (per_layer,) * layers, per_layer * layers + embeddings)


def random_scores(lay: ModelLayout, seed: int, layer_scale=None) -> GroupScores:
    rng = np.random.default_rng(seed)
    scale = np.ones(lay.num_layers) if layer_scale is None else np.asarray(layer_scale)
    return GroupScores(tuple(rng.random(G) * s for s in scale), tuple(rng.random(C) * s for s in scale))


def options(sparsity=0.2, **kw) -> PlanOptions:
    """The options of a PruneConfig (its defaults), but the blockwise rule that measures a model: these tests have
    none."""
    kw.setdefault("blockwise_attention", "min_loss")
    loss = kw.pop("plan_loss", None)
    return PlanOptions.of(PruneConfig(model="tiny-llama", sparsity=sparsity, layerwise_max_ratio=kw.pop("cap", 0.4),
                                      **kw), plan_loss=loss)


@pytest.mark.parametrize("method", sorted(WIDTH_METHODS))
@pytest.mark.parametrize("sparsity", [0.05, 0.2, 0.3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_method_reaches_the_target_within_one_group(method, sparsity, seed):
    lay = layout()
    plan = METHODS[method].plan(random_scores(lay, seed), lay, options(sparsity, seed=seed))
    plan.validate(lay)
    removed, target = plan.params_removed(lay), sparsity * lay.total_params
    assert target <= removed < target + max(A, M)
    assert plan.method == method  # a plan (saved beside the model, named in its errors) says which method made it


def test_taylor_ranking_is_global_when_the_weakest_groups_sit_in_one_layer():
    lay = layout()
    base = random_scores(lay, 0)
    # every group of layer 5 scores in [0, 1e-3), every other group in [1, 2)
    shift = lambda l, s: s * 1e-3 if l == 5 else s + 1.0
    scores = GroupScores(
        tuple(shift(l, s) for l, s in enumerate(base.attn)), tuple(shift(l, s) for l, s in enumerate(base.mlp))
    )
    plan = plan_taylor(scores, lay, options(0.05))
    # 5% of the total fits inside layer 5 alone: a global ranking takes nothing from any other layer
    assert all(not plan.attn_removed[l] and not plan.mlp_removed[l] for l in range(lay.num_layers) if l != 5)
    assert plan.mlp_removed[5]
    # and within the model, every removed group scores below every kept one (brute force over all groups)
    removed = [scores.attn[l][i] for l, r in enumerate(plan.attn_removed) for i in r] + [
        scores.mlp[l][i] for l, r in enumerate(plan.mlp_removed) for i in r]
    kept = [s for l in range(lay.num_layers) for i, s in enumerate(scores.attn[l]) if i not in plan.attn_removed[l]] + [
        s for l in range(lay.num_layers) for i, s in enumerate(scores.mlp[l]) if i not in plan.mlp_removed[l]]
    assert max(removed) <= min(kept)


def test_taylor_never_empties_a_block_even_when_one_layer_is_worthless():
    lay = layout()
    scale = np.ones(lay.num_layers)
    scale[2] = 0.0
    plan = plan_taylor(random_scores(lay, 0, scale), lay, options(0.2))
    assert len(plan.attn_removed[2]) == G - 1 and len(plan.mlp_removed[2]) == C - 1


def test_blockwise_prunes_only_its_range_at_one_ratio():
    lay = layout()
    scores = random_scores(lay, 3)
    plan = plan_blockwise(scores, lay, options(0.2, blockwise_layer_start=2, blockwise_layer_end=6))
    inside, outside = range(2, 6), [0, 1, 6, 7]
    assert all(not plan.attn_removed[l] and not plan.mlp_removed[l] for l in outside)
    assert len({len(plan.attn_removed[l]) for l in inside}) == 1
    mlp_counts = [len(plan.mlp_removed[l]) for l in inside]
    assert max(mlp_counts) - min(mlp_counts) <= 1
    attn_ratio = len(plan.attn_removed[2]) / G
    # attention and MLP lose the same share up to half a step of the attention granularity
    assert abs(attn_ratio - np.mean(mlp_counts) / C) <= 0.5 / G + A / (2 * M * C)
    for l in inside:  # inside a block the lowest groups go
        k = len(plan.mlp_removed[l])
        assert set(plan.mlp_removed[l]) == set(np.argsort(scores.mlp[l], kind="stable")[:k].tolist())


def test_blockwise_default_range_keeps_first_and_last_layer():
    lay = layout()
    plan = plan_blockwise(random_scores(lay, 4), lay, options(0.2))
    for l in (0, lay.num_layers - 1):
        assert not plan.attn_removed[l] and not plan.mlp_removed[l]


@pytest.mark.parametrize("cap", [0.25, 0.3, 0.5])
def test_layerwise_never_exceeds_its_cap_and_prunes_weak_layers_more(cap):
    lay = layout()
    scale = np.linspace(0.2, 2.0, lay.num_layers)  # layer importance grows with depth
    scores = random_scores(lay, 5, scale)
    plan = plan_layerwise(scores, lay, options(0.2, cap=cap))
    ratios = [r / p for r, p in zip(plan.layer_params_removed(lay), lay.layer_params)]
    assert max(ratios) <= cap + 1e-12
    assert ratios[0] >= ratios[-1]


@pytest.mark.parametrize("scale", [1e-9, 0.3, 1.0, 1e4])  # real layer importances are gradient-sized: far below 1
def test_layerwise_allocation_is_water_filling_under_the_cap(scale):
    importance = np.array([1.0, 2.0, 4.0, 8.0]) * scale
    params = np.full(4, 100.0)
    ratios = allocate_layer_ratios(importance, params, target=80.0, cap=0.3)
    assert (ratios * params).sum() == pytest.approx(80.0)
    assert ratios.max() <= 0.3 + 1e-12
    uncapped = ratios < 0.3 - 1e-9  # below the cap, ratio x importance is one constant
    products = ratios[uncapped] * importance[uncapped]
    assert np.allclose(products, products[0])


def test_layer_importance_is_the_size_weighted_mean_score():
    lay = layout(layers=2)
    scores = random_scores(lay, 6)
    expected = (scores.attn[1].sum() * A + scores.mlp[1].sum() * M) / (G * A + C * M)
    assert layer_importance(scores, lay)[1] == pytest.approx(expected)


def test_random_is_seeded():
    lay = layout()
    a, b, c = (METHODS["random"].plan(None, lay, options(seed=s)) for s in (0, 0, 1))
    assert a == b and a != c


@pytest.mark.parametrize(
    "method, opts, match",
    [
        ("blockwise", dict(blockwise_layer_start=5, blockwise_layer_end=20), "layer range"),
        ("blockwise", dict(sparsity=0.6, blockwise_layer_start=3, blockwise_layer_end=5), "emptying a block"),
        ("layerwise", dict(sparsity=0.5, cap=0.2), "layerwise_max_ratio"),
        ("taylor", dict(sparsity=0.95), "emptying a block"),
    ],
)
def test_impossible_plans_raise_a_plan_error(method, opts, match):
    lay = layout()
    sparsity = opts.pop("sparsity", 0.2)
    with pytest.raises(PlanError, match=match):
        METHODS[method].plan(random_scores(lay, 0), lay, options(sparsity, **opts))


def test_validate_rejects_a_plan_that_empties_a_block():
    lay = layout(layers=2)
    plan = PrunePlan("x", (tuple(range(G)), ()), ((), ()))
    with pytest.raises(PlanError, match="empty the attention block"):
        plan.validate(lay)


NONE = ((), (), ())


@pytest.mark.parametrize("attn, mlp, gone, match", [
    (((), ()), NONE, (), "covers 2 layers"),  # each rule broken alone
    (NONE, ((), ()), (), "covers 3 layers"),
    (NONE, NONE, (1, 1), "must be unique"),
    (NONE, NONE, (3,), "must be unique, in"),
    (NONE, NONE, (-1,), "must be unique, in"),
    (NONE, NONE, (0, 1, 2), "leave one"),
    (((), (1,), ()), NONE, (1,), "no groups removed besides"),
    (NONE, ((), (), (5,)), (2,), "no groups removed besides"),
    (((2, 2), (), ()), NONE, (), "layer 0: attention indices must be unique"),
    (((), (G,), ()), NONE, (), "layer 1: attention indices must be unique and in"),
    (NONE, ((), (), (-1,)), (), "layer 2: MLP indices must be unique and in"),
    (NONE, ((), tuple(range(C)), ()), (), "empty the MLP block"),
])
def test_validate_refuses_a_plan_that_breaks_any_one_rule(attn, mlp, gone, match):
    with pytest.raises(PlanError, match=match):
        PrunePlan("x", attn, mlp, gone).validate(layout(layers=3))


@pytest.mark.parametrize("attn, mlp, gone", [
    (NONE, NONE, ()), (NONE, NONE, (0, 2)), (((), (0, G - 1), ()), ((), tuple(range(C - 1)), ()), (0, 2)),
])
def test_validate_accepts_a_plan_that_keeps_every_rule(attn, mlp, gone):
    PrunePlan("x", attn, mlp, gone).validate(layout(layers=3))


def small_layout(g: int, layers: int = 6, c: int = 16, a: int = 40, m: int = 10) -> ModelLayout:
    """Coarse GQA as in the real models (SmolLM2: 3 KV groups, Qwen2.5-0.5B: 2): one attention group weighs as
    much as a/m MLP channels."""
    return equal_layers(g, c, a, m, layers)


def reference_attention_count(scores, lay, rule, sparsity):
    """The blockwise rule by enumeration, written without the planner: every k, its channels, feasibility, choice."""
    g, c, a, m = lay.attn_groups[0], lay.mlp_channels[0], lay.attn_group_params, lay.mlp_channel_params
    blocks = list(range(1, lay.num_layers - 1))
    target = sparsity * lay.total_params
    candidates = []
    for k in range(g):
        channels = 0
        while len(blocks) * k * a + channels * m < target:
            channels += 1
        if channels > len(blocks) * (c - 1) or len(blocks) * k * a + channels * m - target >= max(a, m):
            continue
        per_block = [channels // len(blocks) + (i < channels % len(blocks)) for i in range(len(blocks))]
        loss = sum(
            a * sum(sorted(scores.attn[l])[:k]) + m * sum(sorted(scores.mlp[l])[:p]) for l, p in zip(blocks, per_block)
        )
        candidates.append((k, abs(k / g - channels / (len(blocks) * c)), loss))
    if rule == "mlp_only":
        return 0
    key = 1 if rule == "closest_ratio" else 2
    return min(candidates, key=lambda cand: (cand[key], cand[0]))[0]


@pytest.mark.parametrize("g", [2, 3, 4])
@pytest.mark.parametrize("rule", ["closest_ratio", "mlp_only", "min_loss"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_blockwise_attention_rule_equals_enumeration(g, rule, seed):
    lay = small_layout(g)
    rng = np.random.default_rng(seed)
    # attention groups scored on a per-parameter scale of their own, so that min_loss goes either way
    scores = GroupScores(
        tuple(rng.random(g) * rng.uniform(0.2, 2.0) for _ in range(6)), tuple(rng.random(16) for _ in range(6))
    )
    plan = plan_blockwise(scores, lay, options(0.2, blockwise_attention=rule))
    expected = reference_attention_count(scores, lay, rule, 0.2)
    assert [len(plan.attn_removed[l]) for l in range(1, 5)] == [expected] * 4
    removed = sum(plan.layer_params_removed(lay))
    assert (
        0.2 * lay.total_params <= removed < 0.2 * lay.total_params + max(lay.attn_group_params, lay.mlp_channel_params)
    )


@pytest.mark.parametrize("attention_score, expected_k", [(0.5, 1), (1.0, 0), (2.0, 0)])
def test_blockwise_min_loss_by_hand(attention_score, expected_k):
    # 2 KV groups of 40 parameters, 16 channels of 10, 4 blocks; 20% of 1,440 = 288 parameters.
    # k = 0: 29 channels (290 parameters), loss 29 x 10 x 1.0 = 290.
    # k = 1: 4 groups (160) + 13 channels (130), loss 4 x 40 x s + 130: 210 at s = 0.5, 290 (a tie: fewer groups) at
    # 1.0.
    lay = small_layout(2)
    scores = GroupScores(tuple(np.full(2, attention_score) for _ in range(6)), tuple(np.ones(16) for _ in range(6)))
    plan = plan_blockwise(scores, lay, options(0.2, blockwise_attention="min_loss"))
    assert [len(plan.attn_removed[l]) for l in range(1, 5)] == [expected_k] * 4
    assert sum(map(len, plan.mlp_removed)) == (13 if expected_k else 29)
    with pytest.raises(PlanError, match="measured_loss needs the model"):  # the default rule measures
        plan_blockwise(scores, lay, PlanOptions.of(PruneConfig(model="tiny-llama")))
    closest = plan_blockwise(
        scores, lay, options(0.2, blockwise_attention="closest_ratio")
    )  # |1/2 - 13/64| < |0 - 29/64|: half of every attention block
    assert [len(closest.attn_removed[l]) for l in range(1, 5)] == [1] * 4


def test_the_registry_holds_the_methods_the_config_names():
    from taylor_tune import config
    from taylor_tune.pruning.methods import METHODS

    assert tuple(METHODS) == config.METHODS
    assert all(isinstance(m.scored_by, Scoring) for m in METHODS.values())


@pytest.mark.parametrize("method", sorted(WIDTH_METHODS))
@pytest.mark.parametrize("sparsity", [0.1, 0.3])
@pytest.mark.parametrize("multiple", [1, 8, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_uniform_plan_against_enumeration(method, sparsity, multiple, seed):
    """Issue 28's uniform layout, against a brute force: the attention count is the method's mean per layer (rounded),
    the width the multiple (or the full width) whose removal lands nearest the target, and in every layer exactly
    the lowest-scored groups go."""
    from taylor_tune.pruning.uniform import uniform_plan

    lay, scores = layout(), random_scores(layout(), seed + 10)
    free = METHODS[method].plan(scores, lay, options(sparsity, seed=seed))
    plan = uniform_plan(free, scores, lay, sparsity, multiple)
    plan.validate(lay)
    assert plan.method == free.method
    attn = round(sum(map(len, free.attn_removed)) / lay.num_layers)
    assert {len(a) for a in plan.attn_removed} == {attn}
    target = sparsity * lay.total_params
    widths = [w for w in range(1, C + 1) if w % multiple == 0 or w == C]
    best = min(abs(lay.num_layers * (attn * A + (C - w) * M) - target) for w in widths)
    (kept,) = {C - len(m) for m in plan.mlp_removed}
    assert kept in widths and abs(plan.params_removed(lay) - target) == best
    for layer in range(lay.num_layers):
        pairs = ((plan.attn_removed[layer], scores.attn[layer]), (plan.mlp_removed[layer], scores.mlp[layer]))
        for removed, s in pairs:
            gone = s[list(removed)]
            stays = np.delete(s, list(removed))
            assert not len(gone) or not len(stays) or gone.max() <= stays.min()


@pytest.mark.parametrize("g", [2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_blockwise_measured_loss_takes_the_candidate_with_the_lowest_given_loss(g, seed):
    """The rule asks the loss of every feasible k's whole plan and keeps the lowest (ties: the smaller k); the plan is
    the one block_plan gives for that k, and without a loss the rule refuses."""
    from taylor_tune.pruning.methods.blockwise import block_plan, blockwise_range, feasible_block_counts

    lay = small_layout(g)
    scores = GroupScores(*(tuple(np.random.default_rng(seed).random(n) for n in sizes)
                           for sizes in (lay.attn_groups, lay.mlp_channels)))
    losses = dict(zip(range(g), np.random.default_rng(seed + 100).random(g)))
    asked = []

    def loss(plan):
        k = len(plan.attn_removed[1])
        asked.append(k)
        return losses[k]

    opts = options(0.2, blockwise_attention="measured_loss", plan_loss=loss)
    plan = plan_blockwise(scores, lay, opts)
    layers = blockwise_range(lay, opts)
    feasible = feasible_block_counts(lay, layers, 0.2 * lay.total_params)
    assert sorted(asked) == [k for k, _ in feasible]
    best = min(feasible, key=lambda kc: (losses[kc[0]], kc[0]))
    assert plan == block_plan(scores, lay, layers, *best)
    with pytest.raises(PlanError, match="measured_loss needs the model"):
        plan_blockwise(scores, lay, options(0.2, blockwise_attention="measured_loss"))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uniform_with_a_loss_takes_the_attention_count_whose_plan_measures_lowest(seed):
    """With the model at hand every attention count 0..G-1 is a candidate (each with the width that meets the
    target), and the one with the lowest given loss wins; a target no width reaches is refused."""
    from taylor_tune.pruning.uniform import mlp_width, uniform_plan

    lay, scores = layout(), random_scores(layout(), seed)
    free = METHODS["taylor"].plan(scores, lay, options(0.3))
    losses = dict(enumerate(np.random.default_rng(seed).random(G)))
    plan = uniform_plan(free, scores, lay, 0.3, 8, plan_loss=lambda p: losses[len(p.attn_removed[0])])
    best = min((k for k in range(G) if mlp_width(lay, 0.3, 8, k) is not None), key=losses.get)
    assert {len(a) for a in plan.attn_removed} == {best}
    assert {C - len(m) for m in plan.mlp_removed} == {mlp_width(lay, 0.3, 8, best)}
    with pytest.raises(PlanError, match="uniform: every layer would need to keep less than half of 32"):
        uniform_plan(free, scores, lay, 0.9, 32)


def one_layer(total: int = 128, channels: int = 64, groups: int = 4) -> ModelLayout:
    """One layer, one parameter per group and channel: a target of s * total channels, exact in binary fractions."""
    return ModelLayout((groups,), (channels,), 1, 1, (groups + channels,), total)


def test_the_uniform_width_at_a_tie_is_the_wider_and_at_half_a_multiple_is_still_a_width():
    from taylor_tune.pruning.uniform import mlp_width

    lay = one_layer()
    assert mlp_width(lay, 24 / 128, 16, 0) == 48  # 40 channels wanted: 32 and 48 are as near, the wider stays
    assert mlp_width(lay, 56 / 128, 16, 0) == 16  # 8 wanted: exactly half a multiple still gets the narrowest
    assert mlp_width(lay, 58.5 / 128, 16, 0) is None  # 5.5 wanted: under half a multiple
    assert mlp_width(one_layer(channels=33), 3 / 128, 16, 0) == 32  # 30 wanted of 33: the multiple below the width
    assert mlp_width(lay, 1 / 128, 1, 3) == 64  # the attention alone overshoots (66 wanted): the full width, no more


def test_the_uniform_layout_needs_one_shape_and_a_multiple_no_wider_than_the_mlp():
    from taylor_tune.pruning.uniform import mlp_width

    uneven = ModelLayout((4, 3), (64, 64), 1, 1, (68, 67), 300)  # attention pruned, the MLP not
    with pytest.raises(PlanError, match="layers differ in size"):
        mlp_width(uneven, 0.1, 16, 0)
    assert mlp_width(one_layer(), 0.0, 64, 0) == 64  # a multiple of the whole width: that width
    with pytest.raises(PlanError, match="uniform_multiple: 65 is wider than the model's MLP"):
        mlp_width(one_layer(), 0.0, 65, 0)


def test_a_method_that_leaves_one_group_per_layer_gives_a_uniform_plan_that_leaves_one():
    from taylor_tune.pruning.uniform import uniform_plan

    lay, scores = layout(), random_scores(layout(), 0)
    free = PrunePlan("taylor", tuple(tuple(range(G - 1)) for _ in range(8)), tuple(() for _ in range(8)))
    plan = uniform_plan(free, scores, lay, 0.3, 8)
    assert {len(a) for a in plan.attn_removed} == {G - 1}


def test_the_uniform_plan_breaks_score_ties_by_index_as_the_global_ranking_does():
    # 64 channels with tied scores: numpy's default sort is not stable at this length; the lower index goes first
    from taylor_tune.pruning.plan import ranked_groups
    from taylor_tune.pruning.uniform import uniform_plan

    lay = layout()
    rng = np.random.default_rng(0)
    scores = GroupScores(tuple(rng.integers(0, 2, G).astype(float) for _ in range(8)),
                         tuple(rng.integers(0, 2, C).astype(float) for _ in range(8)))
    free = METHODS["taylor"].plan(scores, lay, options(0.2))
    plan = uniform_plan(free, scores, lay, 0.2, 8)
    for layer, (attn, mlp) in enumerate(zip(plan.attn_removed, plan.mlp_removed)):
        order = ranked_groups(scores, [layer])
        assert attn == tuple(sorted([i for _, _, i, kind in order if kind == "attn"][:len(attn)]))
        assert mlp == tuple(sorted([i for _, _, i, kind in order if kind == "mlp"][:len(mlp)]))


@pytest.mark.parametrize("method", ["taylor", "magnitude", "random"])
def test_a_global_plan_that_meets_its_target_exactly_stops_there(method):
    # one parameter per group and channel, a target of exactly 8 parameters: 8 groups go, not a ninth
    lay = one_layer()
    scores = GroupScores((np.random.default_rng(0).random(4),), (np.random.default_rng(1).random(64),))
    plan = METHODS[method].plan(scores, lay, options(8 / 128))
    assert plan.params_removed(lay) == 8


def test_the_planners_options_are_the_configs_settings():
    # every setting a planner reads, each away from its default, reaches it (layerwise's cap as the config resolves it)
    import dataclasses

    config = PruneConfig(model="tiny-llama", sparsity=0.3, method="blockwise", layerwise_max_ratio=0.6,
                         blockwise_layer_start=2, blockwise_layer_end=5, blockwise_attention="mlp_only",
                         criterion="taylor_sum", seed=7, depth_criterion="angular", servable=True)
    loss = lambda plan: 0.0  # noqa: E731
    options = PlanOptions.of(config, plan_loss=loss)
    fields = {f.name for f in dataclasses.fields(PlanOptions)} - {"layerwise_max_ratio", "plan_loss", "attention",
                                                                   "expert_sparsity"}
    assert {name: getattr(options, name) for name in fields} == {name: getattr(config, name) for name in fields}
    experts = PruneConfig(model="tiny-qwen3moe", method="experts", expert_sparsity=0.6)  # the experts method's own
    assert PlanOptions.of(experts).expert_sparsity == 0.6
    assert options.layerwise_max_ratio == config.layerwise_cap and options.plan_loss is loss
    assert options.attention is False and PlanOptions.of(PruneConfig(model="tiny-llama")).attention is True
    defaults = PruneConfig(model="tiny-llama")
    assert all(getattr(config, name) != getattr(defaults, name) for name in fields)


def layerwise_by_hand(scores: GroupScores, lay: ModelLayout, sparsity: float, cap: float):
    """The module docstring's layerwise plan as plain loops: each layer drops its lowest groups (score, then attention
    before MLP, then index) within its own budget, ratio x size, never a block's last group; then the lowest groups
    of the whole model, in layers still under the cap, until the target is met. None where the target is not met.
    The ratios are allocate_layer_ratios' (checked against water-filling above)."""
    target = sparsity * lay.total_params
    sizes = {0: lay.attn_group_params, 1: lay.mlp_channel_params}
    left = {0: list(lay.attn_groups), 1: list(lay.mlp_channels)}
    gone = {0: [set() for _ in range(lay.num_layers)], 1: [set() for _ in range(lay.num_layers)]}
    taken = [0] * lay.num_layers

    def groups(layers):
        return sorted((float(s), layer, kind, i) for layer in layers
                      for kind, arr in ((0, scores.attn[layer]), (1, scores.mlp[layer])) for i, s in enumerate(arr))

    def take(layer, kind, i, limit):
        if left[kind][layer] > 1 and taken[layer] + sizes[kind] <= limit and i not in gone[kind][layer]:
            left[kind][layer] -= 1
            gone[kind][layer].add(i)
            taken[layer] += sizes[kind]

    ratios = allocate_layer_ratios(layer_importance(scores, lay), np.array(lay.layer_params, dtype=float), target,
                                   cap)
    for layer in range(lay.num_layers):
        for _, _, kind, i in groups([layer]):
            take(layer, kind, i, ratios[layer] * lay.layer_params[layer])
    for _, layer, kind, i in groups(range(lay.num_layers)):
        if sum(taken) >= target:
            break
        take(layer, kind, i, cap * lay.layer_params[layer])
    if sum(taken) < target:
        return None
    return tuple(tuple(sorted(s)) for s in gone[0]), tuple(tuple(sorted(s)) for s in gone[1])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("sparsity, cap", [(0.1, 0.4), (0.3, 0.5), (0.4, 0.5), (0.45, 0.95)])
def test_layerwise_equals_its_definition_as_loops(seed, sparsity, cap):
    # one worthless layer in some draws: its ratio reaches the cap, and at 0.95 only a block's last group stops it
    lay = layout()
    scale = np.ones(8) if seed % 2 else np.r_[1e-6, np.ones(7)]
    scores = random_scores(lay, seed, layer_scale=scale)
    want = layerwise_by_hand(scores, lay, sparsity, cap)
    if want is None:
        with pytest.raises(PlanError):
            plan_layerwise(scores, lay, options(sparsity, cap=cap))
        return
    plan = plan_layerwise(scores, lay, options(sparsity, cap=cap))
    assert (plan.attn_removed, plan.mlp_removed) == want and plan.method == "layerwise"


def test_layerwise_meeting_its_target_exactly_stops_there():
    # one layer, one parameter per group: its own budget is exactly the 8 parameters of the target
    lay = one_layer()
    scores = GroupScores((np.random.default_rng(0).random(4),), (np.random.default_rng(1).random(64),))
    plan = plan_layerwise(scores, lay, options(8 / 128, cap=0.5))
    assert plan.params_removed(lay) == 8


def test_a_layer_of_zero_importance_takes_the_cap_without_a_numpy_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 1 / 0 is meant (inf, then the cap): no RuntimeWarning for a user to read
        ratios = allocate_layer_ratios(np.array([0.0, 1e-3, 2e-3]), np.full(3, 100.0), target=90.0, cap=0.5)
    # the other 40 parameters split inversely to importance: r1 * 1e-3 = r2 * 2e-3 and 100 (r1 + r2) = 40
    assert ratios[0] == 0.5 and ratios[1:] == pytest.approx([0.4 * 2 / 3, 0.4 / 3])


def test_layerwise_allocation_at_its_edges():
    params = np.full(2, 100.0)
    # the cap holds exactly the target: every layer at the cap, not a refusal
    assert allocate_layer_ratios(np.array([1.0, 3.0]), params, target=100.0, cap=0.5) == pytest.approx([0.5, 0.5])
    # no importance anywhere (all zero): nothing tells the layers apart, so one ratio for all
    ratios = allocate_layer_ratios(np.zeros(2), params, target=60.0, cap=0.5)
    assert ratios.shape == (2,) and ratios == pytest.approx([0.3, 0.3])
    with pytest.raises(PlanError, match=r"the layers hold only 100 of the 150 parameters to remove"):
        allocate_layer_ratios(np.array([1.0, 3.0]), params, target=150.0, cap=0.5)
