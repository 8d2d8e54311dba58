"""What a group is in Llama, Qwen2 and Mistral decoder layers, and how to reduce per-parameter values to groups.

Attention group g of a layer = key/value head g with the q_per_kv query heads that share it (HF's GQA
maps query head h to key/value head h // q_per_kv): rows [g*q_per_kv*d, (g+1)*q_per_kv*d) of q_proj, rows
[g*d, (g+1)*d) of k_proj and v_proj (and those entries of their biases, as in Qwen2), and the same columns
of o_proj as q_proj's rows. MLP channel c = row c of gate_proj and up_proj (and their biases if any),
column c of down_proj. Embeddings, lm_head, norms and output biases of o_proj/down_proj are never pruned, except
the head norms of a family that normalises the whole q and k projections (OLMo-2's `q_norm` / `k_norm`,
`Family.head_norm == "sliced"`): their entries of the group's q and k rows belong to the group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from taylor_tune.pruning.plan import ModelLayout
from taylor_tune.sources.families import FAMILIES

ATTN_ROWS = ("q_proj", "k_proj", "v_proj")  # grouped by output rows
MLP_ROWS = ("gate_proj", "up_proj")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def head_dim(attn: nn.Module) -> int:
    return attn.head_dim


def attention_groups(attn: nn.Module) -> int:
    """Key/value heads currently in this attention module."""
    return attn.k_proj.out_features // attn.head_dim


def q_per_kv(attn: nn.Module) -> int:
    return attn.q_proj.out_features // attn.k_proj.out_features


def kept(size: int, removed) -> torch.Tensor:
    """The indices 0..size-1 that are not in `removed`, in order."""
    mask = torch.ones(size, dtype=torch.bool)
    mask[list(removed)] = False
    return mask.nonzero().flatten()


def rows_of(groups: torch.Tensor, width: int) -> torch.Tensor:
    """The rows of the given groups (each `width` consecutive rows: a k/v head of head_dim, a group's query heads of
    q_per_kv x head_dim), in order: what pruning keeps of a projection, and what a masked norm computes over."""
    return (groups[:, None] * width + torch.arange(width, device=groups.device)).flatten()


def sliced_norms(model: nn.Module) -> bool:
    """Whether the model's `q_norm` / `k_norm` span the whole projections, sliced with the heads (its family says)."""
    family = FAMILIES.get(getattr(model.config, "model_type", ""))
    return family is not None and family.head_norm == "sliced"


def prunable_parameters(model: nn.Module) -> list[list[tuple[str, nn.Parameter]]]:
    """Per layer, the (name, parameter) pairs that belong to groups: their gradients make the importance."""
    norms = sliced_norms(model)
    return [layer_parameters(layer, norms) for layer in decoder_layers(model)]


def layer_parameters(layer: nn.Module, norms: bool) -> list[tuple[str, nn.Parameter]]:
    """`prunable_parameters` of one decoder layer; `norms`: its family's head norms are sliced (`sliced_norms`)."""
    params = []
    for name in ATTN_ROWS:
        proj = getattr(layer.self_attn, name)
        params.append((f"self_attn.{name}.weight", proj.weight))
        if proj.bias is not None:
            params.append((f"self_attn.{name}.bias", proj.bias))
    if norms:
        params += [(f"self_attn.{n}.weight", getattr(layer.self_attn, n).weight) for n in ("q_norm", "k_norm")]
    params.append(("self_attn.o_proj.weight", layer.self_attn.o_proj.weight))
    for name in MLP_ROWS:
        proj = getattr(layer.mlp, name)
        params.append((f"mlp.{name}.weight", proj.weight))
        if proj.bias is not None:
            params.append((f"mlp.{name}.bias", proj.bias))
    params.append(("mlp.down_proj.weight", layer.mlp.down_proj.weight))
    return params


def experts_of(model: nn.Module):
    """The model's family's `Experts` (sources.families), None for a dense model."""
    family = FAMILIES.get(getattr(model.config, "model_type", ""))
    return None if family is None else family.experts


def sparse_blocks(model: nn.Module) -> dict[int, nn.Module]:
    """{layer index: its sparse block} of a mixture of experts (the layers whose block holds experts: Qwen3-MoE's
    `mlp_only_layers` are dense); empty for a dense model."""
    moe = experts_of(model)
    if moe is None:
        return {}
    blocks = {i: getattr(layer, moe.block, None) for i, layer in enumerate(decoder_layers(model))}
    return {i: block for i, block in blocks.items() if hasattr(block, "experts")}


