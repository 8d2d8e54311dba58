"""A pruned model as a GGUF file that llama.cpp runs: f16 or f32, written with the `gguf` library.

Which architecture the file names (what llama.cpp 0.3.36's bundled source does with each, read in src/models/):
- Layers of one shape (uniform, depth) are written as their family's own architecture (`sources.families`:
  `llama` for Llama and Mistral, `qwen2`, `qwen3` with its `attn_q_norm` / `attn_k_norm`, `granite` with its four
  multipliers, `olmo2` with its whole-projection q/k norms and its norms after each block, `gemma2` with its caps,
  window and four norms as 1 + w, `gemma3` with its head norms as 1 + w too, `phi3` with q/k/v and gate/up joined
  as its fused `attn_qkv` / `ffn_up` and its partial RoPE), with the usual scalar metadata, as llama.cpp's converter
  writes them. Llama 3.1's `llama3` RoPE scaling goes in as the converter writes it, `rope_freqs` (one factor per
  rotary frequency), which `llama` and `deci` read.
- Layers of different shapes (the free layout) are written as `deci`. llama.cpp's loader reads
  `feed_forward_length`, `attention.head_count` and `attention.head_count_kv` as per-layer arrays for every
  architecture (llama-model.cpp, `get_key_or_arr`), but `llama` and `qwen2` then build every layer's tensors and
  graph from layer 0's values (`LLAMA_LOAD_LOCALS`), so a ragged file fails to load as either. `deci` (DeciLM,
  Nemotron-NAS) sizes each layer from its own entries, tensors and graph alike, with optional q/k/v and output
  biases: a Llama-style decoder with per-layer widths, which is what the free layout is. Its RoPE is llama's
  (pairs of consecutive values), so q and k are permuted as the converter does for `llama`; Qwen2's HF rotation is
  the same as Llama's, so a Qwen2 goes through the same permutation.
- A family whose layers hold more than Llama's (Qwen3's and OLMo-2's head norms, Granite's multipliers, Phi-3's
  partial RoPE, which the `deci` writing does not carry) is not written as `deci`: its free layout is refused in
  one line naming the uniform layout.
- A Qwen2 or Mistral with output biases (FLAP's compensation; their transformers classes cannot hold them either) is
  written as `deci` too, which takes them on any layer; a uniform Llama with them stays `llama` (its graph adds both
  biases when present). So is a uniform Qwen2 with attention heads cut: llama.cpp's `qwen2` sizes q as hidden x
  hidden (`Family.gguf_whole_attention`), `deci` from the heads the file names.

The tokenizer goes in as llama.cpp's converter writes a byte-level BPE (`gpt2`): the token list, types, merges and
special ids, and the pre-tokenizer's name, which llama.cpp needs to split text as the model's tokenizer does. The
name is recognised as the converter recognises it (the hash of the token ids of its check text), for the families
this tool prunes; anything else is refused with one line rather than written with a pre-tokenizer that splits text
differently.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from contextlib import contextmanager, redirect_stderr
from hashlib import sha256
from pathlib import Path

import numpy as np
import torch
from torch import nn

from taylor_tune.export.choose import ExportError
from taylor_tune.pruning.groups import decoder_layers, head_dim, sparse_blocks
from taylor_tune.recovery.losses import token_losses
from taylor_tune.sources.families import DENSE, FAMILIES

FILE_TYPES = ("f16", "f32")

# llama.cpp's check text and the hashes of its token ids for the tokenizers of the families this tool prunes, from the
# bundled convert_hf_to_gguf (conversion/base.py, get_vocab_base_pre; the converter's own refs in the comments).
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) "
    "✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 "
    "?我想在apple工作1314151天～ ------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? "
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL")
PRE_TOKENIZERS = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # HuggingFaceTB/SmolLM-135M
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # meta-llama/Meta-Llama-3-8B
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen/Qwen1.5-7B
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen/Qwen3-Embedding-0.6B
}
# A neutral passage the export's own check scores in llama.cpp and in torch (tests use held-out text).
CHECK_PASSAGE = ("The river rises in the hills north of the town and flows south through farmland for about forty "
                 "miles before it reaches the sea. In the nineteenth century mills were built along its banks, and "
                 "the town grew around them; most closed after the war, and the buildings are now homes and shops.")
# Per-token log-probability gaps (nats) between llama.cpp and torch in float32 allowed by the check above: f16 weights
# round each to 11 bits, f32 ones differ only by the order of summation. About 10x what was measured on real SmolLM2
# (docs/export.md); a writer bug (q and k left unpermuted) moves them by nats.
TOLERANCE = {"f32": {"mean": 1e-4, "max": 1e-3}, "f16": {"mean": 1e-2, "max": 0.1}}
# Qwen2's split pattern (its tokenizer.json; llama.cpp's `qwen2` pre-tokenizer is this pattern), for vocabularies
# that split as Qwen2's does but are not Qwen2's own (the hash above knows only the released vocabularies).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
GGML_F32 = 0  # ggml_type's GGML_TYPE_F32
STOCK_ARCH = {t: f.gguf for t, f in FAMILIES.items() if f.gguf}  # model_type -> llama.cpp's architecture
# llama.cpp's architectures whose RoPE rotates consecutive pairs (LLAMA_ROPE_TYPE_NORM), where HF's rotates halves:
# their q and k rows are permuted as the converter does. The others (qwen2, qwen3, olmo2: NeoX) take HF's order.
PAIRED_ROPE = ("llama", "deci", "granite", "granitemoe")


class GGUFError(ExportError):
    """A model that cannot be written as a GGUF llama.cpp runs (one line: what and why; exit 2 like every export
    refusal)."""


def check_file_type(file_type: str) -> None:
    if file_type not in FILE_TYPES:
        raise GGUFError(f"--gguf {file_type!r}: the GGUF types written are {', '.join(FILE_TYPES)} "
                        "(quantize the f16 file with llama.cpp's llama-quantize)")


def write_gguf(model: nn.Module, tokenizer, path: str | Path, *, file_type: str = "f16", name: str = "") -> dict:
    """Write `model` (a loaded pruned or unpruned model) and its tokenizer to `path`; return what was written
    (architecture, file type, per-layer shapes). GGUFError before anything is written when it cannot be."""
    import gguf

    check_file_type(file_type)
    config = model.config
    if config.model_type not in STOCK_ARCH:
        raise GGUFError(f"--gguf: a {config.model_type} model is not written as GGUF yet "
                        f"({', '.join(STOCK_ARCH)} are); export it without --gguf")
    family = FAMILIES[config.model_type]
    rope = dict(getattr(config, "rope_parameters", None) or {})
    window = family.gguf_window
    if window is not None and window.rope_of:  # one RoPE per layer type: the file's is that type's
        _check_window(config, rope)
        rope = rope[window.rope_of]
    scaling = rope.get("rope_type", "default")
    if scaling not in family.gguf_rope_scalings:
        raise GGUFError(f"--gguf: RoPE scaling {scaling!r} is not written as GGUF yet (plain RoPE, and Llama 3.1's "
                        "llama3 scaling on Llama, are)")
    layers, sparse = decoder_layers(model), sparse_blocks(model)
    if sparse:
        _check_mixture(config, len(layers), sorted(sparse))
    shapes = [_shape(layer, sparse.get(index)) for index, layer in enumerate(layers)]
    size = head_dim(layers[0].self_attn)
    biased = any(layer.self_attn.o_proj.bias is not None or (
        index not in sparse and layer.mlp.down_proj.bias is not None) for index, layer in enumerate(layers))
    uniform = all(shape == shapes[0] for shape in shapes)
    kv_whole = family.gguf_whole_kv
    whole = all(layer.self_attn.q_proj.out_features == config.hidden_size
                and (not kv_whole or layer.self_attn.k_proj.out_features == config.hidden_size) for layer in layers)
    arch = architecture(config.model_type, uniform=uniform, biased=biased, whole_attention=whole)
    if arch == "deci" and not family.gguf_free:
        if uniform and not biased:  # the attention alone keeps it from its own architecture
            kv = ", or fewer key/value heads than query heads" if kv_whole else ""
            raise GGUFError(f"--gguf: llama.cpp's {STOCK_ARCH[config.model_type]} sizes attention from the hidden "
                            f"size (q is hidden x hidden), so a {config.model_type} model with attention heads pruned "
                            f"(or heads x head_dim other than the hidden size{kv}) is not written as GGUF; depth and "
                            "MLP-only cuts are")
        what = "whose layers differ in width" if not uniform else "with output biases (FLAP's compensation)"
        raise GGUFError(f"--gguf: a {config.model_type} model {what} is not written as GGUF (llama.cpp reads "
                        "per-layer widths and those biases only as deci, which has no head norms or multipliers); "
                        "prune it with uniform: true" + ("" if not uniform else " and a method without compensation"))
    if window is not None and not window.rope_of:
        _check_window(config, rope)
    vocab = _vocab(tokenizer, config.vocab_size)

    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(_name(name or getattr(config, "_name_or_path", "") or "pruned", vocab["tokens"]))
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(len(layers))
    per_layer = (lambda key: shapes[0][key]) if arch != "deci" else (lambda key: [s[key] for s in shapes])
    writer.add_feed_forward_length(per_layer("ff"))
    writer.add_head_count(per_layer("heads"))
    writer.add_head_count_kv(per_layer("kv_heads"))
    writer.add_key_length(size)  # spelled out: a pruned model's width / heads is not its head size
    writer.add_value_length(size)
    writer.add_rope_dimension_count(int(size * rope.get("partial_rotary_factor", 1.0)))  # Phi-4-mini's 3/4
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if sparse:  # every layer's experts (`_check_mixture`), each `ff` wide, as llama.cpp's converter writes them
        writer.add_expert_count(shapes[0]["experts"])
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(shapes[0]["ff"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if file_type == "f16" else gguf.LlamaFileType.ALL_F32)
    _add_vocab(writer, vocab)
    if arch != "deci":  # Granite's multipliers (`Family.scalars`), under the keys llama.cpp's converter writes
        for field_name, key in family.scalars.items():
            getattr(writer, f"add_{key}")(getattr(config, field_name))

    permute = arch in PAIRED_ROPE
    extra = {"rope_freqs.weight": llama3_rope_factors(config, size)} if scaling == "llama3" else {}
    tensors = _tensors(model, layers, shapes, permute, config.tie_word_embeddings, family)
    for tensor_name, tensor in [*extra.items(), *tensors]:
        data = tensor.detach().to("cpu", torch.float32)
        data = data.to(torch.float16) if file_type == "f16" and data.ndim >= 2 else data  # vectors stay f32
        writer.add_tensor(tensor_name, data.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"architecture": arch, "file_type": file_type, "pre_tokenizer": vocab["pre"],
            "tokens_without_embedding": vocab["beyond"], "layers": [dict(s) for s in shapes]}


def _name(name: str, tokens: list[str]) -> str:
    """The file's `general.name`. llama.cpp's vocabulary loader looks Phi-3's "<|end|>" up by its text in any file
    whose name contains "phi3" or "phi-3" (any case), and cannot load one whose vocabulary lacks it (seen with
    llama-cpp-python 0.3.36: "error loading model vocabulary"); there the name spells the family "Phi 3", which that
    rule does not match, and nothing else changes."""
    return name if "<|end|>" in tokens else re.sub(r"(?i)phi-?3", "Phi 3", name)


def _check_window(config, rope: dict) -> None:
    """A family with sliding-window layers is written where llama.cpp's graph for it computes what the model does
    (`Family.gguf_window`, `Window`): GGUFError naming the first thing that differs."""
    window, arch = FAMILIES[config.model_type].gguf_window, STOCK_ARCH[config.model_type]
    period = window.period
    pattern = ["sliding_attention" if i % period < period - 1 else "full_attention"
               for i in range(config.num_hidden_layers)]
    capped = config.attn_logit_softcapping is not None and config.final_logit_softcapping is not None
    uncapped = config.attn_logit_softcapping is None and config.final_logit_softcapping is None
    local = rope.get("sliding_attention", {}) if window.rope_of else {}
    if window.capped and not capped:
        why = f"a soft-cap is off, and llama.cpp's {arch} caps with its defaults (50, 30) when the file names none"
    elif not window.capped and not uncapped:
        why = f"it is soft-capped, and llama.cpp's {arch} caps nothing"
    elif window.tied_output and not config.tie_word_embeddings:
        why = f"its output is not tied to its token embeddings, which llama.cpp's {arch} reads as the output"
    elif config.query_pre_attn_scalar != config.head_dim:
        why = (f"its attention is scaled by query_pre_attn_scalar {config.query_pre_attn_scalar}, llama.cpp's {arch} "
               f"by the head size {config.head_dim}")
    elif list(config.layer_types) != pattern:
        why = (f"its sliding-window layers are not llama.cpp's {arch} pattern (the global layer every {period}th "
               f"from the start): remove layers {period} at a time from the end")
    elif window.sliding_rope_base is not None and (local.get("rope_theta") != window.sliding_rope_base
                                                   or local.get("rope_type", "default") != "default"):
        why = f"its sliding layers' RoPE is not llama.cpp's {arch} (plain, base {window.sliding_rope_base:g})"
    else:
        return
    raise GGUFError(f"--gguf: this {config.model_type} model is not written as GGUF: {why}")


def architecture(model_type: str, *, uniform: bool, biased: bool, whole_attention: bool = True) -> str:
    """llama.cpp's architecture for a model (module docstring): its own where its layers share one shape, its graph
    takes its biases and its loader takes its attention's width (`Family.gguf_whole_attention`: q hidden x hidden),
    `deci` otherwise (whose family has Llama's graph, `Family.gguf_free`, or refused)."""
    family = FAMILIES[model_type]
    own = uniform and not (biased and not family.all_biases) and (whole_attention or not family.gguf_whole_attention)
    return STOCK_ARCH[model_type] if own else "deci"


# The layouts the README's family table names: (uniform, the attention left hidden-wide)
GGUF_LAYOUTS = {"free": (False, False), "uniform, heads cut": (True, False), "uniform, MLP only": (True, True),
                "depth": (True, True)}


def written_as(model_type: str, layout: str) -> str | None:
    """The llama.cpp architecture `export --gguf` writes a model of this family and layout (`GGUF_LAYOUTS`) as, None
    where it refuses: derived from the family's declaration, so that the README's table (`gguf_table`) cannot promise
    what the writer refuses. Gemma's own checks (`_check_window`) come on top, from each model's config."""
    family, (uniform, whole) = FAMILIES[model_type], GGUF_LAYOUTS[layout]
    if family.gguf is None:
        return None
    arch = architecture(model_type, uniform=uniform, biased=False, whole_attention=whole)
    return None if arch == "deci" and not family.gguf_free else arch


def gguf_table() -> str:
    """The README's table of what `export --gguf` writes, one row per family: a dense family's layouts
    (`written_as`), a mixture's experts removed (the experts method: its family's architecture, `_check_mixture`'s
    conditions aside)."""
    rows = ["| family | " + " | ".join(GGUF_LAYOUTS) + " | experts removed |",
            "|---|" + "---|" * (len(GGUF_LAYOUTS) + 1)]
    for model_type, family in FAMILIES.items():
        if model_type in DENSE:
            cells = [f"`{arch}`" if (arch := written_as(model_type, layout)) else "refused" for layout in GGUF_LAYOUTS]
            cells.append("–")
        else:
            cells = ["–"] * len(GGUF_LAYOUTS) + [f"`{family.gguf}`" if family.gguf else "refused"]
        rows.append(f"| `{model_type}` | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def llama3_rope_factors(config, size: int) -> torch.Tensor:
    """Llama 3.1's RoPE scaling as llama.cpp takes it, one factor per rotary frequency (`rope_freqs`, by which
    llama.cpp divides each frequency): plain RoPE's frequencies over the scaled ones, which transformers' own
    `llama3` initialiser computes (so the file and the model rotate alike)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    theta = float(config.rope_parameters["rope_theta"])
    plain = 1.0 / theta ** (torch.arange(0, size, 2, dtype=torch.int64).float() / size)
    return (plain / scaled.float()).to(torch.float32)


def _shape(layer: nn.Module, sparse: nn.Module | None = None) -> dict[str, int]:
    """A layer's heads and feed-forward width; with its sparse block (a mixture's), its experts and their width."""
    attn, size = layer.self_attn, head_dim(layer.self_attn)
    heads = {"heads": attn.q_proj.out_features // size, "kv_heads": attn.k_proj.out_features // size}
    if sparse is None:
        return heads | {"ff": layer.mlp.gate_proj.out_features}
    experts, width, _ = sparse.experts.gate_up_proj.shape
    return heads | {"ff": width // 2, "experts": experts}


def _check_mixture(config, layers: int, sparse: list[int]) -> None:
    """A mixture is written where llama.cpp's graph for its family computes what it does: experts in every layer,
    and a token's top-k gates renormalised as that graph does (`Experts.gguf_renormalised`). GGUFError otherwise."""
    moe, arch = FAMILIES[config.model_type].experts, STOCK_ARCH[config.model_type]
    if len(sparse) != layers:
        dense = [i for i in range(layers) if i not in sparse]
        raise GGUFError(f"--gguf: llama.cpp's {arch} has experts in every layer, and layers {dense} of this "
                        f"{config.model_type} model are dense (mlp_only_layers, decoder_sparse_step); it is not "
                        "written as GGUF")
    field = moe.renormalised
    renormalised = field if isinstance(field, bool) else bool(getattr(config, field))
    if renormalised != moe.gguf_renormalised:
        does = "renormalises" if moe.gguf_renormalised else "does not renormalise"
        raise GGUFError(f"--gguf: llama.cpp's {arch} {does} a token's top-k gates, and this model's {field} is "
                        f"{renormalised}; it is not written as GGUF")


def _rope_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half order -> llama.cpp's interleaved pairs, head by head (the converter's `permute`)."""
    if heads == 0:
        return weight
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _tensors(model, layers, shapes, permute: bool, tied: bool, family):
    norm = (lambda t: t + family.norm_offset) if family.norm_offset else (lambda t: t)
    sparse = sparse_blocks(model)
    yield "token_embd.weight", model.get_input_embeddings().weight
    yield "output_norm.weight", norm(model.model.norm.weight)
    if not tied:
        yield "output.weight", model.get_output_embeddings().weight
    for index, (layer, shape) in enumerate(zip(layers, shapes)):
        block, attn, mlp = f"blk.{index}", layer.self_attn, getattr(layer, "mlp", None)  # Granite-MoE's: none
        if shape["heads"]:
            for ours, theirs in family.attn_norms.items():
                yield f"{block}.{theirs}.weight", norm(getattr(layer, ours).weight)
            if "self_attn.qkv_proj" in family.gguf_fused:  # Phi-3's, NeoX RoPE: nothing to permute
                yield from _joined(attn, family, "self_attn.qkv_proj", block)
            else:
                for ours, theirs, heads in (("q_proj", "attn_q", shape["heads"]),
                                            ("k_proj", "attn_k", shape["kv_heads"]), ("v_proj", "attn_v", 0)):
                    linear = getattr(attn, ours)
                    turn = (lambda t, h=heads: _rope_permute(t, h)) if permute and heads else (lambda t: t)
                    yield f"{block}.{theirs}.weight", turn(linear.weight)
                    if linear.bias is not None:
                        yield f"{block}.{theirs}.bias", turn(linear.bias)
            for ours, theirs in (("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):  # Qwen3's, OLMo-2's
                if hasattr(attn, ours):
                    yield f"{block}.{theirs}.weight", norm(getattr(attn, ours).weight)
            yield f"{block}.attn_output.weight", attn.o_proj.weight
            if attn.o_proj.bias is not None:
                yield f"{block}.attn_output.bias", attn.o_proj.bias
        if index in sparse:  # the router's rows, and the experts' gate, up and down stacked [experts, out, in]
            for ours, theirs in family.ffn_norms.items():
                yield f"{block}.{theirs}.weight", norm(getattr(layer, ours).weight)
            experts, width = sparse[index].experts, shape["ff"]
            yield f"{block}.ffn_gate_inp.weight", getattr(sparse[index], family.experts.router).weight
            yield f"{block}.ffn_gate_exps.weight", experts.gate_up_proj[:, :width]
            yield f"{block}.ffn_up_exps.weight", experts.gate_up_proj[:, width:]
            yield f"{block}.ffn_down_exps.weight", experts.down_proj
        elif shape["ff"]:
            for ours, theirs in family.ffn_norms.items():
                yield f"{block}.{theirs}.weight", norm(getattr(layer, ours).weight)
            fused = "mlp.gate_up_proj" in family.gguf_fused
            if fused:
                yield from _joined(mlp, family, "mlp.gate_up_proj", block)
            for ours, theirs in (("down_proj", "ffn_down"),) if fused else (
                    ("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                linear = getattr(mlp, ours)
                yield f"{block}.{theirs}.weight", linear.weight
                if linear.bias is not None:
                    yield f"{block}.{theirs}.bias", linear.bias


def _joined(owner, family, path: str, block: str):
    """A fused projection's GGUF tensors (`Family.gguf_fused`): its parts joined in the family's row order, as the
    stock class holds them (Phi-3's qkv_proj as attn_qkv, its gate_up_proj as ffn_up, which llama.cpp's SwiGLU splits
    gate first)."""
    parts = [getattr(owner, name) for name in family.fused[path]]
    name = f"{block}.{family.gguf_fused[path]}"
    yield f"{name}.weight", torch.cat([part.weight for part in parts])
    if parts[0].bias is not None:
        yield f"{name}.bias", torch.cat([part.bias for part in parts])


def pre_tokenizer(tokenizer) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer: recognised by the hash of its token ids on the check text,
    as llama.cpp's converter does; otherwise by its split: byte-level with GPT-2's pattern is `gpt-2`, Qwen2's
    pattern is `qwen2`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GGUFError("--gguf: only a fast (tokenizer.json) byte-level BPE tokenizer is written as GGUF; "
                        f"this model's is {type(tokenizer).__name__}")
    spec = json.loads(backend.to_str())
    if spec["model"]["type"] != "BPE":
        raise GGUFError(f"--gguf: the tokenizer is {spec['model']['type']}, not a byte-level BPE; not written as GGUF "
                        "(SentencePiece vocabularies are not supported yet)")
    digest = sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    if digest in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[digest]
    split = spec.get("pre_tokenizer") or {}
    if split.get("type") == "ByteLevel" and split.get("use_regex", True):
        return "gpt-2"
    steps = split.get("pretokenizers", []) if split.get("type") == "Sequence" else []
    if ([step["type"] for step in steps] == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True)
            and steps[0].get("pattern", {}).get("Regex") == QWEN2_SPLIT):
        return "qwen2"
    raise GGUFError(f"--gguf: the tokenizer's pre-tokenizer is not one llama.cpp is known to split as it does "
                    f"(check hash {digest[:16]}...); the families written are SmolLM, Llama 3 and Qwen2")


def _vocab(tokenizer, vocab_size: int) -> dict:
    """The converter's byte-level BPE vocabulary (`get_vocab_base`): every id below the embedding's rows, added
    tokens as CONTROL (special) or USER_DEFINED, unused ids padded."""
    import gguf

    pre = pre_tokenizer(tokenizer)
    # An id past the embedding's rows (an added token the model was never given a row for) can never be fed to the
    # model: the file's vocabulary is the embedding's, and what is left out is counted in the record.
    every = tokenizer.get_vocab()
    reverse = {index: token for token, index in every.items() if index < vocab_size}
    beyond = len(every) - len(reverse)
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        token = reverse.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif token in added:
            special = decoder[index].special if index in decoder else False
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
            tokens.append(token)
        else:
            types.append(gguf.TokenType.NORMAL)
            tokens.append(token)
    with tempfile.TemporaryDirectory() as folder:  # SpecialVocab reads merges and special ids from saved files
        tokenizer.save_pretrained(folder)
        special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    return {"pre": pre, "tokens": tokens, "types": types, "special": special, "beyond": beyond}


def _add_vocab(writer, vocab: dict) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    vocab["special"].add_to_gguf(writer)


def gguf_name(file_type: str) -> str:
    return f"model.{file_type}.gguf"


def torch_logprobs(model: nn.Module, tokens: list[int]) -> np.ndarray:
    """Each next token's log-probability under `model` (float32 on its device): what the GGUF must reproduce."""
    ids = torch.tensor([tokens], device=next(model.parameters()).device)
    with torch.no_grad():
        return -token_losses(model(ids).logits, ids)[0].double().cpu().numpy()


