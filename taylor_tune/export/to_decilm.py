"""A pruned model as a DeciLM folder (`export --format decilm`): the per-layer format vLLM (`nemotron_nas`),
TensorRT-LLM (NemotronNas), SGLang and llama.cpp's own converter (`conversion/deci.py`) read.

`config.json` is the Llama config with `architectures: ["DeciLMForCausalLM"]`, `model_type: "nemotron-nas"` and one
`block_configs` entry per layer: `attention.n_heads_in_group` (query heads per key/value head: the query heads are
global in that format, so a layer keeps every one) and `ffn.ffn_mult`, which the readers turn into a width as
ceil256(int(2 * ffn_mult * hidden / 3)): each kept width must be a multiple of 256, and `ffn_mult` is chosen so that
the readers' own formula gives it back exactly. The weights keep Llama's names (safetensors). What the format cannot
hold is refused in one line naming the settings that prune a servable model: a family whose layers hold more than
Llama's graph (`Family.gguf_free` false: the same graph llama.cpp's `deci` runs), biases (Qwen2's), query heads
removed, a head size other than hidden / heads, a width that is not a multiple of 256.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from torch import nn

from taylor_tune.config import SERVABLE_TILE
from taylor_tune.export import configuration_decilm
from taylor_tune.export.choose import Chosen, ExportError
from taylor_tune.pruning.groups import decoder_layers, head_dim
from taylor_tune.pruning.prune import meta_model
from taylor_tune.sources.families import FAMILIES
from taylor_tune.storage.folder import trial_file

FFN_TILE = SERVABLE_TILE
CONFIG_FILE = "configuration_decilm.py"  # the folder's configuration class (`configuration_decilm`), for AutoConfig
SERVABLE = ("prune with servable: true (the attention kept, every MLP width a multiple of 256) on a llama or mistral "
            "model, or by depth")


def readers_width(ffn_mult: float, hidden: int) -> int:
    """The width DeciLM's readers build from `ffn_mult` (llama.cpp's conversion/deci.py, vLLM's nemotron_nas)."""
    width = int(2 * ffn_mult * hidden / 3)
    return width if width % FFN_TILE == 0 else width + FFN_TILE - width % FFN_TILE


def ffn_mult(width: int, hidden: int) -> float:
    """The `ffn_mult` the readers turn back into `width` (a multiple of 256)."""
    mult = 3 * width / (2 * hidden)
    if readers_width(mult, hidden) != width:
        raise ExportError(f"--format decilm: no ffn_mult gives the width {width} back (hidden {hidden})")
    return mult


def servable_problem(model: nn.Module, *, shapes: bool = True) -> str | None:
    """Why the model cannot be written as DeciLM, or None; without `shapes`, what its family and config decide
    alone (its graph, head size and biases: the unpruned model, on the meta device, answers for a trial's)."""
    config, layers = model.config, decoder_layers(model)
    heads = config.num_attention_heads
    if not FAMILIES[config.model_type].gguf_free:  # its layers hold more than Llama's graph, which DeciLM's is
        llama_graph = ", ".join(t for t, f in FAMILIES.items() if f.gguf_free)
        return f"a {config.model_type} model (DeciLM's layers are Llama's: {llama_graph})"
    if head_dim(layers[0].self_attn) * heads != config.hidden_size:
        return "its head size is not hidden / heads, which DeciLM's readers assume"
    for index, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        if any(p.bias is not None for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                                            mlp.up_proj, mlp.down_proj)):
            return f"layer {index} has biases, which DeciLM's layers do not"
        if not shapes:
            continue
        problem = shape_problem(index, attn.q_proj.out_features != heads * head_dim(attn), mlp.gate_proj.out_features)
        if problem is not None:
            return problem
    return None


def shape_problem(index: int, lost_heads: bool, width: int) -> str | None:
    """Why layer `index`'s shapes are not DeciLM's, or None: what `servable_problem` and `planned_problem` say."""
    if lost_heads:
        return f"layer {index} lost query heads, and DeciLM keeps every layer's query heads"
    if width % FFN_TILE:
        return f"layer {index}'s MLP width {width} is not a multiple of {FFN_TILE}"
    return None


def planned_problem(summary: dict, intermediate: int) -> str | None:
    """Why the model a trial's recorded plan (its pruning_summary.json: the groups each layer lost, the layers
    removed) gives cannot be written as DeciLM, or None: what `servable_problem` finds of the shapes, decided before
    a rebuild. `intermediate`: the unpruned MLP width. Indices are the unpruned model's layers."""
    gone = set(summary.get("layers_removed", []))
    for index, entry in enumerate(summary["removed_groups"]):
        problem = None if index in gone else shape_problem(index, bool(entry["attention_groups"]),
                                                           intermediate - len(entry["mlp_channels"]))
        if problem is not None:
            return problem
    return None


