"""Pruned models (every family of `sources.families`) whose layers differ in size, loadable by plain transformers.

A HF config has one head count and one MLP width for every layer; a pruned model has its own per layer. This
file builds the stock model from the config and shrinks each layer's projections to `config.pruned_layout`
(one {num_attention_heads, num_key_value_heads, intermediate_size} per layer) before the weights load.

It travels inside every pruned folder as `modeling_taylor_tune_pruned.py`, named by the config's `auto_map`, so
    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
and `lm_eval --model hf --model_args pretrained=folder,trust_remote_code=True` load the folder without
taylor_tune installed. It must therefore import nothing but torch and transformers. taylor_tune itself
loads pruned folders through this module directly (`models.load_pruned`): no code from the folder runs.
"""

from __future__ import annotations

from torch import nn
from transformers import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    GraniteForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    Olmo2ForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)


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


def shrink_to_layout(model: nn.Module, layout: list[dict], output_bias: bool = False, sliced_norms: bool = False
                     ) -> None:
    """Replace each layer's projections by empty ones of the pruned sizes (the weights are loaded afterwards).
    `output_bias` (config.pruned_output_bias): o_proj and down_proj carry a bias (FLAP's compensation).
    `sliced_norms`: q_norm / k_norm span the whole projections (OLMo-2) and shrink with them."""
    layers = model.model.layers
    if len(layout) != len(layers):
        raise ValueError(f"pruned_layout lists {len(layout)} layers, the config has {len(layers)}")
    for layer, shape in zip(layers, layout):
        attn, mlp = layer.self_attn, layer.mlp
        q_rows, kv_rows = shape["num_attention_heads"] * attn.head_dim, shape["num_key_value_heads"] * attn.head_dim
        attn.q_proj = _empty_like(attn.q_proj, out_features=q_rows)
        attn.k_proj = _empty_like(attn.k_proj, out_features=kv_rows)
        attn.v_proj = _empty_like(attn.v_proj, out_features=kv_rows)
        attn.o_proj = _empty_like(attn.o_proj, in_features=q_rows, bias=output_bias)
        mlp.gate_proj = _empty_like(mlp.gate_proj, out_features=shape["intermediate_size"])
        mlp.up_proj = _empty_like(mlp.up_proj, out_features=shape["intermediate_size"])
        mlp.down_proj = _empty_like(mlp.down_proj, in_features=shape["intermediate_size"], bias=output_bias)
        if sliced_norms:
            for norm, rows in ((attn.q_norm, q_rows), (attn.k_norm, kv_rows)):
                norm.weight = nn.Parameter(norm.weight.new_empty(rows))
        set_layer_shape(layer, shape["num_attention_heads"], shape["num_key_value_heads"], shape["intermediate_size"])


class PrunedLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        shrink_to_layout(self, config.pruned_layout, getattr(config, "pruned_output_bias", False))


class PrunedQwen2ForCausalLM(Qwen2ForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        shrink_to_layout(self, config.pruned_layout, getattr(config, "pruned_output_bias", False))


class PrunedMistralForCausalLM(MistralForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        shrink_to_layout(self, config.pruned_layout, getattr(config, "pruned_output_bias", False))


class PrunedQwen3ForCausalLM(Qwen3ForCausalLM):  # q_norm / k_norm act per head over head_dim: kept as they are
    def __init__(self, config):
        super().__init__(config)
        shrink_to_layout(self, config.pruned_layout, getattr(config, "pruned_output_bias", False))


class PrunedGraniteForCausalLM(GraniteForCausalLM):  # its multipliers come with the config
    def __init__(self, config):
        super().__init__(config)
        shrink_to_layout(self, config.pruned_layout, getattr(config, "pruned_output_bias", False))


class PrunedOlmo2ForCausalLM(Olmo2ForCausalLM):  # q_norm / k_norm span the projections: shrunk with them
    def __init__(self, config):
        super().__init__(config)
        shrink_to_layout(self, config.pruned_layout, getattr(config, "pruned_output_bias", False), sliced_norms=True)


class PrunedGemma2ForCausalLM(Gemma2ForCausalLM):  # head_dim, scalar, caps and windows come with the config
    def __init__(self, config):
        super().__init__(config)
        shrink_to_layout(self, config.pruned_layout, getattr(config, "pruned_output_bias", False))


class PrunedGemma3ForCausalLM(Gemma3ForCausalLM):  # its per-head q_norm / k_norm are shared: kept as they are
    def __init__(self, config):
        super().__init__(config)
        shrink_to_layout(self, config.pruned_layout, getattr(config, "pruned_output_bias", False))


PRUNED_CLASSES = {"llama": PrunedLlamaForCausalLM, "qwen2": PrunedQwen2ForCausalLM, "mistral": PrunedMistralForCausalLM,
                  "qwen3": PrunedQwen3ForCausalLM, "granite": PrunedGraniteForCausalLM,
                  "olmo2": PrunedOlmo2ForCausalLM, "gemma2": PrunedGemma2ForCausalLM,
                  "gemma3_text": PrunedGemma3ForCausalLM}
