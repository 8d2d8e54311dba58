"""Turn a PrunePlan into a physically smaller model, and save it as a pruned folder.

A model whose layers all have one shape (the `uniform` layout) is saved as a stock folder: config.json is the
original's with the smaller `num_attention_heads`, `num_key_value_heads`, `intermediate_size` (and `head_dim` spelled
out), so plain `AutoModelForCausalLM.from_pretrained` and every runtime load it without remote code. Otherwise the
layers have different sizes, which a HF config cannot express (and a uniform shape that the family's config class
refuses, as Gemma's refuses heads that do not divide the hidden size, is written the same way). Such a pruned folder
is what `save_pretrained` writes (safetensors, tied embeddings kept tied) plus, in config.json, `pruned_layout` (per-
layer head counts and MLP width) and an `auto_map` to `modeling_taylor_tune_pruned.py`, a copy of
`pruned_modeling.py` that builds the model at those sizes. Plain transformers and lm-eval's CLI load the folder with
`trust_remote_code=True`; taylor_tune loads it with its own copy of that module (`sources.models.load_pruned`),
running nothing from the folder. `pruned_layout.json` records what the folder was pruned from. No pickle anywhere.

A model with output biases its stock class does not build (FLAP's compensation on o_proj / down_proj) is stock only
where the config can say so: Llama's `attention_bias` and `mlp_bias` give every projection a bias, so a uniform Llama
is saved with zero biases on the others; Qwen2 and Mistral build o_proj and down_proj without a bias whatever the
config says, so theirs are saved as a pruned folder (`pruned_output_bias`), uniform or not.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from taylor_tune.errors import PlanError
from taylor_tune.pruning.experts import remove_experts
from taylor_tune.pruning.groups import (
    attention_groups,
    decoder_layers,
    head_dim,
    kept,
    q_per_kv,
    rows_of,
    sliced_norms,
    sparse_blocks,
)
from taylor_tune.pruning.plan import PrunePlan
from taylor_tune.sources import pruned_modeling
from taylor_tune.sources.data import PRUNED_MANIFEST as MANIFEST
from taylor_tune.sources.families import FAMILIES
from taylor_tune.sources.models import pruned_class_of
from taylor_tune.sources.pruned_modeling import set_layer_shape

MODELING_FILE = "modeling_taylor_tune_pruned.py"


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


def _slice_norm(norm: nn.Module, keep: torch.Tensor) -> None:
    """A whole-projection norm (OLMo-2's q_norm / k_norm) keeping the entries `keep`, in place: its module computes
    over whatever width it is given, so only its weight changes."""
    weight = norm.weight.detach().index_select(0, keep.to(norm.weight.device))
    norm.weight = nn.Parameter(weight, requires_grad=norm.weight.requires_grad)


def shrink_layer(layer: nn.Module, keep_groups: torch.Tensor, keep_channels: torch.Tensor,
                 sliced_norms: bool = False) -> None:
    """Keep the given attention groups and MLP channels of one decoder layer, in place; with `sliced_norms`, the
    q_norm / k_norm entries of the kept rows too (`groups.sliced_norms`)."""
    attn, mlp = layer.self_attn, layer.mlp
    d, rep = head_dim(attn), q_per_kv(attn)
    kv_rows, q_rows = rows_of(keep_groups, d), rows_of(keep_groups, rep * d)
    attn.q_proj = _slice_linear(attn.q_proj, q_rows, 0)
    attn.k_proj = _slice_linear(attn.k_proj, kv_rows, 0)
    attn.v_proj = _slice_linear(attn.v_proj, kv_rows, 0)
    attn.o_proj = _slice_linear(attn.o_proj, q_rows, 1)
    if sliced_norms:
        _slice_norm(attn.q_norm, q_rows)
        _slice_norm(attn.k_norm, kv_rows)
    mlp.gate_proj = _slice_linear(mlp.gate_proj, keep_channels, 0)
    mlp.up_proj = _slice_linear(mlp.up_proj, keep_channels, 0)
    mlp.down_proj = _slice_linear(mlp.down_proj, keep_channels, 1)
    set_layer_shape(layer, int(keep_groups.numel()) * rep, int(keep_groups.numel()), int(keep_channels.numel()))


def remove_layers(model: nn.Module, removed: tuple[int, ...]) -> nn.Module:
    """Remove the decoder layers `removed` from `model` in place and return it: the decoder's ModuleList, each
    attention's `layer_idx` (the KV cache's index), `num_hidden_layers` and every per-layer list of the config
    (`layer_types`) cut to match, so that `save_pretrained` writes a stock config that plain
    `AutoModelForCausalLM.from_pretrained` loads."""
    layers = decoder_layers(model)
    total = len(layers)
    if not removed or len(set(removed)) != len(removed) or not all(0 <= i < total for i in removed) \
            or len(removed) >= total:
        raise PlanError(f"depth: cannot remove layers {list(removed)} of {total}")
    kept = [i for i in range(total) if i not in set(removed)]
    parent = model.model if hasattr(model, "model") else model
    parent.layers = nn.ModuleList(layers[i] for i in kept)
    for index, layer in enumerate(parent.layers):
        layer.self_attn.layer_idx = index
    config = model.config
    for key, value in list(config.to_diff_dict().items()) + [("layer_types", getattr(config, "layer_types", None))]:
        if isinstance(value, (list, tuple)) and len(value) == total and key != "architectures":
            setattr(config, key, [value[i] for i in kept])
    config.num_hidden_layers = len(kept)
    return model


def apply_plan(model: nn.Module, plan: PrunePlan) -> nn.Module:
    """Physically remove the plan's groups, then its whole layers, from `model` (in place) and return it; a
    mixture's plan, its experts (`experts.remove_experts`)."""
    if plan.experts_removed:
        return remove_experts(model, plan.experts_removed)
    norms = sliced_norms(model)
    for layer, attn_removed, mlp_removed in zip(decoder_layers(model), plan.attn_removed, plan.mlp_removed):
        groups, channels = attention_groups(layer.self_attn), layer.mlp.gate_proj.out_features
        if attn_removed or mlp_removed:
            shrink_layer(layer, kept(groups, attn_removed), kept(channels, mlp_removed), norms)
    if plan.layers_removed:  # after the width cuts, whose indices are the original layers'
        remove_layers(model, plan.layers_removed)
    return model