def expert_parameters(block: nn.Module, router: str) -> list[nn.Parameter]:
    """A sparse block's parameters that belong to its experts, expert e being index e of each (its router row, its
    gate/up rows and its down projection): what expert pruning removes and what its Taylor score sums."""
    return [getattr(block, router).weight, block.experts.gate_up_proj, block.experts.down_proj]


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def describe_layout(model: nn.Module) -> ModelLayout:
    """Group counts and sizes of a model whose layers all have the same shape (an unpruned model)."""
    layers = decoder_layers(model)
    first = layers[0]
    d, rep = head_dim(first.self_attn), q_per_kv(first.self_attn)
    hidden = first.self_attn.q_proj.in_features
    # q (rep*d rows) + k (d) + v (d) rows of `hidden` inputs, o_proj's rep*d columns, plus bias entries
    q_bias = d * rep if first.self_attn.q_proj.bias is not None else 0
    kv_bias = d * sum(getattr(first.self_attn, n).bias is not None for n in ("k_proj", "v_proj"))
    norms = (rep * d + d) if sliced_norms(model) else 0
    attn_group_params = (2 * rep * d + 2 * d) * hidden + q_bias + kv_bias + norms
    sparse = sparse_blocks(model)
    dense = [layer.mlp for i, layer in enumerate(layers) if i not in sparse]
    mlp_bias = sum(getattr(dense[0], n).bias is not None for n in MLP_ROWS) if dense else 0
    mlp_channel_params = 3 * hidden + mlp_bias
    experts = {}
    if sparse:
        moe = experts_of(model)
        block = next(iter(sparse.values()))
        experts = dict(experts=tuple(len(getattr(sparse[i], moe.router).weight) if i in sparse else 0
                                     for i in range(len(layers))),
                       expert_params=sum(p[0].numel() for p in expert_parameters(block, moe.router)),
                       top_k=model.config.num_experts_per_tok)
    return ModelLayout(
        attn_groups=tuple(attention_groups(l.self_attn) for l in layers),
        mlp_channels=tuple(0 if i in sparse else l.mlp.gate_proj.out_features for i, l in enumerate(layers)),
        attn_group_params=attn_group_params,
        mlp_channel_params=mlp_channel_params,
        layer_params=tuple(count_parameters(l) for l in layers),
        total_params=count_parameters(model),
        **experts,
    )


def reduce_to_groups(
    model: nn.Module, value: Callable[[str, nn.Parameter], torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Sum an elementwise value (e.g. |w * g|) over each group's parameters: (attn[l] [G], mlp[l] [C]) in fp32.

    Works on pruned models too (each layer read at its own size).
    """
    sums = [reduce_layer(layer, params, value) for layer, params in zip(decoder_layers(model),
                                                                         prunable_parameters(model))]
    return [a for a, _ in sums], [c for _, c in sums]


def reduce_layer(layer: nn.Module, params: list[tuple[str, nn.Parameter]],
                 value: Callable[[str, nn.Parameter], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`reduce_to_groups` of one decoder layer and its prunable parameters (`prunable_parameters`' entry for it):
    (attn [G], mlp [C]) in fp32."""
    attn = layer.self_attn
    groups, d, rep = attention_groups(attn), head_dim(attn), q_per_kv(attn)
    a = torch.zeros(groups, dtype=torch.float32, device=attn.q_proj.weight.device)
    c = torch.zeros(layer.mlp.gate_proj.out_features, dtype=torch.float32, device=a.device)
    for name, param in params:
        v = value(name, param).float()
        if name.startswith(("self_attn.q_proj", "self_attn.q_norm")):
            a += v.reshape(groups, rep * d, -1).sum(dim=(1, 2))
        elif name.startswith(("self_attn.k_proj", "self_attn.v_proj", "self_attn.k_norm")):
            a += v.reshape(groups, d, -1).sum(dim=(1, 2))
        elif name == "self_attn.o_proj.weight":
            a += v.reshape(v.shape[0], groups, rep * d).sum(dim=(0, 2))
        elif name.startswith(("mlp.gate_proj", "mlp.up_proj")):
            c += v.reshape(v.shape[0], -1).sum(dim=1)
        elif name == "mlp.down_proj.weight":
            c += v.sum(dim=0)
        else:  # a parameter listed by prunable_parameters but not mapped: a bug, not user input
            raise AssertionError(name)
    return a, c