def refusal(problem: str) -> ExportError:
    return ExportError(f"--format decilm: not written: {problem}; {SERVABLE}")


def check_trial(chosen: Chosen, *, trust_remote_code: bool = False) -> None:
    """The refusal a trial's records decide before its model is rebuilt (minutes at 8B): its family, from the
    model's config on the meta device, and the shapes its recorded plan gives. A record that cannot be read decides
    nothing here: the rebuilt model is checked again by `write_decilm`."""
    unpruned = meta_model(chosen.model, trust_remote_code=trust_remote_code)
    problem = servable_problem(unpruned, shapes=False)
    if problem is None:
        try:
            summary = json.loads(trial_file(chosen.folder, "pruning_summary.json")[1])
            problem = planned_problem(summary, unpruned.config.intermediate_size)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return
    if problem is not None:
        raise refusal(problem)


def block_configs(model: nn.Module) -> list[dict]:
    config = model.config
    blocks = []
    for layer in decoder_layers(model):
        kv_heads = layer.self_attn.k_proj.out_features // head_dim(layer.self_attn)
        blocks.append({
            "attention": {"n_heads_in_group": config.num_attention_heads // kv_heads, "no_op": False,
                          "replace_with_linear": False},
            "ffn": {"ffn_mult": ffn_mult(layer.mlp.gate_proj.out_features, config.hidden_size), "no_op": False,
                    "replace_with_linear": False},
        })
    return blocks


def write_decilm(model: nn.Module, tokenizer, folder: str | Path) -> Path:
    """Write `model` (pruned, in memory) and its tokenizer to `folder` as DeciLM; ExportError before anything is
    written when the format cannot hold it."""
    problem = servable_problem(model)
    if problem is not None:
        raise refusal(problem)
    blocks = block_configs(model)
    folder = Path(folder)
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    for key in ("num_key_value_heads", "intermediate_size", "pruned_layout", "auto_map", "pruned_output_bias",
                "head_dim"):
        config.pop(key, None)
    config |= {"architectures": ["DeciLMForCausalLM"], "model_type": "nemotron-nas", "block_configs": blocks,
               "num_hidden_layers": len(blocks),
               "auto_map": {"AutoConfig": f"{CONFIG_FILE.removesuffix('.py')}.DeciLMConfig"}}
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(configuration_decilm.__file__, folder / CONFIG_FILE)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


# llama.cpp's DeciLM reader (convert_hf_to_gguf.py, conversion/deci.py in the llama.cpp llama-cpp-python 0.3.36
# bundles) takes Llama 3's vocabulary by its size, anything else only as a SentencePiece-style BPE (gguf's LlamaHfVocab)
LLAMA3_VOCAB = 128256


def converter_problem(folder: str | Path) -> str | None:
    """Why llama.cpp's own converter refuses the vocabulary of a written DeciLM folder, or None: a vocabulary of
    Llama 3's size goes its BPE way; any other must be a BPE with byte fallback decoded by a Sequence (Llama 2's,
    Mistral's: SentencePiece's, converted), or it stops at "Cannot find Llama BPE tokenizer" (SmolLM2's, Qwen2's
    byte-level BPE). The folder serves in vLLM all the same, and `export --gguf` writes the GGUF itself."""
    folder = Path(folder)
    if json.loads((folder / "config.json").read_text()).get("vocab_size") == LLAMA3_VOCAB:
        return None
    try:
        spec = json.loads((folder / "tokenizer.json").read_text())
        model, decoder = spec.get("model") or {}, spec.get("decoder") or {}
    except (OSError, ValueError):
        return "it has no tokenizer.json, and llama.cpp's converter reads the vocabulary from one"
    if model.get("type") == "BPE" and model.get("byte_fallback") and decoder.get("type") == "Sequence":
        return None
    kind = f"a {model.get('type', 'unknown')} vocabulary" + ("" if model.get("byte_fallback") else " without byte "
                                                             "fallback")
    return (f"llama.cpp's converter takes a DeciLM folder's vocabulary only as Llama 3's ({LLAMA3_VOCAB} tokens) or a "
            f"SentencePiece-style BPE (byte fallback: Llama 2's, Mistral's), and this is {kind}: it stops at \"Cannot "
            "find Llama BPE tokenizer\" (export --gguf writes the GGUF itself)")
