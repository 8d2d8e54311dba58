"""Issue 93, must-show 4: a mixture pruned by the experts method written as GGUF for llama.cpp's architecture of its
family (Qwen3-MoE as `qwen3moe`, Mixtral as `llama` with experts, OLMoE as `olmoe`, Granite-MoE as `granitemoe`) and
read back by llama.cpp within the export's f32 bounds; and each routing llama.cpp's graph does not compute (dense
layers among the sparse, gates renormalised otherwise, grouped-query attention where it sizes k from the hidden size)
refused in one line before anything is written."""

import numpy as np
import pytest
import torch

from taylor_tune.export.to_gguf import TOLERANCE, GGUFError, check_gguf, write_gguf
from taylor_tune.pruning.apply import apply_plan
from taylor_tune.pruning.groups import describe_layout, sparse_blocks
from taylor_tune.pruning.plan import PrunePlan
from taylor_tune.sources.families import FAMILIES
from tests.export.test_gguf import random_with_a_real_tokenizer

# each family's tiny random model as llama.cpp's graph for it computes: every layer sparse (Qwen3-MoE), q, k and v
# hidden-wide (OLMoE), heads x head_dim the hidden size (Mixtral, Granite-MoE: their released models')
WRITTEN = {"qwen3_moe": ("tiny-qwen3moe-random", dict(mlp_only_layers=[]), "qwen3moe"),
           "mixtral": ("tiny-mixtral-random", dict(num_attention_heads=8), "llama"),
           "olmoe": ("tiny-olmoe-random", dict(num_key_value_heads=8), "olmoe"),
           "granitemoe": ("tiny-granitemoe-random", dict(num_attention_heads=8), "granitemoe")}


def routed_apart(layer) -> None:
    """Router rows far enough from 0 that the top-k differs from token to token, and norms away from 1."""
    for module in layer.modules():
        if hasattr(module, "weight") and module.weight.ndim == 2 and module.weight.shape[0] == 8:
            module.weight.normal_(0.0, 0.5)


def pruned_mixture(model_type: str, **changes):
    name, fields, _ = WRITTEN[model_type]
    model, tokenizer = random_with_a_real_tokenizer(name, routed_apart, **(fields | changes))
    layout = describe_layout(model)
    rng = np.random.default_rng(0)
    removed = tuple(tuple(sorted(rng.choice(e, 3, replace=False).tolist())) if e else () for e in layout.experts)
    none = ((),) * layout.num_layers
    return apply_plan(model, PrunePlan("experts", none, none, experts_removed=removed)), tokenizer


@pytest.mark.parametrize("model_type", list(WRITTEN))
def test_a_pruned_mixture_is_written_as_its_familys_gguf_and_llama_cpp_computes_what_it_does(model_type, tmp_path):
    model, tokenizer = pruned_mixture(model_type)
    assert {len(b.experts.gate_up_proj) for b in sparse_blocks(model).values()} == {5}
    path = tmp_path / "model.gguf"
    written = write_gguf(model, tokenizer, path, file_type="f32")
    assert written["architecture"] == WRITTEN[model_type][2] == FAMILIES[model_type].gguf
    assert all(layer["experts"] == 5 for layer in written["layers"])
    checked = check_gguf(path, model, tokenizer, "f32")
    assert checked["mean_abs_logprob_gap"] <= TOLERANCE["f32"]["mean"]
    assert checked["max_abs_logprob_gap"] <= TOLERANCE["f32"]["max"]


def test_a_mixtures_experts_are_written_in_f16_too(tmp_path):
    model, tokenizer = pruned_mixture("qwen3_moe")
    path = tmp_path / "model.gguf"
    write_gguf(model, tokenizer, path, file_type="f16")
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.0.ffn_down_exps.weight"] == "F16"
    checked = check_gguf(path, model, tokenizer, "f16")
    assert checked["mean_abs_logprob_gap"] <= TOLERANCE["f16"]["mean"]


@pytest.mark.parametrize(("model_type", "changes", "message"), [
    ("qwen3_moe", dict(mlp_only_layers=[2]), "llama.cpp's qwen3moe has experts in every layer, and layers [2] of "
                                              "this qwen3_moe model are dense"),
    ("qwen3_moe", dict(norm_topk_prob=False), "llama.cpp's qwen3moe renormalises a token's top-k gates, and this "
                                              "model's norm_topk_prob is False"),
    ("olmoe", dict(norm_topk_prob=True), "llama.cpp's olmoe does not renormalise a token's top-k gates, and this "
                                         "model's norm_topk_prob is True"),
    ("olmoe", dict(num_key_value_heads=4), "or fewer key/value heads than query heads) is not written as GGUF"),
])
def test_a_routing_llama_cpp_does_not_compute_is_refused_in_one_line(model_type, changes, message, tmp_path):
    model, tokenizer = pruned_mixture(model_type, **changes)
    with torch.no_grad(), pytest.raises(GGUFError) as refused:
        write_gguf(model, tokenizer, tmp_path / "model.gguf", file_type="f32")
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "model.gguf").exists()
