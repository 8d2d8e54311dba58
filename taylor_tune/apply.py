"""Turn a PrunePlan into a physically smaller model, and save / load such models.

Pruned layers have different sizes, which a HF config cannot express, so a pruned model is saved as its
original config + `pruned_layout.json` (per-layer head counts and MLP width) + `model.safetensors`.
Loading rebuilds the architecture without initialising weights, shrinks each layer to the manifest and
loads the tensors strictly. No pickle anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_model as load_safetensors
from safetensors.torch import save_model as save_safetensors
from torch import nn

from taylor_tune.errors import ModelLoadError
from taylor_tune.groups import attention_groups, decoder_layers, head_dim, q_per_kv
from taylor_tune.plan import PrunePlan

MANIFEST = "pruned_layout.json"
WEIGHTS = "model.safetensors"


def _slice_linear(linear: nn.Linear, keep: torch.Tensor, dim: int) -> nn.Linear:
    """A new Linear keeping `keep` along the output (dim=0) or input (dim=1) features."""
    weight = linear.weight.detach().index_select(dim, keep.to(linear.weight.device))
    out_features, in_features = weight.shape
    bias = linear.bias is not None
    new = nn.Linear(in_features, out_features, bias=bias, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        if bias:
            b = linear.bias.detach()
            new.bias.copy_(b.index_select(0, keep.to(b.device)) if dim == 0 else b)
    new.weight.requires_grad_(linear.weight.requires_grad)
    return new


def _kept(size: int, removed: tuple[int, ...]) -> torch.Tensor:
    mask = torch.ones(size, dtype=torch.bool)
    mask[list(removed)] = False
    return mask.nonzero().flatten()


def shrink_layer(layer: nn.Module, keep_groups: torch.Tensor, keep_channels: torch.Tensor) -> None:
    """Keep the given attention groups and MLP channels of one decoder layer, in place."""
    attn, mlp = layer.self_attn, layer.mlp
    d, rep = head_dim(attn), q_per_kv(attn)
    kv_rows = (keep_groups[:, None] * d + torch.arange(d)).flatten()
    q_rows = (keep_groups[:, None] * rep * d + torch.arange(rep * d)).flatten()
    attn.q_proj = _slice_linear(attn.q_proj, q_rows, 0)
    attn.k_proj = _slice_linear(attn.k_proj, kv_rows, 0)
    attn.v_proj = _slice_linear(attn.v_proj, kv_rows, 0)
    attn.o_proj = _slice_linear(attn.o_proj, q_rows, 1)
    mlp.gate_proj = _slice_linear(mlp.gate_proj, keep_channels, 0)
    mlp.up_proj = _slice_linear(mlp.up_proj, keep_channels, 0)
    mlp.down_proj = _slice_linear(mlp.down_proj, keep_channels, 1)
    # Forward infers head counts from the projection sizes; keep the descriptive attributes true as well.
    mlp.intermediate_size = int(keep_channels.numel())
    for name in ("num_heads", "num_attention_heads"):
        if hasattr(attn, name):
            setattr(attn, name, int(keep_groups.numel()) * rep)
    if hasattr(attn, "num_key_value_heads"):
        attn.num_key_value_heads = int(keep_groups.numel())


def apply_plan(model: nn.Module, plan: PrunePlan) -> nn.Module:
    """Physically remove the plan's groups from `model` (in place) and return it."""
    for layer, attn_removed, mlp_removed in zip(decoder_layers(model), plan.attn_removed, plan.mlp_removed):
        groups, channels = attention_groups(layer.self_attn), layer.mlp.gate_proj.out_features
        if attn_removed or mlp_removed:
            shrink_layer(layer, _kept(groups, attn_removed), _kept(channels, mlp_removed))
    return model


def layer_shapes(model: nn.Module) -> list[dict[str, int]]:
    return [
        {
            "num_attention_heads": layer.self_attn.q_proj.out_features // head_dim(layer.self_attn),
            "num_key_value_heads": attention_groups(layer.self_attn),
            "intermediate_size": layer.mlp.gate_proj.out_features,
        }
        for layer in decoder_layers(model)
    ]


def save_pruned(model: nn.Module, directory: str | Path, tokenizer=None, *, source_model: str | None = None) -> Path:
    """Write config.json, pruned_layout.json, model.safetensors (and the tokenizer if given).

    `source_model` (the spec the model was loaded from) is recorded so that tools can tell what it was.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    manifest = {"format": 1, "dtype": dtype, "source_model": source_model, "layers": layer_shapes(model)}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
    save_safetensors(model, str(directory / WEIGHTS))
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def load_pruned(directory: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
    """Rebuild a model saved by `save_pruned`; logits equal the saved model's exactly (same dtype)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        config = AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"model: {directory} is not a readable pruned model: {error}") from None
    saved_dtype = getattr(torch, manifest["dtype"])
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=saved_dtype)
    if len(manifest["layers"]) != len(decoder_layers(model)):
        raise ModelLoadError(f"model: {directory}/{MANIFEST} lists {len(manifest['layers'])} layers, config has {len(decoder_layers(model))}")
    for layer, shape in zip(decoder_layers(model), manifest["layers"]):
        # Which indices are kept does not matter: every tensor is overwritten by the load below.
        shrink_layer(layer, torch.arange(shape["num_key_value_heads"]), torch.arange(shape["intermediate_size"]))
    load_safetensors(model, str(directory / WEIGHTS), strict=True)
    return model.to(device=device, dtype=dtype or saved_dtype).eval()
