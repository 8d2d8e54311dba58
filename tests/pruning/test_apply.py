"""The physically pruned model against the original with the same groups zeroed, and what must survive pruning."""

import json

import pytest
import torch

from taylor_tune.config import build_prune_config
from taylor_tune.pruning.apply import apply_plan, save_pruned
from taylor_tune.pruning.groups import count_parameters
from taylor_tune.pruning.methods import WIDTH_METHODS
from taylor_tune.pruning.plan import PrunePlan
from taylor_tune.pruning.prune import prune
from taylor_tune.sources.models import load_model, load_pruned
from tests.helpers import ARCHS, fast_diagonal, mask_groups, tiny


def pruned(arch: str, method: str, sparsity: float = 0.2, **extra):
    config = build_prune_config(dict(
        model=arch, method=method, sparsity=sparsity, seq_len=32, num_samples=8, calibration="sample",
        micro_batch_size=4, device="cpu", dtype="float32", **extra,
    ))
    return prune(config)


def masked_original(arch: str, plan) -> torch.nn.Module:
    """The unpruned model with the plan's groups set to zero, index by index (not through apply.py)."""
    return mask_groups(tiny(arch), plan)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch, method", fast_diagonal(ARCHS, sorted(WIDTH_METHODS)))
def test_pruned_equals_masked(arch, method, ids):
    result = pruned(arch, method, 0.3, layerwise_max_ratio=0.6)
    assert any(result.plan.mlp_removed)
    torch.testing.assert_close(
        logits(result.model, ids), logits(masked_original(arch, result.plan), ids), rtol=1e-5, atol=1e-5
    )


CRITERIA = {"taylor": {"method": "taylor"}, "layerwise": {"method": "layerwise", "layerwise_max_ratio": 0.9},
            "wanda_sp": {"method": "taylor", "criterion": "wanda_sp"}}
CASES = [f"{criterion}-{layout}" for criterion in CRITERIA for layout in ("free", "uniform")]


@pytest.mark.parametrize("arch, case", [
    pytest.param(arch, case, marks=() if i == j else pytest.mark.slow)  # the fast tier: each case on one family
    for i, arch in enumerate(ARCHS) for j, case in enumerate(CASES)])
def test_every_family_pruned_equals_masked_in_both_layouts(arch, case, ids):
    """Issue 82, must-show 1: every family pruned by taylor, layerwise and wanda_sp at 60% (attention groups and MLP
    channels both cut), in the free and the uniform layout, equals the unpruned model with the same groups zeroed
    index by index."""
    criterion, layout = case.rsplit("-", 1)
    fields = dict(CRITERIA[criterion])
    result = pruned(arch, fields.pop("method"), 0.6, uniform=layout == "uniform", **fields)
    assert any(result.plan.attn_removed) and any(result.plan.mlp_removed)
    shapes = {(l.self_attn.k_proj.out_features, l.mlp.gate_proj.out_features) for l in result.model.model.layers}
    assert (len(shapes) == 1) == (layout == "uniform")
    torch.testing.assert_close(logits(result.model, ids), logits(masked_original(arch, result.plan), ids),
                               rtol=1e-5, atol=1e-5)


def test_attention_groups_pruned_equals_masked(arch, ids):
    # On random-init models the methods above mostly pick MLP channels (blockwise does take attention
    # groups), so the attention path also gets a plan that removes different groups in every layer.
    plan = PrunePlan("hand", ((0,), (1, 2), (3,), (0, 1, 3)), ((5,), (), (0, 191), tuple(range(0, 192, 3))))
    model = apply_plan(tiny(arch), plan)
    assert [l.self_attn.k_proj.out_features // 8 for l in model.model.layers] == [3, 2, 3, 1]
    torch.testing.assert_close(logits(model, ids), logits(masked_original(arch, plan), ids), rtol=1e-5, atol=1e-5)


def test_ratio_counts_and_untouched_parameters(arch):
    original = tiny(arch)
    result = pruned(arch, "taylor")
    d = result.diagnostics
    assert count_parameters(result.model) == d["params_count"]
    target = 0.2 * d["params_count_before"]
    removed = d["params_count_before"] - d["params_count"]
    assert target <= removed < target + max(result.layout.attn_group_params, result.layout.mlp_channel_params)
    assert d["pruning_ratio"] == pytest.approx(removed / d["params_count_before"])
    before = dict(original.named_parameters())
    for name, param in result.model.named_parameters():
        if "proj" not in name:  # embeddings, lm_head, every norm
            assert torch.equal(param, before[name]), name


def test_save_load_round_trips_exactly(arch, ids, tmp_path):
    result = pruned(
        arch, "blockwise", 0.3, blockwise_attention="closest_ratio"
    )  # layers of different head counts and widths
    assert len({l.self_attn.k_proj.out_features for l in result.model.model.layers}) > 1
    save_pruned(result.model, tmp_path / "m", tokenizer=result.tokenizer)
    again = load_pruned(tmp_path / "m")
    assert torch.equal(logits(result.model, ids), logits(again, ids))
    via_loader = load_model(str(tmp_path / "m"))  # a pruned folder is recognised by its manifest
    assert torch.equal(logits(result.model, ids), logits(via_loader, ids))
    assert not list(tmp_path.glob("m/*.bin")) and not list(tmp_path.glob("m/*.pt"))  # no pickle


def test_generate_with_kv_cache_matches_without(arch, ids):
    model = pruned(arch, "blockwise", 0.3, blockwise_attention="closest_ratio").model  # per-layer KV head counts differ
    prompt = ids[:1, :10]
    with_cache = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    without = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False, pad_token_id=0)
    assert with_cache.shape == (1, 18)
    assert torch.equal(with_cache, without)


