"""Pruned models (every dense family of `sources.families`) whose layers differ in size, loadable by plain
transformers.

A HF config has one head count and one MLP width for every layer; a pruned model has its own per layer. This
file builds the stock model from the config and shrinks each layer's projections to `config.pruned_layout`
(one {num_attention_heads, num_key_value_heads, intermediate_size} per layer) before the weights load. The pruned
class of a family is made from its stock class (`pruned_class`): `Pruned<X>ForCausalLM` is `PrunedModel` over
transformers' `<X>ForCausalLM`, made when first asked for (a module `__getattr__`), so that a new family needs no
class here.

It travels inside every pruned folder as `modeling_taylor_tune_pruned.py`, named by the config's `auto_map`, so
    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
and `lm_eval --model hf --model_args pretrained=folder,trust_remote_code=True` load the folder without
taylor_tune installed. It must therefore import nothing but torch and transformers. taylor_tune itself
loads pruned folders through this module directly (`models.load_pruned`): no code from the folder runs.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers.models.phi3 import modeling_phi3


class Phi3SplitAttention(modeling_phi3.Phi3Attention):
    """Phi-3's attention with `qkv_proj` held as `q_proj`, `k_proj`, `v_proj` (its rows, in that order): each layer
    then has its own head counts, where the stock forward reads the query width from the shared config."""

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key, value = (proj(hidden_states).view(shape).transpose(1, 2)
                             for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = position_embeddings
        query, key = modeling_phi3.apply_rotary_pos_emb(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        interface = modeling_phi3.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, modeling_phi3.eager_attention_forward)
        output, weights = interface(self, query, key, value, attention_mask,
                                    dropout=0.0 if not self.training else self.attention_dropout,
                                    scaling=self.scaling, sliding_window=getattr(self.config, "sliding_window", None),
                                    **kwargs)
        return self.o_proj(output.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


class Phi3SplitMLP(modeling_phi3.Phi3MLP):
    """Phi-3's MLP with `gate_up_proj` held as `gate_proj`, `up_proj` (the gate's rows first, as the stock forward
    splits them)."""

    def forward(self, hidden_states):
        return self.down_proj(self.up_proj(hidden_states) * self.activation_fn(self.gate_proj(hidden_states)))


SPLIT_CLASSES = {modeling_phi3.Phi3Attention: Phi3SplitAttention, modeling_phi3.Phi3MLP: Phi3SplitMLP}


def split_fused(model: nn.Module, fused: dict) -> None:
    """Each decoder layer's fused projections held as their parts, in place (`fused`: a projection's path in the
    layer -> its parts, in row order, as the family declares it): the same rows, so the same function. A part's size
    is what Llama's projection of that name has under the model's config. The module keeps its attributes and only
    its forward changes (its class becomes the split one); a layer already split is left as it is."""
    config = model.config
    size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rows = {"q_proj": config.num_attention_heads * size, "k_proj": config.num_key_value_heads * size,
            "v_proj": config.num_key_value_heads * size, "gate_proj": config.intermediate_size,
            "up_proj": config.intermediate_size}
    for layer in model.model.layers:
        for path, parts in fused.items():
            owner_name, name = path.split(".")
            owner = getattr(layer, owner_name)
            if name not in owner._modules:
                continue
            linear = owner._modules.pop(name)
            sizes = [rows[part] for part in parts]
            if sum(sizes) != linear.out_features:
                raise ValueError(f"{path} has {linear.out_features} rows, its parts {dict(zip(parts, sizes))}")
            biases = linear.bias.split(sizes) if linear.bias is not None else [None] * len(parts)
            for part, weight, bias in zip(parts, linear.weight.split(sizes), biases):
                new = _empty_like(linear, out_features=weight.shape[0])
                with torch.no_grad():
                    new.weight.copy_(weight)
                    if bias is not None:
                        new.bias.copy_(bias)
                new.requires_grad_(linear.weight.requires_grad)
                setattr(owner, part, new)
            owner.__class__ = SPLIT_CLASSES[type(owner)]


def set_layer_shape(layer: nn.Module, heads: int, kv_heads: int, width: int) -> None:
    """The descriptive attributes of a resized layer (forward infers the sizes from the projections)."""
    layer.mlp.intermediate_size = width
    for name in ("num_heads", "num_attention_heads"):
        if hasattr(layer.self_attn, name):
            setattr(layer.self_attn, name, heads)
    if hasattr(layer.self_attn, "num_key_value_heads"):
        layer.self_attn.num_key_value_heads = kv_heads


def _empty_like(linear: nn.Linear, out_features: int | None = None, in_features: int | None = None,
                bias: bool = False) -> nn.Linear:
    return nn.Linear(in_features or linear.in_features, out_features or linear.out_features,
                     bias=bias or linear.bias is not None, device=linear.weight.device, dtype=linear.weight.dtype)


def shrink_to_layout(model: nn.Module, layout: list[dict], output_bias: bool = False) -> None:
    """Replace each layer's projections by empty ones of the pruned sizes (the weights are loaded afterwards).
    `output_bias` (config.pruned_output_bias): o_proj and down_proj carry a bias (FLAP's compensation). A q_norm /
    k_norm as wide as its whole projection (OLMo-2's) shrinks with it; one as wide as a head (Qwen3's, shared by
    every head) is kept as it is."""
    layers = model.model.layers
    if len(layout) != len(layers):
        raise ValueError(f"pruned_layout lists {len(layout)} layers, the config has {len(layers)}")
    for layer, shape in zip(layers, layout):
        attn, mlp = layer.self_attn, layer.mlp
        q_rows, kv_rows = shape["num_attention_heads"] * attn.head_dim, shape["num_key_value_heads"] * attn.head_dim
        # a norm as wide as its whole projection (OLMo-2's) shrinks with it; one a head wide (Qwen3's) is every head's
        sliced = {norm: rows for norm, proj, rows in ((getattr(attn, "q_norm", None), attn.q_proj, q_rows),
                                                     (getattr(attn, "k_norm", None), attn.k_proj, kv_rows))
                  if norm is not None and norm.weight.shape[0] == proj.out_features != attn.head_dim}
        attn.q_proj = _empty_like(attn.q_proj, out_features=q_rows)
        attn.k_proj = _empty_like(attn.k_proj, out_features=kv_rows)
        attn.v_proj = _empty_like(attn.v_proj, out_features=kv_rows)
        attn.o_proj = _empty_like(attn.o_proj, in_features=q_rows, bias=output_bias)
        mlp.gate_proj = _empty_like(mlp.gate_proj, out_features=shape["intermediate_size"])
        mlp.up_proj = _empty_like(mlp.up_proj, out_features=shape["intermediate_size"])
        mlp.down_proj = _empty_like(mlp.down_proj, in_features=shape["intermediate_size"], bias=output_bias)
        for norm, rows in sliced.items():
            norm.weight = nn.Parameter(norm.weight.new_empty(rows))
        set_layer_shape(layer, shape["num_attention_heads"], shape["num_key_value_heads"], shape["intermediate_size"])


class PrunedModel:
    """Over a family's stock class (`pruned_class`): the stock model built from the config, its fused projections
    held split (`config.pruned_fused`, Phi-3's) and each layer shrunk to `config.pruned_layout`."""

    def __init__(self, config):
        super().__init__(config)
        if getattr(config, "pruned_fused", None):
            split_fused(self, config.pruned_fused)
        shrink_to_layout(self, config.pruned_layout, getattr(config, "pruned_output_bias", False))


def pruned_class(stock: type) -> type:
    """`Pruned<stock's name>`: the stock causal-LM class with its layers shrunk to the folder's layout; one class per
    stock class (kept in this module under its name, which a pruned folder's `auto_map` names)."""
    name = f"Pruned{stock.__name__}"
    made = globals().get(name)
    if made is None or stock not in made.__mro__:
        made = type(name, (PrunedModel, stock), {"__module__": __name__})
        globals()[name] = made
    return made


def __getattr__(name: str) -> type:
    """`Pruned<X>ForCausalLM` for transformers' `<X>ForCausalLM` (how a pruned folder's `auto_map` finds it)."""
    stock = getattr(transformers, name.removeprefix("Pruned"), None) if name.startswith("Pruned") else None
    if not isinstance(stock, type):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return pruned_class(stock)
