"""Issue 83, build 2, `servable`: prune only what DeciLM's per-layer format holds (every layer's attention whole, each
MLP width a multiple of 256 by importance). The references are written here: the MLP channels ranked by hand, each
layer's mean MLP score, the masked model index by index, and the DeciLM writer's own check of what it holds."""

import numpy as np
import pytest
import torch

from taylor_tune.config import build_prune_config
from taylor_tune.errors import ConfigError
from taylor_tune.pruning.methods import METHODS, PlanOptions
from taylor_tune.pruning.plan import GroupScores, target_params
from taylor_tune.pruning.prune import make_plan, prune
from tests.helpers import equal_layers, mask_groups

LAYERS, GROUPS, CHANNELS, ATTN_PARAMS, MLP_PARAMS = 6, 4, 2048, 4096, 96
LAYOUT = equal_layers(GROUPS, CHANNELS, ATTN_PARAMS, MLP_PARAMS, LAYERS)
WIDTH_METHODS = ["taylor", "layerwise", "blockwise", "magnitude", "random"]


def scores(seed: int) -> GroupScores:
    """Attention groups that score below every MLP channel (an attention-first ranking would take them all), and
    layers whose MLP scores differ in level."""
    rng = np.random.default_rng(seed)
    return GroupScores(attn=tuple(rng.random(GROUPS) * 1e-3 for _ in range(LAYERS)),
                       mlp=tuple(rng.random(CHANNELS) * rng.uniform(0.2, 2.0) for _ in range(LAYERS)))


def config(method: str, **fields):
    return build_prune_config({"model": "tiny-llama-random", "method": method, "sparsity": 0.3, "servable": True,
                               "layerwise_max_ratio": 0.6} | fields)


@pytest.mark.parametrize("method", WIDTH_METHODS)
@pytest.mark.parametrize("seed", [0, 1])
def test_every_method_keeps_the_attention_and_aligns_each_width_to_256_within_one_block_per_layer(method, seed):
    plan = make_plan(config(method), scores(seed), LAYOUT, loss=lambda candidate: 0.0)
    assert plan.attn_removed == ((),) * LAYERS
    widths = [CHANNELS - len(m) for m in plan.mlp_removed]
    assert all(w % 256 == 0 and w >= 256 for w in widths), widths
    assert min(widths) < CHANNELS
    block = 256 * MLP_PARAMS
    assert abs(plan.params_removed(LAYOUT) - target_params(LAYOUT, 0.3)) <= LAYERS * block


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_taylor_ranks_the_mlp_channels_of_the_whole_model_alone(seed):
    """Before the alignment: the lowest-scored MLP channels of the model, sorted here by hand, until the target,
    although every attention group scores lower than any of them."""
    drawn = scores(seed)
    plan = METHODS["taylor"].plan(drawn, LAYOUT, PlanOptions.of(config("taylor")))
    flat = sorted((float(s), layer, c) for layer, row in enumerate(drawn.mlp) for c, s in enumerate(row))
    count = int(np.ceil(target_params(LAYOUT, 0.3) / MLP_PARAMS))
    expected = [set() for _ in range(LAYERS)]
    for _, layer, c in flat[:count]:
        expected[layer].add(c)
    assert [set(m) for m in plan.mlp_removed] == expected and plan.attn_removed == ((),) * LAYERS


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layerwise_allocates_by_each_layers_mean_mlp_score(seed):
    """Before the alignment: a layer whose MLP channels score lower on average loses at least as many channels, and
    each layer loses its own lowest-scored ones. The attention scores are drawn against the MLP's (the layer with the
    best MLP has the worst attention), so counting them towards a layer's importance would reverse the order."""
    drawn = scores(seed)
    means = np.array([m.mean() for m in drawn.mlp])
    attn = tuple(np.full(GROUPS, 1e3 * (means.max() - mean)) for mean in means)
    drawn = GroupScores(attn=attn, mlp=drawn.mlp)
    plan = METHODS["layerwise"].plan(drawn, LAYOUT, PlanOptions.of(config("layerwise")))
    lost = np.array([len(m) for m in plan.mlp_removed])
    order = np.argsort(means)  # the lowest mean first: it loses the most (the cap ties some at the top)
    assert all(lost[a] >= lost[b] for a, b in zip(order, order[1:])), (means, lost)
    assert lost[order[0]] > lost[order[-1]]
    for layer, removed in enumerate(plan.mlp_removed):
        assert set(removed) == set(np.argsort(drawn.mlp[layer], kind="stable")[:len(removed)].tolist())