def test_lm_eval_hflm_scores_the_pruned_model():
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    result = pruned("tiny-qwen2-random", "blockwise", blockwise_attention="closest_ratio")  # unequal head counts
    lm = HFLM(pretrained=result.model, tokenizer=result.tokenizer, device="cpu", batch_size=2)
    context, continuation = "The market of Holt", " opens every week"
    request = Instance("loglikelihood", {}, (context, continuation), 0)
    (loglik, _), = lm.loglikelihood([request])
    tok = result.tokenizer
    ctx, cont = tok(context)["input_ids"], tok(continuation)["input_ids"]
    full = torch.tensor([ctx + cont])
    logp = torch.log_softmax(logits(result.model, full)[0].double(), -1)
    expected = sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
    assert loglik == pytest.approx(expected, rel=1e-4)


@pytest.mark.slow
def test_pruned_folder_loads_in_plain_transformers_and_a_broken_one_is_one_line(ids, tmp_path):
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    result = pruned("tiny-qwen2-random", "blockwise", 0.3, blockwise_attention="closest_ratio")
    folder = save_pruned(result.model, tmp_path / "m", tokenizer=result.tokenizer, source_model="tiny-qwen2-random")
    plain = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)  # the folder's own modeling file
    assert torch.equal(logits(result.model, ids), logits(plain, ids))

    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:1000])  # truncated
    run = subprocess.run([sys.executable, "-m", "taylor_tune", "evaluate", "--model", str(folder), "--tasks", "piqa",
                          "--ppl", "none", "--output", str(tmp_path / "e.json")], capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "cannot load the pruned model" in run.stderr


def test_blockwise_attention_rule_reaches_the_plan():
    assert any(pruned("tiny-llama-random", "blockwise", 0.15, blockwise_attention="closest_ratio").plan.attn_removed)
    assert not any(pruned("tiny-llama-random", "blockwise", 0.15, blockwise_attention="mlp_only").plan.attn_removed)


@pytest.mark.parametrize("arch, method", fast_diagonal(ARCHS, ["taylor", "blockwise", "random"]))
def test_a_uniform_model_loads_in_stock_transformers_without_remote_code(arch, method, ids, tmp_path):
    """Issue 28: every layer keeps one shape, the folder is a stock one (no auto_map, no modeling file, the stock
    config class) and plain from_pretrained gives the in-memory pruned model's logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    result = pruned(arch, method, 0.3, uniform=True)
    original = tiny(arch).config
    hd = getattr(original, "head_dim", None) or original.hidden_size // original.num_attention_heads
    shapes = {(layer.self_attn.q_proj.out_features, layer.self_attn.k_proj.out_features,
               layer.mlp.gate_proj.out_features) for layer in result.model.model.layers}
    assert len(shapes) == 1
    q_rows, kv_rows, width = shapes.pop()
    assert width % 64 == 0 and (kv_rows, width) != (original.num_key_value_heads * hd, original.intermediate_size)
    folder = save_pruned(result.model, tmp_path / "m", tokenizer=result.tokenizer, source_model=arch)
    assert not (folder / "modeling_taylor_tune_pruned.py").exists()
    assert "auto_map" not in (folder / "config.json").read_text()
    stock = AutoModelForCausalLM.from_pretrained(folder)  # trust_remote_code off
    assert type(stock).__name__ == type(tiny(arch)).__name__
    assert type(stock.config) is type(original) and type(AutoConfig.from_pretrained(folder)) is type(original)
    assert (stock.config.num_key_value_heads * hd, stock.config.intermediate_size) == (kv_rows, width)
    assert stock.config.num_attention_heads * hd == q_rows
    torch.testing.assert_close(logits(stock, ids), logits(result.model, ids), rtol=0, atol=1e-5)
    again = load_pruned(folder)  # taylor_tune's own loader takes the stock folder too
    torch.testing.assert_close(logits(again, ids), logits(result.model, ids), rtol=0, atol=1e-5)


def test_a_masked_plan_computes_what_the_pruned_model_computes_and_is_restored(arch, ids):
    """The measured-loss rule scores candidates by masking; the masked model equals the physically pruned one."""
    from taylor_tune.pruning.measured import calibration_loss, masked

    plan = pruned(arch, "random", 0.3).plan
    model = tiny(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with masked(model, plan):
        inside = logits(model, ids)
        loss = calibration_loss(model, ids, 2)
    after = tiny(arch)
    apply_plan(after, plan)
    torch.testing.assert_close(inside, logits(after, ids), rtol=0, atol=1e-5)
    assert loss == pytest.approx(calibration_loss(after, ids, 3), abs=1e-5)  # micro-batches do not change it
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # restored exactly


def test_blockwise_measured_loss_keeps_the_plan_whose_pruned_model_has_the_lowest_loss():
    """Against enumeration: every feasible attention count's plan pruned physically, its calibration loss computed."""
    from taylor_tune.pruning.importance import taylor_criterion
    from taylor_tune.pruning.measured import LOSS_SEQUENCES, calibration_loss
    from taylor_tune.pruning.methods import PlanOptions
    from taylor_tune.pruning.methods.blockwise import block_plan, blockwise_range, feasible_block_counts
    from taylor_tune.pruning.plan import target_params

    result = pruned("tiny-llama", "blockwise", 0.3, blockwise_attention="measured_loss")
    config = build_prune_config(dict(model="tiny-llama", method="blockwise", sparsity=0.3))
    layers = blockwise_range(result.layout, PlanOptions.of(config))
    scores = taylor_criterion(result.importance.scores, result.layout, "taylor")
    losses = {}
    for k, mlp_total in feasible_block_counts(result.layout, layers, target_params(result.layout, 0.3)):
        candidate = block_plan(scores, result.layout, layers, k, mlp_total)
        losses[candidate] = calibration_loss(apply_plan(load_model("tiny-llama"), candidate),
                                             result.calibration_ids[:LOSS_SEQUENCES], 4)
    assert len(losses) > 1 and result.plan == min(losses, key=losses.get)


@pytest.mark.parametrize("removed", [(), (1, 1), (-1,), (4,), (9,), (0, 1, 2, 3), (0, 1, 2, 3, 3)])
def test_removing_no_layer_a_layer_twice_one_out_of_range_or_every_layer_is_refused(removed):
    from taylor_tune.errors import PlanError
    from taylor_tune.pruning.apply import remove_layers
    from tests.helpers import llama

    model = llama(num_hidden_layers=4)
    with pytest.raises(PlanError, match=rf"^depth: cannot remove layers {list(removed)} of 4$".replace("[", r"\[")):
        remove_layers(model, removed)
    assert len(model.model.layers) == model.config.num_hidden_layers == 4  # untouched


def test_only_the_per_layer_lists_of_the_config_are_cut():
    """A config list as long as the layers is per-layer; `architectures` is not, even when it is (two entries, two
    layers)."""
    from taylor_tune.pruning.apply import remove_layers
    from tests.helpers import llama

    model = llama(num_hidden_layers=2, architectures=["LlamaForCausalLM", "LlamaModel"])
    model.config.per_layer_note = ["first", "second"]  # a per-layer list the code cannot know by name
    remove_layers(model, (0,))
    assert model.config.architectures == ["LlamaForCausalLM", "LlamaModel"]
    assert model.config.per_layer_note == ["second"] and model.config.num_hidden_layers == 1


def _with_bias(model, name: str):
    """`model` with a random bias on every layer's `name` projection (o_proj or down_proj), as FLAP's compensation
    leaves it."""
    for layer in model.model.layers:
        linear = layer.self_attn.o_proj if name == "o_proj" else layer.mlp.down_proj
        if linear.bias is None:
            noise = torch.randn(linear.out_features, generator=torch.Generator().manual_seed(1))
            linear.bias = torch.nn.Parameter(noise)
    return model


def _stock_builds(model, name: str) -> bool:
    """Whether the model's stock class, built from its config, gives `name` a bias (the independent answer)."""
    stock = type(model)(model.config)
    layer = stock.model.layers[0]
    return (layer.self_attn.o_proj if name == "o_proj" else layer.mlp.down_proj).bias is not None


OUTPUT_BIAS_CASES = {  # name -> (model builder, the projections given a bias after building)
    "llama": ("llama", {}, ()), "llama, o_proj biased": ("llama", {}, ("o_proj",)),
    "llama, down_proj biased": ("llama", {}, ("down_proj",)),
    "llama attention_bias": ("llama", {"attention_bias": True}, ()),
    "llama attention_bias, down_proj biased": ("llama", {"attention_bias": True}, ("down_proj",)),
    "llama mlp_bias": ("llama", {"mlp_bias": True}, ()),
    "llama mlp_bias, o_proj biased": ("llama", {"mlp_bias": True}, ("o_proj",)),
    "qwen2 attention_bias, o_proj biased": ("qwen2", {"attention_bias": True}, ("o_proj",)),
    "qwen2, down_proj biased": ("qwen2", {}, ("down_proj",)),
}


def _build(kind: str, extra: dict):
    if kind == "llama":
        from tests.helpers import llama
        return llama(**extra)
    return _qwen2(**extra)


@pytest.mark.parametrize("case", sorted(OUTPUT_BIAS_CASES))
def test_an_output_bias_is_found_exactly_where_the_stock_class_would_not_build_it(case):
    from taylor_tune.pruning.apply import _output_bias

    kind, extra, biased = OUTPUT_BIAS_CASES[case]
    model = _build(kind, extra)
    for name in biased:
        _with_bias(model, name)
    want = any(getattr(model.model.layers[0].self_attn if n == "o_proj" else model.model.layers[0].mlp, n).bias
               is not None and not _stock_builds(model, n) for n in ("o_proj", "down_proj"))
    assert _output_bias(model) is want
    assert want == any(n for n in biased if not _stock_builds(model, n))  # the cases hold both answers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_uniform_llama_with_output_biases_saves_stock_with_every_bias_in_its_dtype(tmp_path, dtype, ids):
    """Stock Llama builds every projection's bias or none: the others get zero biases of the model's dtype, so the
    folder loads with no missing or unexpected weight and the same logits."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tests.helpers import llama

    model = _with_bias(llama(), "down_proj").to(dtype)
    ids = ids % 64
    before = logits(model, ids)
    folder = save_pruned(model, tmp_path / "m")
    assert "auto_map" not in (folder / "config.json").read_text()
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        kinds = {weights.get_tensor(k).dtype for k in weights.keys()}
        biases = {k for k in weights.keys() if k.endswith(".bias")}
    assert kinds == {dtype}
    assert len(biases) == 3 * 7  # three layers, seven projections each
    stock, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # the zero biases change nothing (bfloat16: a loaded model keeps its rotary frequencies in float32, and an added
    # zero can round a sum differently: a few ulps)
    torch.testing.assert_close(logits(stock, ids), before, rtol=0, atol=1e-6 if dtype == torch.float32 else 4e-3)


def _qwen2(layers: int = 2, **extra):
    """A Qwen2 built from a config without head_dim (its attention then takes hidden_size / num_attention_heads)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, **extra)
    assert config.to_dict().get("head_dim") is None
    return Qwen2ForCausalLM(config).eval()


