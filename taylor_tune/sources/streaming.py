"""A causal LM held one decoder layer at a time (issue 92): its modules built from the config on the meta device,
the parts outside the decoder layers (embeddings, final norm, lm_head, rotary tables) on the device, and each
layer's weights read from the checkpoint's safetensors when asked for and dropped when released. The device then
holds the head and one layer whatever the model's size; the safetensors files are memory-mapped, so the host holds
what the page cache keeps of them.

`Resident` gives a model already in memory the same face, so the streamed passes (`pruning.streamed`,
`evaluation.streamed`) run one code path over either, and the equality of the two is what the tests check.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from taylor_tune.compat.transformers import building, no_init_weights
from taylor_tune.errors import ModelLoadError
from taylor_tune.sources.families import FAMILIES
from taylor_tune.sources.pruned_modeling import split_fused

LAYERS = "model.layers."


class Resident:
    """A loaded model as a stream of its layers: each is already there, and stays."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.device = next(model.parameters()).device

    @property
    def num_layers(self) -> int:
        return len(self.model.model.layers)

    def layer(self, index: int) -> nn.Module:
        return self.model.model.layers[index]

    def release(self, index: int) -> None:
        """Nothing to drop: the layer lives in the model."""

    def tensor(self, name: str) -> torch.Tensor:
        return self.model.get_parameter(name).detach()


