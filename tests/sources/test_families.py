"""Issue 82 (first family): every family declared in one module (`sources.families`) and read from there; Qwen3's
trait, its `q_norm` / `k_norm` shared by every head, kept whole by pruning; an unsupported family (MoE) refused in
one line naming the supported ones. The oracles every family meets (importance against brute force, pruned equal to
masked in every width method, stock reload, LoRA merged equal to the adapters) run on `tiny-qwen3-random` through
`tests.helpers.ARCHS` and tests/recovery."""

import pytest
import torch

from taylor_tune.pruning.apply import apply_plan, save_pruned
from taylor_tune.pruning.plan import PrunePlan
from taylor_tune.sources.data import TINY_MODELS
from taylor_tune.sources.families import FAMILIES
from taylor_tune.sources.models import SUPPORTED_ARCHITECTURES, load_model_config, load_pruned, tiny_config
from taylor_tune.sources.pruned_modeling import PRUNED_CLASSES
from tests.helpers import ARCHS, tiny


def test_the_supported_families_are_those_declared_and_each_has_a_tiny_model_and_its_pruned_class():
    assert SUPPORTED_ARCHITECTURES == tuple(FAMILIES)
    assert {TINY_MODELS[name] for name in ARCHS} == set(FAMILIES)  # every family under the arch-wide oracles
    for family in FAMILIES.values():
        assert PRUNED_CLASSES[family.model_type].__name__ == family.pruned_class
    for name, model_type in TINY_MODELS.items():
        config = tiny_config(name)
        assert config.model_type == model_type and all(getattr(config, k) == v for k, v in FAMILIES[model_type]
                                                        .tiny.items())


def test_the_tiny_qwen3_keeps_its_traits():
    model = tiny("tiny-qwen3-random")
    config, attn = model.config, model.model.layers[0].self_attn
    assert config.head_dim * config.num_attention_heads != config.hidden_size  # head_dim given, not derived
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (config.head_dim,)
    assert attn.q_proj.bias is None and attn.k_proj.bias is None


@pytest.mark.parametrize("uniform", [False, True])
def test_pruning_qwen3_heads_keeps_its_shared_head_norms_whole(uniform, tmp_path):
    model = tiny("tiny-qwen3-random")
    with torch.no_grad():  # norms away from 1, so that a dropped or re-initialised norm shows
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.5)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.5)
    norms = [(l.self_attn.q_norm.weight.clone(), l.self_attn.k_norm.weight.clone()) for l in model.model.layers]
    removed = ((1,), (1,), (1,), (1,)) if uniform else ((0,), (1, 2), (3,), (0, 1, 3))
    plan = PrunePlan("hand", removed, ((),) * 4)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    pruned = apply_plan(model, plan)
    for layer, (q, k) in zip(pruned.model.layers, norms):
        assert torch.equal(layer.self_attn.q_norm.weight, q) and torch.equal(layer.self_attn.k_norm.weight, k)
    with torch.no_grad():
        expected = pruned(input_ids=ids).logits
    folder = save_pruned(pruned, tmp_path / "pruned")
    if uniform:  # a stock folder: plain transformers, no remote code
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)
    else:
        reloaded = load_pruned(folder)
    assert type(reloaded).__name__ == ("Qwen3ForCausalLM" if uniform else "PrunedQwen3ForCausalLM")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_an_unsupported_family_is_refused_in_one_line_naming_the_supported_ones(model_type, tmp_path):
    from transformers import AutoConfig

    from taylor_tune.errors import ModelLoadError

    AutoConfig.for_model(model_type, num_hidden_layers=1, hidden_size=8, intermediate_size=8, num_attention_heads=2,
                         num_key_value_heads=1).save_pretrained(tmp_path / model_type)
    with pytest.raises(ModelLoadError) as raised:
        load_model_config(str(tmp_path / model_type))
    message = str(raised.value)
    assert "\n" not in message and f"architecture {model_type!r}" in message
    assert f"supported: {', '.join(FAMILIES)}" in message