def layer_shapes(model: nn.Module) -> list[dict[str, int]]:
    """Each layer's heads and MLP width; a mixture's sparse layer, its experts' count in place of the width."""
    sparse = sparse_blocks(model)
    return [
        {
            "num_attention_heads": layer.self_attn.q_proj.out_features // head_dim(layer.self_attn),
            "num_key_value_heads": attention_groups(layer.self_attn),
        } | ({"num_experts": sparse[i].experts.gate_up_proj.shape[0]} if i in sparse
             else {"intermediate_size": layer.mlp.gate_proj.out_features})
        for i, layer in enumerate(decoder_layers(model))
    ]


def _output_bias(model: nn.Module) -> bool:
    """Whether an o_proj or down_proj has a bias that the model's stock class would not build."""
    config = model.config
    every = FAMILIES[config.model_type].all_biases  # Llama's: the config can say every projection has one
    stock = {"o_proj": getattr(config, "attention_bias", False) and every,
             "down_proj": getattr(config, "mlp_bias", False) and every}
    return any(layer.self_attn.o_proj.bias is not None and not stock["o_proj"]
               or layer.mlp.down_proj.bias is not None and not stock["down_proj"] for layer in decoder_layers(model))


def _stock_biases(model: nn.Module) -> None:
    """A Llama with output biases made stock, in place: a zero bias on every projection without one (the outputs do
    not change) and `attention_bias` / `mlp_bias` set."""
    for layer in decoder_layers(model):
        _stock_layer_biases(layer)
    model.config.attention_bias = model.config.mlp_bias = True


def _stock_layer_biases(layer: nn.Module) -> None:
    for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                          (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
        for name in names:
            linear = getattr(parent, name)
            if linear.bias is None:
                linear.bias = nn.Parameter(torch.zeros(linear.out_features, device=linear.weight.device,
                                                       dtype=linear.weight.dtype))


def _stock_config_holds(config: dict) -> bool:
    """Whether the family's own config class takes these shapes: Gemma's refuses a head count that does not divide
    the hidden size, even with `head_dim` spelled out (transformers' `validate_architecture`)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "transformers_version")}
    try:
        AutoConfig.for_model(config["model_type"], **fields)
    except (ValueError, StrictDataclassError):
        return False
    return True


def fused_state_dict(model: nn.Module, fused: dict[str, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """The model's state dict with each layer's parts joined back into its family's fused projections (`fused`, as
    `Family.fused` declares them), as the stock class holds them: a stock Phi-3 folder has `qkv_proj` and
    `gate_up_proj`."""
    state = model.state_dict()
    for index in range(len(decoder_layers(model))):
        _join_fused(state, f"model.layers.{index}.", fused)
    return state


def _join_fused(state: dict[str, torch.Tensor], prefix: str, fused: dict[str, tuple[str, ...]]) -> None:
    """One layer's parts (its names under `prefix`) joined into its fused projections, in `state`, in place."""
    for path, parts in fused.items():
        owner = path.split(".")[0]
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{owner}.{part}.{kind}" for part in parts]
            if keys[0] in state:
                state[f"{prefix}{path}.{kind}"] = torch.cat([state.pop(key) for key in keys])


@dataclass(frozen=True)
class FolderKind:
    """How a pruned model is written (the module's docstring): its per-layer shapes, stock or pruned folder, output
    biases made stock (Llama), its family's fused projections joined again (stock folders only)."""

    layout: list[dict[str, int]]
    uniform: bool
    stock_biases: bool
    output_bias: bool
    stock: dict
    fused: dict


