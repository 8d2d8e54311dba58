"""Mixed cuts (depth + width): the layers a share of the target removes, the width method's plan on the layers
that stay equal to that method planned directly on them, the target met, the pruned model equal to the original
masked by the plan (layers skipped, groups zeroed), and a uniform mixed cut saved as a stock folder."""

import time

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from taylor_tune.config import PruneConfig
from taylor_tune.pruning.apply import save_pruned
from taylor_tune.pruning.depth import layers_to_remove
from taylor_tune.pruning.measured import masked
from taylor_tune.pruning.methods import METHODS, PlanOptions
from taylor_tune.pruning.mixed import without_layers
from taylor_tune.pruning.plan import GroupScores
from taylor_tune.pruning.prune import prune
from tests.helpers import calibration_ids, tiny


def config(**changes) -> PruneConfig:
    return PruneConfig(**{"model": "tiny-llama", "method": "taylor", "sparsity": 0.4, "depth_share": 0.5,
                          "depth_criterion": "last", "seq_len": 32, "num_samples": 8, "calibration": "world",
                          "device": "cpu", "dtype": "float32", "uniform_multiple": 8} | changes)


@pytest.mark.parametrize("method", ["taylor", "layerwise", "magnitude", "random"])
def test_a_mixed_cut_is_the_depth_share_then_the_method_on_the_layers_that_stay(method):
    c = config(method=method)
    result = prune(c)
    layout, plan = result.layout, result.plan
    n = layers_to_remove(layout, c.sparsity * c.depth_share)
    assert plan.layers_removed == tuple(range(layout.num_layers - 1 - n, layout.num_layers - 1))  # `last`
    kept = [i for i in range(layout.num_layers) if i not in plan.layers_removed]
    reduced = without_layers(layout, plan.layers_removed)
    # the rest of the target, planned by the method directly on the layers that stay
    rest = c.sparsity * layout.total_params - sum(layout.layer_params[i] for i in plan.layers_removed)
    scores = None if result.scores is None else GroupScores(attn=tuple(result.scores.attn[i] for i in kept),
                                                            mlp=tuple(result.scores.mlp[i] for i in kept))
    direct = METHODS[method].plan(scores, reduced, PlanOptions.of(c.model_copy(
        update={"sparsity": rest / reduced.total_params, "depth_share": 0.0})))
    assert [plan.attn_removed[i] for i in kept] == list(direct.attn_removed)
    assert [plan.mlp_removed[i] for i in kept] == list(direct.mlp_removed)
    assert all(not plan.attn_removed[i] and not plan.mlp_removed[i] for i in plan.layers_removed)
    # the whole target, to within one group
    removed = layout.total_params - result.diagnostics["params_count"]
    assert 0 <= removed - c.sparsity * layout.total_params < max(layout.attn_group_params, layout.mlp_channel_params)
    assert result.diagnostics["params_count"] == sum(p.numel() for p in result.model.parameters())
    original, ids = tiny("tiny-llama"), calibration_ids(2, 16)
    with torch.no_grad(), masked(original, plan):
        expected = original(input_ids=ids).logits
    with torch.no_grad():
        assert (result.model(input_ids=ids).logits - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("criterion", ["block_influence", "measured_loss"])
def test_a_uniform_mixed_cut_is_a_stock_model(criterion, tmp_path):
    result = prune(config(uniform=True, depth_criterion=criterion, model="tiny-qwen2"))
    assert len(result.plan.layers_removed) >= 1
    shapes = {(len(a), len(m)) for i, (a, m) in enumerate(zip(result.plan.attn_removed, result.plan.mlp_removed))
              if i not in result.plan.layers_removed}
    assert len(shapes) == 1  # every layer that stays has one shape
    save_pruned(result.model, tmp_path / "m", result.tokenizer, source_model="tiny-qwen2")
    assert "auto_map" not in (tmp_path / "m" / "config.json").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=False)
    ids = calibration_ids(2, 16)
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - result.model(input_ids=ids).logits).abs().max() <= 1e-5
    assert reloaded.config.num_hidden_layers == 4 - len(result.plan.layers_removed)


def test_blockwise_s_range_is_the_original_layers():
    result = prune(config(method="blockwise", blockwise_layer_start=0, blockwise_layer_end=3,
                          blockwise_attention="mlp_only", sparsity=0.3, depth_share=0.6))
    assert result.plan.layers_removed == (2,)  # `last` before the final layer
    pruned_layers = [i for i, m in enumerate(result.plan.mlp_removed) if m]
    assert pruned_layers == [0, 1]  # layers 0..2 asked, 2 gone whole, 3 outside the range


def test_mixed_settings_are_checked():
    with pytest.raises(ValidationError, match="depth removes whole layers only"):
        config(method="depth")
    with pytest.raises(ValidationError, match="taylor is depth's alone"):
        config(depth_criterion="taylor")
    with pytest.raises(ValidationError, match="depth_share"):
        config(depth_share=1.0)
    assert np.isclose(config(depth_share=0.25).depth_share, 0.25)


def test_a_mixed_cuts_layer_measure_is_timed_apart_from_the_scores_a_cache_serves(tmp_path, monkeypatch):
    """similarity_s: the block-influence pass every mixed trial runs itself (never cached); importance_s: the scores,
    which a sweep's later trials read from the cache. A replay prices the first per trial, the second per pass."""
    from taylor_tune.pruning import prune as stages
    from taylor_tune.pruning import scoring
    from taylor_tune.pruning.importance_cache import ImportanceCache

    measure = scoring.layer_similarity
    monkeypatch.setattr(scoring, "layer_similarity", lambda *a, **k: time.sleep(1.0) or measure(*a, **k))
    cache = ImportanceCache(tmp_path)

    def timings(c: PruneConfig) -> tuple[dict, float]:
        pruning = stages.start(c, cache=cache)
        stages.load(pruning)
        began = time.perf_counter()
        return stages.score(pruning), time.perf_counter() - began

    mixed = config(depth_criterion="block_influence")
    computed, _ = timings(mixed)
    hit, wall = timings(mixed)  # the scores read back; the layers measured (and calibration drawn) again
    assert computed["similarity_s"] >= 1.0 and hit["similarity_s"] >= 1.0
    assert 0.0 <= hit["importance_s"] < 1.0 and hit["calibration_s"] > 0.0
    parts = hit["importance_s"] + hit["similarity_s"] + hit["calibration_s"]
    # the call's seconds, each counted once: a part counted twice or left out is off by the planted 1 s sleep; the
    # slack is for the untimed rest of the call on a busy machine
    assert parts <= wall < parts + 0.5
    assert "similarity_s" not in timings(mixed.model_copy(update={"depth_share": 0.0}))[0]
