"""Depth pruning on the tiny trained models of all three architectures, against independent computations: block
influence and angular distance from the model's own hidden states (output_hidden_states, the final norm made an
identity), the depth-pruned model against the original with the removed layers replaced by identity (logits and
cached greedy decoding), and its stock reload in plain transformers; the layer count's rounding against brute force.
"""

import math

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from taylor_tune.errors import PlanError
from taylor_tune.pruning.apply import remove_layers, save_pruned
from taylor_tune.pruning.depth import LayerSimilarity, choose_layers, layers_to_remove
from taylor_tune.pruning.plan import ModelLayout
from taylor_tune.pruning.similarity import layer_similarity
from taylor_tune.sources.data import TINY_MODELS, TRAINED_MODELS
from taylor_tune.sources.families import DENSE
from tests.helpers import calibration_ids, tiny

TRAINED = ["tiny-llama", "tiny-qwen2", "tiny-mistral"]


class Skip(nn.Module):
    """A decoder layer that gives back its input."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def hidden_states_by_hand(model, ids):
    """x_0 .. x_L from the model's own output_hidden_states, with the final norm an identity so that x_L is the last
    layer's raw output."""
    norm, model.model.norm = model.model.norm, nn.Identity()
    try:
        with torch.no_grad():
            return [h.double() for h in model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states]
    finally:
        model.model.norm = norm


@pytest.mark.parametrize("name", TRAINED)
def test_block_influence_and_angular_distance_equal_the_model_s_hidden_states(name):
    model = tiny(name)
    ids = calibration_ids(6, 24)
    measured = layer_similarity(model, ids, micro_batch_size=4)
    xs = hidden_states_by_hand(model, ids)
    layers = len(model.model.layers)
    assert len(xs) == layers + 1
    for layer in range(layers):
        cos = torch.nn.functional.cosine_similarity(xs[layer], xs[layer + 1], dim=-1).mean().item()
        assert measured.block_influence[layer] == pytest.approx(1 - cos, abs=1e-6)
    for n in (1, 2):
        for start in range(layers - n + 1):
            angles = []
            for row in range(ids.shape[0]):
                a, b = xs[start][row, -1], xs[start + n][row, -1]
                angles.append(math.acos(max(-1.0, min(1.0, float(a @ b / (a.norm() * b.norm()))))) / math.pi)
            assert measured.angular_distance(n)[start] == pytest.approx(sum(angles) / len(angles), abs=1e-6)


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name in TRAINED else pytest.mark.slow)
                                  for name in TRAINED_MODELS
                                  if TINY_MODELS[f"{name}-random"] in DENSE])  # every dense family's trained model
@pytest.mark.parametrize("removed", [(1,), (1, 2)])
def test_the_depth_pruned_model_is_the_original_with_those_layers_skipped_and_reloads_stock(name, removed, tmp_path):
    pruned, skipped = tiny(name), tiny(name)
    remove_layers(pruned, removed)
    for i in removed:
        skipped.model.layers[i] = Skip()
    ids = calibration_ids(3, 20)
    with torch.no_grad():
        expected = skipped(input_ids=ids, use_cache=False).logits
        got = pruned(input_ids=ids, use_cache=False).logits
    assert (got - expected).abs().max() <= 1e-5
    # the KV cache is indexed by the renumbered layers: cached greedy decoding agrees too
    prompt = ids[:1, :8]
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(pruned.generate(prompt, **kwargs), skipped.generate(prompt, **kwargs))
    save_pruned(pruned, tmp_path)  # as the product saves it: Phi-3's projections fused again
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=False, dtype=torch.float32)
    assert type(reloaded) is type(pruned) and reloaded.config.num_hidden_layers == 4 - len(removed)
    assert len(reloaded.model.layers) == 4 - len(removed)
    if hasattr(reloaded.config, "layer_types"):
        assert len(reloaded.config.layer_types) == 4 - len(removed)
    with torch.no_grad():
        assert (reloaded(input_ids=ids, use_cache=False).logits - expected).abs().max() <= 1e-5