def folder_kind(model: nn.Module) -> FolderKind:
    """How the pruned `model` (its weights, or only its shapes on the meta device) is written. A mixture of experts is
    stock (`remove_experts` keeps one count of experts, which its config already says)."""
    layout = layer_shapes(model)
    if sparse_blocks(model):
        return FolderKind(layout, True, False, False, {}, {})
    uniform = all(shape == layout[0] for shape in layout)
    output_bias = _output_bias(model)
    stock_biases = output_bias and uniform and FAMILIES[model.config.model_type].all_biases
    if output_bias and not stock_biases:
        uniform = False
    stock = layout[0] | {"head_dim": head_dim(decoder_layers(model)[0].self_attn)}
    if stock_biases:
        stock |= {"attention_bias": True, "mlp_bias": True}
    if uniform and not _stock_config_holds(json.loads(model.config.to_json_string()) | stock):
        uniform = False  # written as the pruned folder, which loads in transformers all the same (remote code)
    return FolderKind(layout, uniform, stock_biases, output_bias, stock, FAMILIES[model.config.model_type].fused)


def save_pruned(model: nn.Module, directory: str | Path, tokenizer=None, *, source_model: str | None = None) -> Path:
    """Write the pruned folder (see the module docstring), with the tokenizer if given.

    `source_model` (the spec the model was loaded from) is recorded so that tools can tell what it was.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    kind = folder_kind(model)
    if kind.stock_biases:
        _stock_biases(model)
    joined = kind.uniform and kind.fused
    model.save_pretrained(directory, **({"state_dict": fused_state_dict(model, kind.fused)} if joined else {}))
    return _finish(model, directory, kind, tokenizer, source_model)


def _finish(model: nn.Module, directory: Path, kind: FolderKind, tokenizer, source_model: str | None) -> Path:
    """config.json made the folder's kind, the manifest, the modeling file of a pruned folder, the tokenizer."""
    config = json.loads((directory / "config.json").read_text())
    if kind.uniform:  # a stock config: every layer has the shape its fields say
        config |= kind.stock
    else:
        cls = pruned_class_of(config["model_type"]).__name__
        config |= {"pruned_layout": kind.layout, "architectures": [cls],
                   "auto_map": {"AutoModelForCausalLM": f"{MODELING_FILE.removesuffix('.py')}.{cls}"}}
        if kind.output_bias:
            config["pruned_output_bias"] = True
        if kind.fused:  # the folder holds them split, as the pruned class builds them
            config["pruned_fused"] = {path: list(parts) for path, parts in kind.fused.items()}
        shutil.copyfile(pruned_modeling.__file__, directory / MODELING_FILE)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    manifest = {"format": 2, "dtype": dtype, "source_model": source_model, "uniform": kind.uniform,
                "layers": kind.layout}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def save_pruned_streamed(stream, plan: PrunePlan, directory: str | Path, tokenizer=None, *,
                         source_model: str | None = None) -> Path:
    """`save_pruned(apply_plan(model, plan), ...)` for a model held layer by layer (`sources.streaming.Checkpoint`):
    the same folder, tensor for tensor, written one decoder layer at a time, each to a safetensors shard of its own,
    so that no more than one layer's weights are ever loaded. The folder's kind and config come from the plan
    applied to the model's shapes alone (on the meta device)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shapes = apply_plan(stream.skeleton(), plan)
    kind, norms = folder_kind(shapes), sliced_norms(shapes)
    joined = kind.uniform and kind.fused
    kept_layers = [i for i in range(stream.num_layers) if i not in set(plan.layers_removed)]
    head = {k: v for k, v in stream.model.state_dict().items() if not k.startswith("model.layers.")}
    if getattr(shapes.config, "tie_word_embeddings", False):
        head.pop("lm_head.weight", None)  # tied: written once, as save_pretrained does
    names = [f"model-{n + 1:05d}-of-{len(kept_layers) + 1:05d}.safetensors" for n in range(len(kept_layers) + 1)]
    weight_map, total = {}, 0

    def write(number: int, state: dict) -> None:
        nonlocal total
        state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
        save_file(state, directory / names[number], metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(state, names[number]))
        total += sum(v.numel() * v.element_size() for v in state.values())

    write(0, head)
    for number, index in enumerate(kept_layers, start=1):
        layer = stream.layer(index)
        groups, channels = attention_groups(layer.self_attn), layer.mlp.gate_proj.out_features
        if plan.attn_removed[index] or plan.mlp_removed[index]:
            shrink_layer(layer, kept(groups, plan.attn_removed[index]), kept(channels, plan.mlp_removed[index]), norms)
        if kind.stock_biases:
            _stock_layer_biases(layer)
        prefix = f"model.layers.{number - 1}."
        state = {prefix + k: v for k, v in layer.state_dict().items()}
        if joined:
            _join_fused(state, prefix, kind.fused)
        write(number, state)
        stream.release(index)
    index_file = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2) + "\n")
    if kind.stock_biases:
        shapes.config.attention_bias = shapes.config.mlp_bias = True
    shapes.config.architectures = [type(shapes).__name__]
    shapes.config.save_pretrained(directory)
    if getattr(shapes, "generation_config", None) is not None and shapes.can_generate():
        shapes.generation_config.save_pretrained(directory)
    return _finish(shapes, directory, kind, tokenizer, source_model)
