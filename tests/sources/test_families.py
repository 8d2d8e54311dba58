"""Issue 82 (first family): every family declared in one module (`sources.families`) and read from there; Qwen3's
trait, its `q_norm` / `k_norm` shared by every head, kept whole by pruning; an unsupported family (MoE) refused in
one line naming the supported ones. The oracles every family meets (importance against brute force, pruned equal to
masked in every width method, stock reload, LoRA merged equal to the adapters) run on `tiny-qwen3-random` through
`tests.helpers.ARCHS` and tests/recovery."""

import shutil

import pytest
import torch

from taylor_tune.pruning.apply import apply_plan, save_pruned
from taylor_tune.pruning.plan import PrunePlan
from taylor_tune.sources.data import TINY_MODELS
from taylor_tune.sources.families import DENSE, FAMILIES, MIXTURES
from taylor_tune.sources.models import (
    SUPPORTED_ARCHITECTURES,
    load_model_config,
    load_pruned,
    pruned_class_of,
    tiny_config,
)
from tests.helpers import ARCHS, tiny


def test_the_supported_families_are_those_declared_and_each_has_a_tiny_model_and_its_pruned_class():
    from transformers import AutoModelForCausalLM

    from taylor_tune.sources import pruned_modeling

    assert SUPPORTED_ARCHITECTURES == tuple(FAMILIES) == DENSE + MIXTURES
    assert {TINY_MODELS[name] for name in ARCHS} == set(DENSE)  # every dense family under the arch-wide oracles
    for model_type in DENSE:  # the pruned class made from the stock one, and found by its name as a folder's auto_map
        stock = type(AutoModelForCausalLM.from_config(tiny_config(f"{FAMILIES[model_type].tiny_name}-random")))
        made = pruned_class_of(model_type)
        assert made.__name__ == f"Pruned{stock.__name__}" and issubclass(made, stock)
        assert getattr(pruned_modeling, made.__name__) is made and pruned_class_of(model_type) is made
    for name, model_type in TINY_MODELS.items():
        config = tiny_config(name)
        assert config.model_type == model_type and all(getattr(config, k) == v for k, v in FAMILIES[model_type]
                                                        .tiny.items())


def test_the_families_are_every_module_that_declares_one_in_the_order_of_their_world_seeds(tmp_path, monkeypatch):
    from pathlib import Path

    from taylor_tune.sources import families

    modules = {p.stem for p in Path(families.__file__).parent.glob("*.py")} - {"__init__", "base"}
    assert len(FAMILIES) == len(modules)
    seeds = [family.world_seed for family in FAMILIES.values()]
    assert seeds == list(range(len(FAMILIES)))  # distinct, none missing: the world script seeds each model by it
    assert list(FAMILIES)[:3] == ["llama", "qwen2", "mistral"]  # the first families the fast tier runs
    # a module without a FAMILY (a helper) is no family, and one with a FAMILY is, wherever its name sorts
    package = tmp_path / "families"
    shutil.copytree(Path(families.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "aaa_helper.py").write_text("WIDTH = 3\n")
    (package / "aab_new.py").write_text('from taylor_tune.sources.families.base import Family\n\n'
                                        'FAMILY = Family("aab_new", world_seed=99, gguf=None)\n')
    monkeypatch.setattr(families, "__path__", [str(package)])
    found = families.declared()
    assert list(found)[:-1] == list(FAMILIES) and list(found)[-1] == "aab_new"


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


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3"])  # shared experts; group-limited routing
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
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-granite", "tiny-olmo2", "tiny-gemma2", "tiny-gemma3",
                                  "tiny-phi3"])
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