def check_gguf(path: Path, model: nn.Module, tokenizer, file_type: str) -> dict:
    """The written file read back by llama.cpp: its per-token log-probabilities on a fixed passage against the
    model's, GGUFError beyond `TOLERANCE[file_type]`. Without llama-cpp-python installed the file is written
    unchecked, and the record says so."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return {"checked": False, "why": "llama-cpp-python is not installed (pip install 'taylor-tune[gguf]')"}
    tokens = tokenizer.encode(CHECK_PASSAGE)
    theirs, ours = gguf_logprobs(path, tokens), torch_logprobs(model, tokens)
    gap = np.abs(theirs - ours)
    measured = {"checked": True, "tokens": len(tokens) - 1, "mean_abs_logprob_gap": float(gap.mean()),
                "max_abs_logprob_gap": float(gap.max())}
    family = FAMILIES.get(model.config.model_type)
    limit = (family.gguf_f32_tolerance if file_type == "f32" and family and family.gguf_f32_tolerance
             else TOLERANCE[file_type])
    if measured["mean_abs_logprob_gap"] > limit["mean"] or measured["max_abs_logprob_gap"] > limit["max"]:
        raise GGUFError(f"--gguf: llama.cpp reads {path.name} with per-token log-probabilities "
                        f"{measured['mean_abs_logprob_gap']:.2g} (mean) / {measured['max_abs_logprob_gap']:.2g} (max) "
                        f"from the model's, beyond {limit['mean']:g} / {limit['max']:g}; not written")
    return measured


def gguf_logprobs(path: str | Path, tokens: list[int], *, threads: int = 1) -> np.ndarray:
    """Each next token's log-probability under llama.cpp (llama-cpp-python) reading `path`: the check that the file
    is the model, and what a user's llama.cpp computes. GGUFError with llama.cpp's own reason when it cannot load it.
    """
    from llama_cpp import Llama

    llm, logits = None, None
    # llama.cpp's log (verbose: its reason for refusing a file is in it) is kept out of the user's terminal.
    with _captured_stderr() as said:
        try:
            # The KV cache in f32 (llama.cpp's default is f16): the comparison is of the file, not the cache.
            llm = Llama(model_path=str(path), n_ctx=max(64, len(tokens)), n_batch=max(64, len(tokens)),
                        logits_all=True, n_threads=threads, type_k=GGML_F32, type_v=GGML_F32, verbose=True)
            llm.eval(tokens)
            logits = np.asarray(llm.scores[: len(tokens)], dtype=np.float64)
        except ValueError:
            pass
        finally:
            if llm is not None:
                llm.close()
    if logits is None:
        errors = [line for line in said() if "error" in line] or ["no reason given"]
        raise GGUFError(f"--gguf: llama.cpp cannot load {Path(path).name}: {errors[0].strip()}")
    logits -= logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return logp[np.arange(len(tokens) - 1), tokens[1:]]


@contextmanager
def _captured_stderr():
    """Standard error, Python's and file descriptor 2 (what C code writes), sent to a temporary file for the block;
    yields a function giving its lines once the block is over."""
    sys.stderr.flush()
    saved = os.dup(2)
    lines: list[str] = []
    with tempfile.TemporaryFile(mode="w+") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            with redirect_stderr(sink):
                yield lambda: lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.flush()
            sink.seek(0)
            lines.extend(sink.read().splitlines())