def _shards(folder: Path) -> dict[str, Path]:
    """Each tensor's name -> the safetensors file that holds it (the index's map, or the one file's names)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"model: {index} has no weight_map")
        return {str(name): folder / str(file) for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model: {folder} holds no safetensors weights")
    names = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            names |= {name: file for name in handle.keys()}
    return names


def _rebuilt_buffers(model: nn.Module, device: torch.device) -> None:
    """The buffers no checkpoint holds (non-persistent), still on the meta device outside the layers, made as their
    modules make them: a rotary table from the module's config (every family's `rotary_emb`), a scalar from the
    number its module keeps beside it (Gemma's `embed_scale` from `scalar_embed_scale`). Anything else is refused:
    a family whose modules need another rule must name it here before it can be streamed."""
    for path, module in list(model.named_modules()):
        if path.startswith(LAYERS) or path == "model.layers":
            continue
        meta = [name for name, b in module.named_buffers(recurse=False) if b.is_meta]
        if not meta:
            continue
        if path.endswith("rotary_emb") and hasattr(module, "config"):
            with torch.device(device):
                fresh = type(module)(module.config)
            owner, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(owner), leaf, fresh)
        elif all(hasattr(module, f"scalar_{name}") for name in meta):
            for name in meta:
                setattr(module, name, torch.tensor(getattr(module, f"scalar_{name}"), device=device))
        else:
            raise ModelLoadError(f"model: cannot stream {type(model).__name__}: {path} keeps buffers {meta} that "
                                 "no checkpoint holds and no rule here rebuilds")


class Checkpoint:
    """A model folder (safetensors) held layer by layer: `model` runs once `layer(i)` has put layer i in place;
    `release(i)` puts its meta shell back, so one layer's weights are alive at a time."""

    def __init__(self, folder: str | Path, config, *, device: torch.device | str, dtype: torch.dtype, cls=None):
        self.folder, self.device, self.dtype = Path(folder), torch.device(device), dtype
        self.config, self.cls = config, cls  # cls: a pruned folder's class (`pruned_modeling`); None: the config's
        self.scratch: Path | None = None  # where the passes keep what they carry between layers (None: the host)
        self.model = self._built(config)
        self.shells = [copy.deepcopy(layer) for layer in self.model.model.layers]  # as the checkpoint holds them
        self.fused = FAMILIES[config.model_type].fused
        self.names = _shards(self.folder)
        outside = self._read([name for name in self.names if not name.startswith(LAYERS)])
        tied = "lm_head.weight" not in outside and getattr(config, "tie_word_embeddings", False)
        missing, unexpected = self.model.load_state_dict(outside, strict=False, assign=True)
        missing = [k for k in missing if not k.startswith(LAYERS) and not (tied and k == "lm_head.weight")]
        if missing or unexpected:
            raise ModelLoadError(f"model: {self.folder}'s weights do not match its config.json: "
                                 f"missing {missing[:1]}, unexpected {unexpected[:1]}")
        if tied:
            self.model.lm_head.weight = self.model.model.embed_tokens.weight
        _rebuilt_buffers(self.model, self.device)
        self.model.requires_grad_(False).eval()
        self._split(self.model.model.layers)  # the meta layers as every held model has them (their shapes only)
        self.empty = list(self.model.model.layers)

    @property
    def num_layers(self) -> int:
        return len(self.shells)

    def _built(self, config) -> nn.Module:
        with building(), no_init_weights(), torch.device("meta"):
            if self.cls is None:
                return AutoModelForCausalLM.from_config(config, dtype=self.dtype)
            return self.cls._from_config(config, dtype=self.dtype)

    def skeleton(self) -> nn.Module:
        """The model's modules and shapes alone, on the meta device, held as every model is (a fused family's
        projections split): what a plan is applied to, to know the pruned model's shapes and config."""
        model = self._built(copy.deepcopy(self.config))  # a plan cuts its config's per-layer lists: not this one's
        self._split(model.model.layers)
        return model

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors `names` on the device in the dtype, each file opened (memory-mapped) only while they are read:
        a mapping kept open would hold every page read so far as this process's."""
        files: dict[Path, list[str]] = {}
        for name in names:
            files.setdefault(self.names[name], []).append(name)
        out = {}
        for file, part in files.items():
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in part:
                    out[name] = handle.get_tensor(name).to(device=self.device, dtype=self.dtype)
        return out

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor of the checkpoint by its name, on the device in the dtype (a layer's projection, say)."""
        return self._read([name])[name]

    def layer(self, index: int) -> nn.Module:
        """Layer `index` with its weights read from the checkpoint onto the device, in place in `model`."""
        prefix = f"{LAYERS}{index}."
        state = {name[len(prefix):]: tensor for name, tensor in
                 self._read([name for name in self.names if name.startswith(prefix)]).items()}
        # a fused family's checkpoint holds the fused projections (as published) or their parts (as saved here)
        fused = set(state) == set(self.shells[index].state_dict())
        layer = copy.deepcopy(self.shells[index] if fused else self.empty[index])
        layer.load_state_dict(state, strict=True, assign=True)
        self._split([layer])
        layer.requires_grad_(False).eval()
        self.model.model.layers[index] = layer
        return layer

    def release(self, index: int) -> None:
        """Layer `index`'s weights dropped: its meta shell back in the model."""
        self.model.model.layers[index] = self.empty[index]

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True) -> Checkpoint:
        self.model.train(mode)
        return self

    def eval(self) -> Checkpoint:
        return self.train(False)

    def _split(self, layers) -> None:
        """A fused family's projections held as their parts (`pruned_modeling.split_fused`), as in every held model."""
        if self.fused:
            split_fused(SimpleNamespace(config=self.model.config, model=SimpleNamespace(layers=layers)), self.fused)


class Kept:
    """What a streamed pass keeps between layers (each micro-batch's hidden state, the gradient flowing down), by
    key: on the host, or with `scratch` one safetensors file each in that folder (the caller's; it removes it)."""

    def __init__(self, scratch: Path | None = None):
        self.scratch, self._held = scratch, {}
        if scratch is not None:
            scratch.mkdir(parents=True, exist_ok=True)

    def _file(self, key: tuple) -> Path:
        return self.scratch / ("-".join(map(str, key)) + ".safetensors")

    def put(self, key: tuple, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to("cpu")
        if self.scratch is None:
            self._held[key] = tensor
        else:
            save_file({"t": tensor.contiguous()}, self._file(key))

    def get(self, key: tuple) -> torch.Tensor:
        return self._held[key] if self.scratch is None else load_file(self._file(key))["t"]

    def drop(self, key: tuple) -> None:
        if self.scratch is None:
            self._held.pop(key, None)
        else:
            self._file(key).unlink(missing_ok=True)


class _Recorder(nn.Module):
    """Stands where a decoder layer stands while the model's own forward computes what each layer is called with
    (masks, positions, rotary tables): keeps that and the first layer's input, and passes its input on unchanged."""

    def __init__(self, index: int, calls: list, first: list, shell: nn.Module):
        super().__init__()
        self.index, self.calls, self.first = index, calls, first
        if hasattr(shell, "attention_type"):  # what some families' forward reads off the layer to pick its mask
            self.attention_type = shell.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        if args:
            raise AssertionError("a decoder layer called with positional arguments besides its input")
        self.calls[self.index] = kwargs
        if self.index == 0:
            self.first.append(hidden_states)
        return hidden_states


def entry(model: nn.Module, inputs: dict) -> tuple[torch.Tensor, list[dict]]:
    """For one call of the model with keyword `inputs` (input_ids, and any attention_mask, position_ids): the first
    decoder layer's input and the keywords each layer is called with, computed by the model's own forward with
    every layer stood in for (so no layer's weights are needed)."""
    layers = model.model.layers
    held = list(layers)
    calls, first = [None] * len(held), []
    try:
        for index, layer in enumerate(held):
            layers[index] = _Recorder(index, calls, first, layer)
        with torch.no_grad():
            model.model(**inputs, use_cache=False)
    finally:
        for index, layer in enumerate(held):
            layers[index] = layer
    return first[0], calls


def hidden_of(output) -> torch.Tensor:
    """A decoder layer's hidden state out of what it returns (a tensor, or a tuple led by it)."""
    return output[0] if isinstance(output, tuple) else output


def forward_layers(stream, inputs: list[dict], kept: Kept, *, keep_inputs: bool = False,
                   watch=None) -> list[list[dict]]:
    """Every call's hidden state through every decoder layer, layer-major: each layer is brought in once, every
    call goes through it, it is released. `kept[(i, call)]` is layer i's input (i = number of layers: the last
    layer's output); with `keep_inputs` every layer's is kept (the gradient pass goes back through them), else only
    the last one. `watch(index, layer)`, where given, is a context manager around a layer's calls that yields what
    to call after each (with the call's number, the layer's input and its output) or None: how a forward-only scorer
    reads a layer while it is in. Returns each call's keywords per layer. No gradients."""
    calls = []
    for part, keywords in enumerate(inputs):
        first, called = entry(stream.model, keywords)
        kept.put((0, part), first)
        calls.append(called)
    with torch.no_grad():
        for index in range(stream.num_layers):
            layer = stream.layer(index)
            with watch(index, layer) if watch is not None else contextlib.nullcontext() as seen:
                for part in range(len(inputs)):
                    x = kept.get((index, part)).to(stream.device)
                    y = hidden_of(layer(x, **calls[part][index]))
                    kept.put((index + 1, part), y)
                    if seen is not None:
                        seen(part, x, y)
                    if not keep_inputs:
                        kept.drop((index, part))
            stream.release(index)
    return calls


# Tokens a layer-major pass carries at once: each layer's weights are read once per pass, and what the pass keeps
# between layers (every call's hidden state, twice) grows with it: at 8,192 wide in bfloat16, 4 GiB on the host.
CHUNK_TOKENS = 1 << 17


def final_hidden(stream, inputs: list[dict], scratch: Path | None = None,
                 chunk_tokens: int = CHUNK_TOKENS) -> Iterator[torch.Tensor]:
    """Each call's last decoder layer output on the device, in order, from layer-major passes (`forward_layers`:
    each layer's weights reach the device once for all the calls of a pass), the calls taken in passes of at most
    `chunk_tokens` tokens (a call larger than that is a pass of its own)."""
    for chunk in passes(inputs, lambda keywords: keywords["input_ids"].numel(), chunk_tokens):
        kept = Kept(scratch or getattr(stream, "scratch", None))
        forward_layers(stream, chunk, kept)
        for part in range(len(chunk)):
            hidden = kept.get((stream.num_layers, part)).to(stream.device)
            kept.drop((stream.num_layers, part))
            yield hidden


def passes(items: list, tokens: Callable[[object], int], limit: int = CHUNK_TOKENS) -> list[list]:
    """`items` in order, cut into runs of at most `limit` tokens each (`tokens` of an item; an item larger than the
    limit is a run of its own): the calls of one layer-major pass."""
    out, size = [], limit
    for item in items:
        if size + tokens(item) > limit:
            out.append([])
            size = 0
        out[-1].append(item)
        size += tokens(item)
    return out


def batch_logits(model, batches: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Each batch of token ids' logits, in order: a loaded model's forward one batch at a time, or a model held layer
    by layer taken layer-major over all the batches (`final_hidden`), then its head batch by batch."""
    if not is_stream(model):
        device = next(model.parameters()).device
        yield from (model(input_ids=batch.to(device), use_cache=False).logits for batch in batches)
        return
    inputs = [{"input_ids": batch.to(model.device)} for batch in batches]
    yield from (head_logits(model.model, hidden) for hidden in final_hidden(model, inputs))


def head_logits(model: nn.Module, hidden: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits from its last decoder layer's output, as its own forward computes them: the final norm,
    the positions `keep` selects (all by default; as transformers' boolean `logits_to_keep`), lm_head, the logit
    scaling and soft-cap its config names (Granite's `logits_scaling`, Gemma's `final_logit_softcapping`)."""
    normed = model.model.norm(hidden)
    logits = model.lm_head(normed if keep is None else normed[keep])
    config = model.config
    if getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):
        logits = torch.tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping
    return logits


def is_stream(model) -> bool:
    """Whether `model` is held layer by layer (a `Checkpoint`, a `Resident`, or anything else with their face)
    rather than a loaded model (a torch module)."""
    return not isinstance(model, nn.Module)