# Phi-3: the fused projections. The references below are written on the model transformers builds (fused qkv_proj
# and gate_up_proj), each group's rows indexed by hand in the fused matrices, not through the split.
WRONG_SLICES = {"self_attn.qkv_proj": ("q_proj", "v_proj", "k_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}


def stock_phi3():
    """tiny-phi3-random as transformers' own class holds it, its attention weights large enough to matter."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("tiny-phi3-random"), dtype=torch.float32).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.qkv_proj.weight.normal_(0.0, 0.3)
                layer.self_attn.o_proj.weight.normal_(0.0, 0.3)
    return model


def split(model, fused=None):
    import copy

    from taylor_tune.sources.pruned_modeling import split_fused

    model = copy.deepcopy(model)
    split_fused(model, fused or FAMILIES["phi3"].fused)
    return model


def test_the_tiny_phi3_keeps_its_traits_and_is_held_split():
    model = tiny("tiny-phi3-random")
    config, attn, mlp = model.config, model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert config.head_dim * config.num_attention_heads != config.hidden_size
    assert config.rope_parameters["partial_rotary_factor"] == 0.75  # Phi-4-mini's partial RoPE
    assert type(attn).__name__ == "Phi3SplitAttention" and type(mlp).__name__ == "Phi3SplitMLP"
    assert not any("qkv_proj" in name or "gate_up_proj" in name for name, _ in model.named_parameters())
    assert (attn.q_proj.out_features, attn.k_proj.out_features, mlp.up_proj.out_features) == (128, 32, 192)


def test_phi3_held_split_computes_what_its_fused_stock_model_computes():
    """The split model is the stock one: the same logits to float precision. The planted slip (k and v taken from
    each other's slice of qkv_proj) computes otherwise, so the oracle sees a wrong slice."""
    stock = stock_phi3()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = stock(input_ids=ids).logits
        torch.testing.assert_close(split(stock)(input_ids=ids).logits, expected, rtol=1e-6, atol=1e-6)
        assert (split(stock, WRONG_SLICES)(input_ids=ids).logits - expected).abs().max() > 1e-2


def fused_brute_force(stock, ids):
    """Group scores by the definition on the fused stock model: the gradient of the mean loss by autograd, then each
    group's |w * g| summed over its rows of qkv_proj (its q heads, then its k head past every q row, then its v head
    past every k row), its o_proj columns, and each channel's two rows of gate_up_proj (c and c + intermediate) and
    down_proj column; divided by the group's parameter count."""
    import copy

    import numpy as np

    model = copy.deepcopy(stock)
    model(input_ids=ids, labels=ids).loss.backward()
    cfg = model.config
    d, heads, kv, width = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    rep = heads // kv
    attn, mlp = [], []
    with torch.no_grad():
        for layer in model.model.layers:
            qkv, o = layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight
            gate_up, down = layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight
            sal = lambda w: (w * w.grad).abs()
            groups = []
            for g in range(kv):
                q = list(range(g * rep * d, (g + 1) * rep * d))
                k = [heads * d + g * d + i for i in range(d)]
                v = [heads * d + kv * d + g * d + i for i in range(d)]
                total = sal(qkv)[q + k + v].sum() + sal(o)[:, q].sum()
                groups.append(float(total) / (len(q + k + v) * qkv.shape[1] + o.shape[0] * len(q)))
            attn.append(np.array(groups))
            both = sal(gate_up)
            mlp.append(np.array([float(both[c].sum() + both[width + c].sum() + sal(down)[:, c].sum())
                                 / (3 * cfg.hidden_size) for c in range(width)]))
    return attn, mlp


def test_phi3_importance_equals_brute_force_over_its_fused_rows():
    """Issue 82, must-show 1 for Phi-3 against the fused model itself; the planted slip (k and v from each other's
    slice) scores otherwise."""
    import numpy as np

    from taylor_tune.pruning.groups import describe_layout
    from taylor_tune.pruning.importance import compute_importance
    from tests.helpers import calibration_ids

    stock, ids = stock_phi3(), calibration_ids(6, 16)
    attn, mlp = fused_brute_force(stock, ids)

    def scores(model):
        return compute_importance(model, describe_layout(model), ids, micro_batch_size=4)[6].scores

    ours = scores(split(stock))
    for a, b in zip(ours.attn + ours.mlp, attn + mlp):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-12)
    slipped = scores(split(stock, WRONG_SLICES))
    assert not all(np.allclose(a, b, rtol=1e-3) for a, b in zip(slipped.attn, attn))


@pytest.mark.parametrize("layout", ["free", "uniform", "depth"])
def test_a_pruned_phi3_is_written_fused_when_stock_and_reloads_to_its_logits(layout, tmp_path):
    """The uniform and depth layouts are stock folders: qkv_proj and gate_up_proj fused again on disk (the parts
    joined in their row order) and loaded by plain transformers without remote code; the free layout holds the parts
    and loads as the pruned class. Each computes the pruned model's logits."""
    import json

    from safetensors import safe_open

    plans = {"free": PrunePlan("hand", ((0,), (1, 2), (3,), ()), ((0, 5),) * 4),
             "uniform": PrunePlan("hand", ((1,),) * 4, ((0, 5),) * 4),
             "depth": PrunePlan("hand", ((),) * 4, ((),) * 4, layers_removed=(1,))}
    pruned = apply_plan(split(stock_phi3()), plans[layout])
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = pruned(input_ids=ids).logits
    folder = save_pruned(pruned, tmp_path / "pruned")
    with safe_open(folder / "model.safetensors", "pt") as weights:
        keys = set(weights.keys())
    stock = layout != "free"
    assert ("model.layers.0.self_attn.qkv_proj.weight" in keys) == stock
    assert ("model.layers.0.mlp.up_proj.weight" in keys) == (not stock)
    assert ("pruned_fused" in json.loads((folder / "config.json").read_text())) == (not stock)
    assert_reloads(folder, stock, "Phi3ForCausalLM", ids, expected)
    with torch.no_grad():  # taylor_tune's own loader holds it split again, to the same logits
        torch.testing.assert_close(load_pruned(folder)(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["free", "uniform"])
def test_a_llama32_shape_meets_the_oracles(layout, tmp_path):
    """Llama 3.2 1B/3B's traits at toy size: three query heads per key/value head (3B's 24 / 8), tied embeddings,
    llama3 RoPE scaling. Its importance equals the brute force, the pruned model equals the masked one, the uniform
    layout reloads in stock transformers (still tied) and the free one in the pruned class, to the same logits."""
    from taylor_tune.pruning.groups import describe_layout
    from taylor_tune.pruning.importance import compute_importance
    from tests.helpers import calibration_ids, llama, mask_groups
    from tests.pruning.test_importance import assert_scores_close, brute_force

    def model():
        return llama(vocab_size=259, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                     tie_word_embeddings=True,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 16})

    ids = calibration_ids(6, 16)
    attn, mlp, _, _ = brute_force(model(), ids)
    ours = compute_importance(model(), describe_layout(model()), ids, micro_batch_size=4)[6].scores
    assert_scores_close(ours, attn, mlp)

    plan = PrunePlan("hand", ((1,),) * 3 if layout == "uniform" else ((0,), (1,), ()), ((0, 5),) * 3)
    tokens = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    pruned = apply_plan(model(), plan)
    assert pruned.model.layers[0].self_attn.q_proj.out_features == 3 * 8  # a group's three query heads went with it
    with torch.no_grad():
        expected = pruned(input_ids=tokens).logits
        torch.testing.assert_close(mask_groups(model(), plan)(input_ids=tokens).logits, expected, rtol=1e-5,
                                   atol=1e-5)
    folder = save_pruned(pruned, tmp_path / "pruned")
    assert_reloads(folder, layout == "uniform", "LlamaForCausalLM", tokens, expected)
    reloaded = load_pruned(folder)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight


def test_no_code_outside_the_family_declarations_branches_on_a_model_type():
    """Issue 94, must-show 3 (its first half): what differs by family is declared in `sources.families` (a trait, a
    `Window`, `Experts`) and read from there; no module elsewhere asks which family a model is."""
    import re
    from pathlib import Path

    import taylor_tune

    root = Path(taylor_tune.__file__).parent
    found = [f"{path.relative_to(root)}:{number}" for path in sorted(root.rglob("*.py"))
             if "families" not in path.relative_to(root).parts
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"model_type\s*(==|!=)|model_type\s+(not\s+)?in\s+\(", line)]
    assert found == []
