"""The activation baselines against independent computations, on the tiny trained models of all three architectures:
Wanda-sp's and FLAP's group scores from every o_proj / down_proj input kept whole by forward hooks (float64, loops
over the groups), and FLAP's compensated model against the original with the removed features held at their
calibration mean (logits, fp32); the compensated model saved and loaded back, stock where the config can say so."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from taylor_tune.config import PruneConfig
from taylor_tune.pruning.activations import activation_scores, activation_stats
from taylor_tune.pruning.apply import apply_plan, save_pruned
from taylor_tune.pruning.compensation import add_compensation, compensations
from taylor_tune.pruning.groups import describe_layout
from taylor_tune.pruning.importance_cache import ImportanceCache
from taylor_tune.pruning.methods import METHODS, PlanOptions
from taylor_tune.pruning.prune import prune
from taylor_tune.sources.models import load_model
from tests.helpers import calibration_ids, fast_diagonal, tiny

TRAINED = ["tiny-llama", "tiny-qwen2", "tiny-mistral"]


def inputs_by_hook(model, ids):
    """Every input row of each layer's o_proj and down_proj ([tokens, features], float64), kept whole."""
    seen = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        for kind, module in (("attn", layer.self_attn.o_proj), ("mlp", layer.mlp.down_proj)):
            handles.append(module.register_forward_pre_hook(
                lambda m, args, key=(kind, i): seen.setdefault(key, []).append(args[0].detach().double())))
    with torch.no_grad():
        for batch in ids.split(3):  # other micro-batches than the product's
            model(input_ids=batch, use_cache=False)
    for handle in handles:
        handle.remove()
    return {key: torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]).numpy() for key, xs in seen.items()}


def scores_by_hand(model, inputs, criterion):
    attn, mlp = [], []
    for i, layer in enumerate(model.model.layers):
        rows = {}
        for kind, module in (("attn", layer.self_attn.o_proj), ("mlp", layer.mlp.down_proj)):
            x, w = inputs[(kind, i)], module.weight.detach().double().numpy()
            cols = []
            for j in range(w.shape[1]):
                if criterion == "wanda_sp":
                    cols.append(np.mean(np.abs(w[:, j])) * np.sqrt(np.sum(x[:, j] ** 2)))
                else:
                    value = np.var(x[:, j]) * np.sum(w[:, j] ** 2)
                    cols.append(value**2 if kind == "attn" else value)
            cols = np.array(cols)
            if criterion == "flap":
                cols = (cols - cols.mean()) / np.std(cols, ddof=1)
            rows[kind] = cols
        groups = layer.self_attn.k_proj.out_features // layer.self_attn.head_dim
        width = len(rows["attn"]) // groups
        attn.append(np.array([rows["attn"][g * width:(g + 1) * width].mean() for g in range(groups)]))
        mlp.append(rows["mlp"])
    return attn, mlp


@pytest.mark.parametrize("name", TRAINED)
@pytest.mark.parametrize("criterion", ["wanda_sp", "flap"])
def test_activation_scores_equal_an_independent_computation_with_hooks(name, criterion):
    model = tiny(name)
    ids = calibration_ids(8, 32)
    scores = activation_scores(model, describe_layout(model), activation_stats(model, ids, micro_batch_size=4)[8],
                               criterion)
    attn, mlp = scores_by_hand(model, inputs_by_hook(model, ids), criterion)
    # flap's scores are standardized (unit spread): 1e-6 of it, absolute, where a score near 0 has no relative digits
    atol = 1e-6 if criterion == "flap" else 1e-9
    for ours, theirs in zip(scores.attn + scores.mlp, attn + mlp, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=atol)


def held_at_mean(model, plan, inputs):
    """Pre-hooks that replace each removed input feature of o_proj / down_proj by its calibration mean."""
    handles = []
    for i, layer in enumerate(model.model.layers):
        width = layer.self_attn.o_proj.in_features // (layer.self_attn.k_proj.out_features // layer.self_attn.head_dim)
        columns = {"attn": [g * width + k for g in plan.attn_removed[i] for k in range(width)],
                   "mlp": list(plan.mlp_removed[i])}
        for kind, module in (("attn", layer.self_attn.o_proj), ("mlp", layer.mlp.down_proj)):
            if not columns[kind]:
                continue
            mean = torch.tensor(inputs[(kind, i)].mean(axis=0), dtype=module.weight.dtype)[columns[kind]]

            def hold(m, args, cols=columns[kind], mean=mean):
                x = args[0].clone()
                x[..., cols] = mean
                return (x,)
            handles.append(module.register_forward_pre_hook(hold))
    return handles