def layout(layers: int, layer_params: int, other: int) -> ModelLayout:
    return ModelLayout(attn_groups=(2,) * layers, mlp_channels=(8,) * layers, attn_group_params=1,
                       mlp_channel_params=1, layer_params=(layer_params,) * layers,
                       total_params=layers * layer_params + other)


@pytest.mark.parametrize("sparsity", [0.05, 0.1, 0.2, 0.25, 0.3, 0.5, 0.7])
@pytest.mark.parametrize("layers, per_layer, other", [(32, 218, 1050), (24, 100, 600), (4, 10, 3)])
def test_the_layer_count_is_the_nearest_to_the_target(sparsity, layers, per_layer, other):
    model = layout(layers, per_layer, other)
    target = sparsity * model.total_params
    # brute force: every count, the nearest (the smaller of a tie), at least one, one layer kept
    best = min(range(layers + 1), key=lambda k: (abs(k * per_layer - target), k))
    if best >= layers:
        with pytest.raises(PlanError, match="would remove all"):
            layers_to_remove(model, sparsity)
        return
    assert layers_to_remove(model, sparsity) == max(best, 1)


def test_each_criterion_picks_its_layers():
    rng = np.random.default_rng(0)
    cosine = np.array([0.2, 0.9, 0.95, 0.5, 0.93, 0.1])
    similarity = LayerSimilarity(cosine, rng.normal(size=(7, 3, 5)).astype(np.float32))
    assert choose_layers("block_influence", 2, 6, similarity) == (2, 4)  # the two highest cosines: least influence
    assert choose_layers("block_influence", 3, 6, similarity) == (1, 2, 4)
    distances = similarity.angular_distance(2)
    start = int(np.argmin(distances))
    assert choose_layers("angular", 2, 6, similarity) == (start, start + 1)
    assert len(distances) == 5
    assert choose_layers("last", 2, 6) == (3, 4)  # before the final layer
    with pytest.raises(PlanError):
        choose_layers("last", 6, 6)
    with pytest.raises(ValueError, match="forward pass"):
        choose_layers("angular", 1, 6)


@pytest.mark.parametrize("criterion", ["block_influence", "angular", "last"])
def test_the_depth_method_prunes_the_chosen_layers_and_saves_a_stock_folder(criterion, tmp_path):
    from taylor_tune.config import PruneConfig
    from taylor_tune.pruning.apply import save_pruned
    from taylor_tune.pruning.prune import prune
    from taylor_tune.pruning.similarity import layer_similarity as measure
    from taylor_tune.sources.calibration import load_calibration

    config = PruneConfig(model="tiny-qwen2", method="depth", depth_criterion=criterion, sparsity=0.25, seq_len=32,
                         num_samples=8, calibration="world", device="cpu", dtype="float32")
    result = prune(config)
    original = tiny("tiny-qwen2")
    per_layer, total = result.layout.layer_params[0], result.layout.total_params
    n = min(range(1, 4), key=lambda k: (abs(k * per_layer - 0.25 * total), k))
    if criterion == "last":
        expected = tuple(range(3 - n, 3))
        assert result.calibration_ids is None  # nothing measured, nothing drawn
    else:  # the criterion on the same calibration draw, measured here
        ids = load_calibration(result.tokenizer, "world", seq_len=32, num_samples=8, seed=0)
        assert torch.equal(result.calibration_ids, ids)
        expected = choose_layers(criterion, n, 4, measure(original, ids))
    assert result.plan.layers_removed == expected
    d = result.diagnostics
    assert d["layers_removed"] == list(expected) and d["num_layers_kept"] == 4 - n
    assert d["params_count"] == sum(p.numel() for p in result.model.parameters()) == total - n * per_layer
    assert d["pruning_ratio"] == pytest.approx(n * per_layer / total)
    assert [d["layer_pruning_ratio"][i] for i in expected] == [1.0] * n
    for i in expected:
        original.model.layers[i] = Skip()
    ids = calibration_ids(2, 16)
    with torch.no_grad():
        assert (result.model(input_ids=ids).logits - original(input_ids=ids).logits).abs().max() <= 1e-5
    save_pruned(result.model, tmp_path / "model", result.tokenizer, source_model="tiny-qwen2")
    config_json = (tmp_path / "model" / "config.json").read_text()
    assert "auto_map" not in config_json and "pruned_layout" not in config_json  # stock
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", trust_remote_code=False)
    assert reloaded.config.num_hidden_layers == 4 - n


