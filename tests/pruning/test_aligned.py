"""Issue 83, `align`: the free layout's per-layer MLP widths rounded to the kernels' tiles by each layer's own ranking.
The references are written here: sorting each layer's scores by hand, and the masked model index by index."""

import numpy as np
import pytest
import torch

from taylor_tune.config import build_prune_config
from taylor_tune.errors import ConfigError, PlanError
from taylor_tune.pruning.aligned import aligned_plan
from taylor_tune.pruning.methods import METHODS, PlanOptions
from taylor_tune.pruning.plan import GroupScores, PrunePlan, target_params
from taylor_tune.pruning.prune import prune
from tests.helpers import ARCHS, equal_layers, mask_groups, tiny

LAYERS, GROUPS, CHANNELS = 6, 4, 512
FAST = {("tiny-llama-random", "taylor"), ("tiny-phi3-random", "layerwise")}


def scores(seed: int) -> GroupScores:
    rng = np.random.default_rng(seed)
    return GroupScores(attn=tuple(rng.random(GROUPS) for _ in range(LAYERS)),
                       mlp=tuple(rng.random(CHANNELS) * rng.uniform(0.2, 2.0) for _ in range(LAYERS)))


def planned(method: str, drawn: GroupScores, sparsity: float, align: int | None):
    layout = equal_layers(GROUPS, CHANNELS, 4096, 96, LAYERS)
    config = build_prune_config({"model": "tiny-llama-random", "method": method, "sparsity": sparsity,
                                 "blockwise_attention": "min_loss", **({"align": align} if align else {})})
    plan = METHODS[method].plan(drawn, layout, PlanOptions.of(config))
    return layout, plan, (aligned_plan(plan, drawn, layout, align) if align else plan)


@pytest.mark.parametrize("method", ["taylor", "layerwise", "blockwise"])
@pytest.mark.parametrize("align", [64, 256])
@pytest.mark.parametrize("seed", range(2))
def test_each_width_is_a_multiple_of_align_and_the_target_holds_within_one_block_per_layer(method, align, seed):
    drawn = scores(seed)
    layout, plan, aligned = planned(method, drawn, 0.3, align)
    aligned.validate(layout)
    for before, after in zip(plan.mlp_removed, aligned.mlp_removed):
        width = CHANNELS - len(after)
        assert width == CHANNELS if not before else (width % align == 0 and width >= align)
        assert abs(len(after) - len(before)) <= align  # the nearest multiple, within one block of the method's
    assert aligned.attn_removed == plan.attn_removed
    block = align * layout.mlp_channel_params
    # the method lands within one group of the target; the rounding within one block per layer of that
    assert abs(aligned.params_removed(layout) - target_params(layout, 0.3)) <= LAYERS * block + layout.attn_group_params


@pytest.mark.parametrize("method", ["taylor", "layerwise"])
@pytest.mark.parametrize("seed", range(3))
def test_the_rounding_follows_each_layers_own_ranking(method, seed):
    """Written out: a layer rounded down loses exactly its lowest-scored kept channels, one rounded up takes back its
    highest-scored removed ones; a rounding by position (the last indices) fails here."""
    drawn = scores(seed)
    _, plan, aligned = planned(method, drawn, 0.3, 64)
    for layer, (before, after) in enumerate(zip(plan.mlp_removed, aligned.mlp_removed)):
        s, before, after = drawn.mlp[layer], set(before), set(after)
        ranked = sorted(range(CHANNELS), key=lambda c: (s[c], c))  # least important first
        if len(after) > len(before):
            expected = before | set([c for c in ranked if c not in before][: len(after) - len(before)])
        else:
            expected = before - set([c for c in reversed(ranked) if c in before][: len(before) - len(after)])
        assert after == expected, layer


def test_a_layer_left_whole_stays_whole_and_none_keeps_less_than_one_block():
    drawn = scores(0)
    layout = equal_layers(GROUPS, CHANNELS, 4096, 96, LAYERS)
    plan = PrunePlan("hand", ((),) * LAYERS, ((), tuple(range(500)), tuple(range(10)), (), (), tuple(range(300))))
    widths = [CHANNELS - len(m) for m in aligned_plan(plan, drawn, layout, 64).mlp_removed]
    assert widths == [512, 64, 512, 512, 512, 192]  # 12 -> 64 (one block), 502 -> 512, 212 -> 192
    with pytest.raises(PlanError, match="align: 1024 is not narrower than the model's MLP"):
        aligned_plan(plan, drawn, layout, 1024)


@pytest.mark.parametrize("arch, method", [
    pytest.param(arch, method, marks=() if (arch, method) in FAST else pytest.mark.slow)
    for arch in ARCHS[:4] + ["tiny-phi3-random"] for method in ("taylor", "layerwise")])
def test_an_aligned_pruning_equals_the_masked_model(arch, method):
    """Through `prune`: every pruned layer's width a multiple of 64, the model equal to the unpruned one with the
    plan's groups zeroed index by index."""
    result = prune(build_prune_config(dict(
        model=arch, method=method, sparsity=0.3, seq_len=32, num_samples=8, calibration="sample", micro_batch_size=4,
        device="cpu", dtype="float32", align=64, layerwise_max_ratio=0.6)))
    widths = [layer.mlp.gate_proj.out_features for layer in result.model.model.layers]
    assert all(w % 64 == 0 for w in widths) and min(widths) < 192, widths
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(result.model(input_ids=ids).logits,
                                   mask_groups(tiny(arch), result.plan)(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fields, match", [
    ({"uniform": True}, "align: the uniform layout's width is a multiple of uniform_multiple already"),
    ({"method": "depth"}, "align: depth removes whole layers"),
    ({"align": 0}, "align"),
])
def test_align_where_it_means_nothing_is_refused_in_one_line(fields, match):
    with pytest.raises(ConfigError, match=match) as raised:
        build_prune_config({"model": "tiny-llama-random", "align": 64} | fields)
    assert "\n" not in str(raised.value)