@pytest.mark.parametrize("name, dtype", fast_diagonal(TRAINED, [torch.float32, torch.float64]))
def test_flap_compensation_equals_the_original_with_removed_features_at_their_mean(name, dtype):
    """float64: equal to 1e-9 (the algebra); float32: within 1e-5 of the logits' scale (max |logit|, the rounding of
    two summation orders through every layer)."""
    ids = calibration_ids(8, 32)

    def tiny_(name):
        return tiny(name).to(dtype)

    model = tiny_(name)
    layout = describe_layout(model)
    stats = activation_stats(model, ids, micro_batch_size=4)[8]
    options = PlanOptions.of(PruneConfig(model=name, criterion="flap", sparsity=0.3))
    plan = METHODS["taylor"].plan(activation_scores(model, layout, stats, "flap"), layout, options)
    assert any(plan.attn_removed) and any(plan.mlp_removed)
    reference = tiny_(name)
    handles = held_at_mean(reference, plan, inputs_by_hook(reference, ids))
    probe = calibration_ids(4, 24, seed=1)
    with torch.no_grad():
        expected = reference(input_ids=probe).logits
        for handle in handles:
            handle.remove()
        unheld = reference(input_ids=probe).logits
        pruned = add_compensation(apply_plan(model, plan), compensations(tiny_(name), plan, stats))
        got = pruned(input_ids=probe).logits
        plain = apply_plan(tiny_(name), plan)(input_ids=probe).logits
    bound = 1e-9 if dtype == torch.float64 else 1e-5 * float(expected.abs().max())
    assert (got - expected).abs().max() <= bound
    assert (plain - expected).abs().max() > 1e-3  # without the biases it differs: the check can fail
    assert (unheld - expected).abs().max() > 1e-3


@pytest.mark.parametrize("name, uniform, stock", [("tiny-llama", True, True), ("tiny-llama", False, False),
                                                  ("tiny-qwen2", True, False), ("tiny-mistral", True, False)])
def test_a_compensated_model_saves_and_loads_back_to_the_same_logits(tmp_path, name, uniform, stock):
    result = prune(PruneConfig(model=name, method="taylor", criterion="flap", uniform=uniform, sparsity=0.3,
                               seq_len=32, num_samples=8, calibration="world"))
    assert any(layer.mlp.down_proj.bias is not None for layer in result.model.model.layers)
    probe = calibration_ids(2, 24, seed=2)
    with torch.no_grad():
        before = result.model(input_ids=probe).logits
    folder = save_pruned(result.model, tmp_path / "pruned", source_model=name)
    config = json.loads((folder / "config.json").read_text())
    assert ("auto_map" not in config) is stock
    loaded = (AutoModelForCausalLM.from_pretrained(folder) if stock else load_model(str(folder)))
    with torch.no_grad():
        after = loaded(input_ids=probe).logits
    assert (after - before).abs().max() <= 1e-5


def test_flap_needs_the_global_ranking_or_the_uniform_layout():
    for method in ("layerwise", "blockwise"):
        with pytest.raises(ValueError, match=f"flap.*{method}"):
            PruneConfig(model="tiny-llama", method=method, criterion="flap")
    assert PruneConfig(model="tiny-llama", method="layerwise", criterion="wanda_sp").criterion == "wanda_sp"


def test_one_pass_gives_the_statistics_of_every_nested_draw():
    model, ids = tiny("tiny-qwen2"), calibration_ids(8, 32)
    both = activation_stats(model, ids, micro_batch_size=3, snapshots=[4, 8])
    alone = activation_stats(model, ids[:4], micro_batch_size=4)[4]
    for ours, theirs in zip(both[4].attn + both[4].mlp, alone.attn + alone.mlp, strict=True):
        assert ours.tokens == theirs.tokens == 4 * 32
        np.testing.assert_allclose(ours.mean, theirs.mean, rtol=1e-6, atol=1e-9)  # float32 per micro-batch
        np.testing.assert_allclose(ours.m2, theirs.m2, rtol=1e-6, atol=1e-9)
    assert not np.array_equal(both[4].mlp[0].mean, both[8].mlp[0].mean)


def test_the_statistics_are_cached_like_importance_under_keys_of_their_own(tmp_path):
    cache = ImportanceCache(tmp_path / "cache")

    def run(criterion, num_samples=8):
        config = PruneConfig(model="tiny-llama", method="taylor", criterion=criterion, sparsity=0.3, seq_len=32,
                             num_samples=num_samples, calibration="world")
        return prune(config, cache=cache, sample_counts=(4, 8))

    first, again, wanda, taylor = run("flap"), run("flap"), run("wanda_sp", 4), run("taylor")
    assert [first.importance_cache, again.importance_cache, wanda.importance_cache] == ["computed", "hit", "hit"]
    assert taylor.importance_cache == "computed"  # the gradient pass is another entry
    assert again.plan == first.plan and cache.counters() == {"computed": 2, "hits": 2, "takeovers": 0}
    direct = prune(PruneConfig(model="tiny-llama", method="taylor", criterion="wanda_sp", sparsity=0.3, seq_len=32,
                               num_samples=4, calibration="world"))
    assert direct.plan == wanda.plan  # a cached 4-sample snapshot plans as a pass over 4 rows does
    for entry in (tmp_path / "cache").glob("*.safetensors"):  # damaged: computed again, never used
        entry.write_bytes(entry.read_bytes()[:-8])
    assert run("flap").importance_cache == "computed" and run("flap").plan == first.plan