def test_depth_is_a_search_dimension_and_refuses_the_uniform_layout():
    from pydantic import ValidationError

    from taylor_tune.config import PruneConfig
    from taylor_tune.sweep.experiment import Experiment
    from tests.sweep_helpers import SMALL

    with pytest.raises(ValidationError, match="depth-pruned model keeps every layer's shape"):
        PruneConfig(model="tiny-llama", method="depth", uniform=True)
    exp = Experiment(name="d", **{**SMALL, "search_space": {
        "pruning_method": {"grid": ["depth"]}, "depth_criterion": {"grid": ["block_influence", "angular", "last"]}}})
    assert [exp.prune_config("tiny-llama", p).depth_criterion for p in exp.space_points()] == [
        "block_influence", "angular", "last"]
    with pytest.raises(ValidationError, match="depth_criterion"):
        Experiment(name="d", **{**SMALL, "search_space": {"depth_criterion": {"grid": ["cosine"]}}})


def test_depth_by_taylor_ranks_whole_layers_by_their_gradient_importance_from_the_shared_pass():
    from taylor_tune.config import PruneConfig
    from taylor_tune.pruning.prune import prune

    config = PruneConfig(model="tiny-llama", method="depth", depth_criterion="taylor", sparsity=0.2, seq_len=32,
                         num_samples=8, calibration="world", device="cpu", dtype="float32")
    result = prune(config)
    layout, raw = result.layout, result.importance.scores  # per-parameter group scores of the gradient pass
    # by hand: a layer's sum |w * g| over all its groups, divided by its groups' parameters
    layer_score = []
    for attn, mlp in zip(raw.attn, raw.mlp):
        total = sum(attn) * layout.attn_group_params + sum(mlp) * layout.mlp_channel_params
        layer_score.append(total / (len(attn) * layout.attn_group_params + len(mlp) * layout.mlp_channel_params))
    n = len(result.plan.layers_removed)
    assert n == 1 and result.plan.layers_removed == tuple(sorted(np.argsort(layer_score, kind="stable")[:n]))
    width = prune(config.model_copy(update={"method": "taylor"}))  # the width method's pass: the same scores
    assert all(np.array_equal(a, b) for a, b in zip(width.importance.scores.attn, raw.attn))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_depth_by_measured_loss_is_greedy_on_the_really_pruned_model_s_loss(name):
    import copy

    from taylor_tune.config import PruneConfig
    from taylor_tune.pruning.measured import LOSS_SEQUENCES, calibration_loss, masked
    from taylor_tune.pruning.plan import PrunePlan
    from taylor_tune.pruning.prune import prune

    config = PruneConfig(model=name, method="depth", depth_criterion="measured_loss", sparsity=0.45, seq_len=32,
                         num_samples=8, calibration="world", device="cpu", dtype="float32")
    result = prune(config)
    ids = result.calibration_ids[:LOSS_SEQUENCES]
    original = tiny(name)

    def really_removed(layers) -> float:  # the model with those layers gone, not masked
        return calibration_loss(remove_layers(copy.deepcopy(original), tuple(sorted(layers))), ids, 8)

    chosen: list[int] = []
    for _ in range(len(result.plan.layers_removed)):
        chosen.append(min((c for c in range(4) if c not in chosen), key=lambda c: (really_removed([*chosen, c]), c)))
    assert len(chosen) == 2 and result.plan.layers_removed == tuple(sorted(chosen))
    none = tuple(() for _ in range(4))
    with masked(original, PrunePlan("depth", none, none, (1, 2))):  # masking skips exactly as removal computes
        inside = calibration_loss(original, ids, 8)
    assert inside == pytest.approx(really_removed([1, 2]), abs=1e-6)
    assert isinstance(original.model.layers[1], type(original.model.layers[0]))  # restored on exit