def test_servable_blockwise_is_recorded_as_mlp_only():
    assert config("blockwise").blockwise_attention == "mlp_only"
    assert config("layerwise").blockwise_attention != "mlp_only"  # the rule means nothing there: left as it was


@pytest.mark.parametrize("fields, match", [
    ({"uniform": True}, "servable: the uniform layout is a stock model already"),
    ({"method": "depth"}, "servable: depth keeps every width already"),
    ({"align": 64}, "servable: DeciLM's MLP widths are multiples of 256, so align must be one"),
    ({"method": "blockwise", "blockwise_attention": "closest_ratio"},
     "blockwise_attention: servable keeps every layer's attention"),
    ({"criterion": "flap"}, "servable: FLAP's compensation adds a bias"),
])
def test_servable_where_the_format_cannot_hold_it_is_refused_in_one_line(fields, match):
    with pytest.raises(ConfigError, match=match) as raised:
        build_prune_config({"model": "tiny-llama-random", "servable": True} | fields)
    assert "\n" not in str(raised.value)
    assert build_prune_config({"model": "tiny-llama-random", "servable": True, "align": 512}).servable_align == 512
    assert build_prune_config({"model": "tiny-llama-random", "servable": True, "criterion": "flap",
                               "flap_compensation": False}).servable


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """The tiny Llama's shape with an MLP of 768 = 3 x 256 and head_dim = hidden / heads (what DeciLM assumes),
    saved as a folder with the tiny models' tokenizer."""
    from transformers import LlamaForCausalLM

    from taylor_tune.sources.models import load_model_config, load_tokenizer

    shape = load_model_config("tiny-llama-random")
    shape.intermediate_size, shape.head_dim = 768, shape.hidden_size // shape.num_attention_heads
    torch.manual_seed(0)
    model = LlamaForCausalLM(shape).eval()
    folder = tmp_path_factory.mktemp("wide_llama")
    model.save_pretrained(folder)
    load_tokenizer("tiny-llama-random").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("method", ["taylor", pytest.param("layerwise", marks=pytest.mark.slow)])
def test_a_servable_pruning_equals_the_masked_model_and_is_written_as_decilm(method, wide_llama, tmp_path):
    """Through `prune`: the attention whole, the widths multiples of 256 (some pruned), the model equal to the
    unpruned one with the plan's channels zeroed index by index (1e-5), and the DeciLM writer, whose own check
    refuses anything its format cannot hold, writes it with `block_configs` that give each width back."""
    import json

    from taylor_tune.export.to_decilm import readers_width, write_decilm
    from taylor_tune.sources.models import load_model

    result = prune(build_prune_config(dict(
        model=str(wide_llama), method=method, sparsity=0.25, seq_len=32, num_samples=8, calibration="sample",
        micro_batch_size=4, device="cpu", dtype="float32", servable=True)))
    layers = result.model.model.layers
    unpruned = load_model(str(wide_llama)).model.layers
    assert [layer.self_attn.k_proj.weight.shape for layer in layers] == \
        [layer.self_attn.k_proj.weight.shape for layer in unpruned]
    widths = [layer.mlp.gate_proj.out_features for layer in layers]
    assert all(w % 256 == 0 for w in widths) and min(widths) < 768, widths
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(result.model(input_ids=ids).logits,
                                   mask_groups(load_model(str(wide_llama)), result.plan)(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    folder = write_decilm(result.model, result.tokenizer, tmp_path / "decilm")
    blocks = json.loads((folder / "config.json").read_text())["block_configs"]
    hidden = result.model.config.hidden_size
    assert [readers_width(b["ffn"]["ffn_mult"], hidden) for b in blocks] == widths
    assert {b["attention"]["n_heads_in_group"] for b in blocks} == \
        {result.model.config.num_attention_heads // result.model.config.num_key_value_heads}
