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
    assert_reloads(folder, uniform, "Qwen3ForCausalLM", ids, expected)


def assert_reloads(folder, stock: bool, cls: str, ids, expected) -> None:
    """The saved folder loads as `cls` (plain transformers, no remote code) when `stock`, else as its pruned class
    (taylor_tune's loader), and computes `expected`."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False) if stock else load_pruned(folder)
    assert type(reloaded).__name__ == (cls if stock else f"Pruned{cls}")
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


GRANITE_SCALARS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def test_the_tiny_granite_keeps_its_traits():
    model = tiny("tiny-granite-random")
    config, layer = model.config, model.model.layers[0]
    # none of the four is what Llama computes with (1, 1, 1/sqrt(head_dim), 1): losing one changes the logits
    assert config.embedding_multiplier != 1 and config.residual_multiplier != 1 and config.logits_scaling != 1
    assert layer.self_attn.scaling == config.attention_multiplier != config.head_dim ** -0.5
    assert layer.residual_multiplier == config.residual_multiplier


@pytest.mark.parametrize("uniform", [False, True])
def test_a_pruned_granite_reloads_with_its_multipliers_and_without_them_computes_otherwise(uniform, tmp_path):
    """Issue 82, Granite's trait: the four multipliers travel in the pruned folder's config (stock for the uniform
    layout, the pruned class for the free one) and the reload computes the pruned model's logits. The planted slip,
    each multiplier dropped from config.json in turn, reloads to other logits: the oracle sees it."""
    import json

    model = tiny("tiny-granite-random")
    with torch.no_grad():  # attention that matters: at init its scores are ~0 whatever the scale, its output small
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, name).weight.normal_(0.0, 0.3)
    removed = ((1,), (1,), (1,), (1,)) if uniform else ((0,), (1, 2), (3,), (0, 1, 3))
    pruned = apply_plan(model, PrunePlan("hand", removed, ((0, 5),) * 4))
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = pruned(input_ids=ids).logits
    folder = save_pruned(pruned, tmp_path / "pruned")

    def reload():
        if uniform:
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)
        return load_pruned(folder)

    reloaded = reload()
    assert type(reloaded).__name__ == ("GraniteForCausalLM" if uniform else "PrunedGraniteForCausalLM")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    saved = (folder / "config.json").read_text()
    for name in GRANITE_SCALARS:
        (folder / "config.json").write_text(json.dumps({k: v for k, v in json.loads(saved).items() if k != name}))
        with torch.no_grad():
            slipped = reload()(input_ids=ids).logits
        assert (slipped - expected).abs().max() > 0.05 * expected.abs().max(), name


def test_the_tiny_olmo2_keeps_its_traits():
    model = tiny("tiny-olmo2-random")
    config, layer = model.config, model.model.layers[0]
    attn = layer.self_attn
    assert attn.q_norm.weight.shape == (config.num_attention_heads * config.head_dim,)  # the whole projection
    assert attn.k_norm.weight.shape == (config.num_key_value_heads * config.head_dim,)
    assert not hasattr(layer, "input_layernorm") and hasattr(layer, "post_feedforward_layernorm")


@pytest.mark.parametrize("uniform", [False, True])
def test_pruning_olmo2_heads_slices_its_whole_projection_norms(uniform, tmp_path, monkeypatch):
    """Issue 82, OLMo-2's trait: q_norm / k_norm keep the entries of the kept rows; the pruned model computes what the
    unpruned one computes with the groups masked and the norms taken over the kept rows (tests.helpers, written out),
    not what zeroing alone gives (the zeros would count in the norms' mean); it reloads (stock uniform, pruned class
    free) to the same logits. The planted slip, the family declared without sliced norms, fails."""
    import dataclasses

    from tests.helpers import mask_groups

    def model():
        m, draw = tiny("tiny-olmo2-random"), torch.Generator().manual_seed(1)
        with torch.no_grad():  # norms away from 1, so that the entries kept show
            for layer in m.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.5, generator=draw)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.5, generator=draw)
        return m

    removed = ((1,), (1,), (1,), (1,)) if uniform else ((0,), (1, 2), (3,), (0, 1, 3))
    plan = PrunePlan("hand", removed, ((),) * 4)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    original = model()
    pruned = apply_plan(model(), plan)
    for layer, before, gone in zip(pruned.model.layers, original.model.layers, removed):
        kept_q = [i for i in range(128) if i // 32 not in gone]
        kept_k = [i for i in range(32) if i // 8 not in gone]
        assert torch.equal(layer.self_attn.q_norm.weight, before.self_attn.q_norm.weight[kept_q])
        assert torch.equal(layer.self_attn.k_norm.weight, before.self_attn.k_norm.weight[kept_k])
    with torch.no_grad():
        expected = pruned(input_ids=ids).logits
        torch.testing.assert_close(mask_groups(model(), plan)(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        zeroed = model()
        for layer, gone in zip(zeroed.model.layers, removed):  # zeros alone, the norms over every row
            for g in gone:
                layer.self_attn.o_proj.weight[:, g * 32:(g + 1) * 32] = 0
        assert (zeroed(input_ids=ids).logits - expected).abs().max() > 1e-3
    folder = save_pruned(pruned, tmp_path / "pruned")
    assert_reloads(folder, uniform, "Olmo2ForCausalLM", ids, expected)
    monkeypatch.setitem(FAMILIES, "olmo2", dataclasses.replace(FAMILIES["olmo2"], head_norm=None))
    with pytest.raises(RuntimeError):  # the norms left whole no longer fit the rows pruning kept
        with torch.no_grad():
            apply_plan(model(), plan)(input_ids=ids)


GEMMA_FIELDS = {"gemma2": ("head_dim", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                           "sliding_window", "layer_types"),
                "gemma3_text": ("head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types")}


def gemma(name: str):
    """A random Gemma whose attention scores and logits are large enough for the caps and windows to act."""
    model, draw = tiny(name), torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, proj).weight.normal_(0.0, 0.5, generator=draw)
        model.lm_head.weight.normal_(0.0, 1.0, generator=draw)
    return model


@pytest.mark.parametrize("name", ["tiny-gemma2-random", "tiny-gemma3-random"])
def test_the_tiny_gemmas_keep_their_traits(name):
    model = tiny(name)
    config, attn = model.config, model.model.layers[0].self_attn
    assert config.head_dim * config.num_attention_heads != config.hidden_size  # head_dim given, not derived
    assert attn.scaling == config.query_pre_attn_scalar ** -0.5
    assert {"sliding_attention", "full_attention"} == set(config.layer_types)
    assert config.sliding_window < 24  # shorter than the tests' sequences: the windows act
    if config.model_type == "gemma2":
        assert config.attn_logit_softcapping and config.final_logit_softcapping
    else:
        assert attn.q_norm.weight.shape == (config.head_dim,)  # per head, shared


@pytest.mark.parametrize("layout", ["free", "uniform", "uniform-12-heads", "depth"])
@pytest.mark.parametrize("name", ["tiny-gemma2-random", "tiny-gemma3-random"])
def test_a_pruned_gemma_reloads_with_its_traits_and_without_each_computes_otherwise(name, layout, tmp_path):
    """Issue 82, Gemma's traits: a pruned Gemma 2 / 3 reloads (stock for the uniform and depth layouts, the pruned
    class for the free one) to the pruned model's logits, its windows, caps, attention scalar and head_dim kept (the
    window types cut with the layers by depth pruning). Gemma's config class refuses a head count that does not
    divide the hidden size (12 of 64 here): such a uniform model is written as the pruned folder, which reloads.
    The planted slips, each field dropped from config.json in turn, reload to other logits or not at all: the
    oracle sees them."""
    import json

    from transformers import AutoModelForCausalLM

    plans = {"free": PrunePlan("hand", ((0,), (1, 2), (3,), ()), ((0, 5),) * 4),
             "uniform": PrunePlan("hand", ((1, 2),) * 4, ((0, 5),) * 4),
             "uniform-12-heads": PrunePlan("hand", ((1,),) * 4, ((0, 5),) * 4),
             "depth": PrunePlan("hand", ((),) * 4, ((),) * 4, layers_removed=(1,))}
    pruned = apply_plan(gemma(name), plans[layout])
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = pruned(input_ids=ids).logits
    folder = save_pruned(pruned, tmp_path / "pruned")
    types = json.loads((folder / "config.json").read_text())["layer_types"]
    assert types == [t for i, t in enumerate(tiny_config(name).layer_types) if i != 1 or layout != "depth"]

    stock = layout in ("uniform", "depth")
    assert ("pruned_layout" not in json.loads((folder / "config.json").read_text())) == stock

    def reload():
        if not stock:
            return load_pruned(folder)
        return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)

    with torch.no_grad():
        torch.testing.assert_close(reload()(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    saved = json.loads((folder / "config.json").read_text())
    for field in GEMMA_FIELDS[pruned.config.model_type]:
        if field == "layer_types" and saved["layer_types"] == type(pruned.config)(
                num_hidden_layers=len(saved["layer_types"])).layer_types:
            continue  # the class's default pattern: dropping it changes nothing, rightly
        (folder / "config.json").write_text(json.dumps({k: v for k, v in saved.items() if k != field}))
        try:
            with torch.no_grad():
                slipped = reload()(input_ids=ids).logits
        except Exception as error:  # noqa: BLE001 - sizes that no longer fit the weights: refused, seen too
            assert field == "head_dim" and "size" in str(error), (field, error)
            continue
        assert (slipped - expected).abs().max() > 1e-3, field


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-granite", "tiny-olmo2", "tiny-gemma2", "tiny-gemma3"])
def test_pruning_the_trained_tiny_model_of_each_new_family_costs_measurable_perplexity(name):
    """Issue 82, build 2: each family's tiny model is trained on the offline world (scripts/make_offline_world.py), so
    that pruning moves its scores: a 30% taylor cut raises its held-out perplexity by more than the spread of the
    per-window losses allows by chance, window by window (paired)."""
    import numpy as np

    from taylor_tune.config import build_prune_config
    from taylor_tune.evaluation.perplexity import perplexity
    from taylor_tune.pruning.prune import prune
    from taylor_tune.sources.models import load_model, load_tokenizer
    from taylor_tune.sources.world import heldout_path

    text, tokenizer = heldout_path().read_text(), load_tokenizer(name)
    before = perplexity(load_model(name), tokenizer, text, max_windows=32)
    pruned = prune(build_prune_config(dict(model=name, method="taylor", sparsity=0.3, seq_len=32, num_samples=16,
                                           calibration="world", device="cpu", dtype="float32"))).model
    after = perplexity(pruned, tokenizer, text, max_windows=32)
    assert before["ppl"] < len(tokenizer) / 50  # trained: far from a uniform guess over the vocabulary
    gap = np.array(after["window_nll"]) - np.array(before["window_nll"])
    assert gap.mean() > 3 * gap.std(ddof=1) / np.sqrt(len(gap)), (before["ppl"], after["ppl"])
