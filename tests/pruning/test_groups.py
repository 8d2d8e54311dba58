"""The layout's group sizes against what removing a group really removes: count the parameters of a model, cut one
group (or one channel, or one layer) with apply_plan, count again. Also for the bias layouts no shipped model has
(Llama's `attention_bias` and `mlp_bias`), and tied embeddings counted once."""

import copy

import pytest

from taylor_tune.pruning.apply import apply_plan
from taylor_tune.pruning.groups import count_parameters, describe_layout, prunable_parameters
from taylor_tune.pruning.plan import PrunePlan
from tests.helpers import ARCHS, llama, tiny

MODELS = {name: (lambda name=name: tiny(name)) for name in ARCHS} | {
    "llama, attention and MLP biases": lambda: llama(attention_bias=True, mlp_bias=True),
    "llama, MLP biases only": lambda: llama(mlp_bias=True),
    "llama, tied embeddings": lambda: llama(tie_word_embeddings=True),
}


def by_hand(model) -> int:
    """Every parameter's elements, a tensor shared by two modules once (as `model.parameters()` yields it)."""
    seen, total = set(), 0
    for _, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


@pytest.mark.parametrize("name", MODELS)
def test_each_group_size_is_what_removing_one_group_removes(name):
    model = MODELS[name]()
    layout = describe_layout(model)
    layers = layout.num_layers
    assert layout.total_params == count_parameters(model) == by_hand(model)
    assert sum(layout.layer_params) == sum(by_hand(layer) for layer in model.model.layers)
    none = ((),) * layers
    cuts = {
        "attn": (PrunePlan("x", ((),) * (layers - 1) + ((1,),), none), layout.attn_group_params),
        "mlp": (PrunePlan("x", none, ((),) * (layers - 1) + ((0, 5),)), 2 * layout.mlp_channel_params),
        "layer": (PrunePlan("x", none, none, (1,)), layout.layer_params[1]),
    }
    for kind, (plan, size) in cuts.items():
        plan.validate(layout)
        assert plan.params_removed(layout) == size, kind
        cut = apply_plan(copy.deepcopy(model), plan)
        assert by_hand(model) - by_hand(cut) == size, kind


@pytest.mark.parametrize("name", ["llama, attention and MLP biases", "tiny-qwen2-random"])
def test_every_bias_of_a_group_is_one_of_its_parameters(name):
    """The biases a group owns are the ones whose gradient makes its importance: q, k, v (Qwen2 and Llama's
    attention_bias), gate and up (mlp_bias); never o_proj's or down_proj's, which no group owns."""
    model = MODELS[name]()
    first = model.model.layers[0]
    names = [n for n, _ in prunable_parameters(model)[0]]
    owned = {f"{part}.{proj}.bias" for part, projs in (("self_attn", ("q_proj", "k_proj", "v_proj")),
                                                        ("mlp", ("gate_proj", "up_proj")))
             for proj in projs if getattr(getattr(first, part), proj).bias is not None}
    assert {n for n in names if n.endswith(".bias")} == owned and owned
    assert len(names) == len(set(names))
    assert all(dict(first.named_parameters())[n] is p for n, p in prunable_parameters(model)[0])


def test_group_sums_are_fp32_whatever_torchs_default_dtype_and_the_value_sees_each_parameter_by_name():
    """A notebook that set torch's default dtype to bf16 still gets fp32 sums, equal to the ones under the fp32
    default; the value function is called once per prunable parameter with that parameter's own name."""
    import torch

    from taylor_tune.pruning.groups import reduce_to_groups

    model = tiny("tiny-llama-random")
    seen = []

    def value(name, param):
        seen.append((name, id(param)))
        return param.detach().abs()

    reference = reduce_to_groups(model, value)
    assert seen == [(name, id(p)) for params in prunable_parameters(model) for name, p in params]
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        under_bf16 = reduce_to_groups(model, lambda _, p: p.detach().abs())
    finally:
        torch.set_default_dtype(saved)
    for sums, expected in zip(under_bf16, reference):
        assert all(s.dtype == torch.float32 and torch.equal(s, e) for s, e in zip(sums, expected))


def test_a_one_layer_model_is_described_by_its_one_layer():
    """The group sizes read from a model's layers are the same with one layer as with three, and its one layer's
    parameters and the model's are counted by hand."""
    model = llama(num_hidden_layers=1)
    one, three = describe_layout(model), describe_layout(llama())
    assert (one.attn_group_params, one.mlp_channel_params) == (three.attn_group_params, three.mlp_channel_params)
    assert (one.attn_groups, one.mlp_channels) == ((2,), (24,))
    assert one.layer_params == (by_hand(model.model.layers[0]),) and one.total_params == by_hand(model)