def _plan(attn, mlp) -> PrunePlan:
    return PrunePlan("by_hand", tuple(tuple(a) for a in attn), tuple(tuple(m) for m in mlp))


@pytest.mark.parametrize("layers", [1, 2])
def test_a_uniform_cut_of_a_config_without_head_dim_saves_stock_and_reloads_the_same(tmp_path, ids, layers):
    """Half the heads gone: hidden_size / num_attention_heads is then twice the head size, so the saved config must
    say head_dim; one layer as well as two (the first layer's shape is the layout's)."""
    from transformers import AutoModelForCausalLM

    model = apply_plan(_qwen2(layers), _plan([(0,)] * layers, [(1, 5, 7)] * layers))
    ids = ids % 64
    folder = save_pruned(model, tmp_path / "m")
    assert "auto_map" not in (folder / "config.json").read_text()
    stock = AutoModelForCausalLM.from_pretrained(folder)
    assert (stock.config.num_attention_heads, stock.config.num_key_value_heads, stock.config.intermediate_size,
            stock.config.num_hidden_layers) == (2, 1, 21, layers)
    torch.testing.assert_close(logits(stock, ids), logits(model, ids), rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", ["layers of two shapes", "uniform with an output bias"])
def test_a_pruned_folder_loads_in_plain_transformers_with_its_own_modeling_file(tmp_path, ids, case):
    """What a folder that is not stock promises: plain transformers with trust_remote_code builds the class config.json
    names through its auto_map from the copied modeling file, and computes what the pruned model did."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    if case == "layers of two shapes":
        model = apply_plan(_qwen2(), _plan([(0,), ()], [(1,), (2, 3)]))
    else:
        model = _with_bias(apply_plan(_qwen2(), _plan([(1,), (1,)], [(), ()])), "o_proj")
    ids = ids % 64
    folder = save_pruned(model, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    manifest = json.loads((folder / "pruned_layout.json").read_text())
    assert manifest["uniform"] is False and ("pruned_output_bias" in config) is (case != "layers of two shapes")
    plain = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert type(plain).__name__ in config["architectures"] and type(plain).__module__.endswith("taylor_tune_pruned")
    torch.testing.assert_close(logits(plain, ids), logits(model, ids), rtol=0, atol=1e-6)
    # the manifest's layers are the shapes of the weights written (8: the head size)
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        rows = lambda layer, name: weights.get_slice(f"model.layers.{layer}.{name}.weight").get_shape()[0]
        assert manifest["layers"] == [{"num_attention_heads": rows(i, "self_attn.q_proj") // 8,
                                       "num_key_value_heads": rows(i, "self_attn.k_proj") // 8,
                                       "intermediate_size": rows(i, "mlp.gate_proj")} for i in range(2)]


def test_a_pruned_folder_is_written_into_new_parents_and_over_an_earlier_one(tmp_path, ids):
    from tests.helpers import llama

    ids = ids % 64
    first = apply_plan(llama(), _plan([(0,)] * 3, [(0,)] * 3))
    second = apply_plan(llama(), _plan([(1,)] * 3, [(4, 5)] * 3))
    folder = tmp_path / "runs" / "trial_1" / "pruned"
    assert save_pruned(first, folder) == folder
    save_pruned(second, folder)  # a trial run again writes over its folder
    again = load_pruned(folder)
    assert again.config.intermediate_size == 22
    torch.testing.assert_close(logits(again, ids), logits(second, ids), rtol=0, atol=1e-6)


def test_the_zero_biases_of_a_stock_llama_are_made_where_its_weights_are():
    """On the meta device here (a GPU's case without a GPU): each new bias on its weight's device and dtype."""
    from taylor_tune.pruning.apply import _stock_biases
    from tests.helpers import llama

    model = _with_bias(llama(), "o_proj").to(device="meta", dtype=torch.bfloat16)
    _stock_biases(model)
    for layer in model.model.layers:
        for linear in (*(getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                       *(getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))):
            assert (linear.bias.device, linear.bias.dtype) == (linear.weight.device, linear.weight.dtype)
    assert model.config.attention_bias and model.config.mlp_bias


@pytest.mark.parametrize("source, world", [("tiny-llama", "world"), ("smollm2-135m", "real"), (None, "hub")])
def test_a_pruned_folder_takes_the_world_of_the_model_it_was_pruned_from(tmp_path, source, world):
    from taylor_tune.sources.data import world_of
    from tests.helpers import llama

    folder = save_pruned(apply_plan(llama(), _plan([(0,)] * 3, [()] * 3)), tmp_path / "m", source_model=source)
    assert world_of(str(folder)) == world


def test_a_plan_is_applied_where_the_weights_are():
    """On the meta device (a GPU's case without a GPU): every new projection on its old one's device and dtype."""
    from tests.helpers import llama

    model = llama().to(device="meta", dtype=torch.bfloat16)
    apply_plan(model, _plan([(0,), (), (1,)], [(1, 2), (3,), ()]))
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}
    assert [layer.mlp.gate_proj.out_features for layer in model.model.layers] == [22, 23, 24]
    assert [layer.mlp.intermediate_size for layer in model.model.layers] == [22, 23, 24]  # what it says of itself


def test_the_calibration_loss_is_the_mean_cross_entropy_of_the_predicted_tokens(arch, ids):
    """Issue 91, must-show 5: a loss divided by every token of each batch (not only the predicted ones) passed every
    tier. Against transformers' own loss (`labels=`: the mean next-token cross-entropy over the predicted tokens),
    computed in one batch, for micro-batches that split the sequences unevenly."""
    from taylor_tune.pruning.measured import calibration_loss

    model = tiny(arch)
    batch = ids.repeat(5, 1)
    batch[1:] = torch.roll(batch[1:], shifts=1, dims=1)  # other sequences, the same length
    with torch.no_grad():
        reference = float(model(input_ids=batch, labels=batch).loss)
    for micro in (1, 2, 5):
        assert calibration_loss(model, batch, micro) == pytest.approx(reference, rel=1e-5, abs=1e-6)
