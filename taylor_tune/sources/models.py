"""Load a causal LM (hub id, local folder, a pruned folder, or a tiny built-in) with explicit device and dtype.

Real loading code for real models (`AutoModelForCausalLM.from_pretrained`); `trust_remote_code` stays off
unless asked. Two kinds of tiny built-ins need no download:
- `tiny-llama`, `tiny-qwen2`, `tiny-mistral`: trained on the offline world's corpus and shipped in the
  package (`taylor_tune/data/world/models/`); loaded by the same `from_pretrained` code as any folder.
- `tiny-llama-random`, `tiny-qwen2-random`, `tiny-mistral-random`, `tiny-qwen3-random`: random-init (Qwen2's q/k/v
  biases too), built from their config classes with a byte-level tokenizer, each keeping its family's traits
  (`sources.families`); the engine's tests use them.
Real pretrained models come from the real offline world (`assets.py`): `smollm2-135m` and `qwen2.5-0.5b` are
HF folders in the asset cache, converted once from GGUF files; any `path/to/file.gguf` is converted the same
way on first use and cached by its sha256.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
from transformers import (
    CONFIG_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)

from taylor_tune.compat.transformers import building
from taylor_tune.errors import ModelLoadError, shown
from taylor_tune.sources.assets import MANIFEST, MODEL_ASSETS, check_home, file_sha256, home
from taylor_tune.sources.assets import require as require_asset
from taylor_tune.sources.data import PRUNED_MANIFEST, TINY_MODELS, TRAINED_MODELS
from taylor_tune.sources.families import FAMILIES
from taylor_tune.sources.gguf import convert_gguf
from taylor_tune.sources.pruned_modeling import pruned_class, split_fused
from taylor_tune.sources.streaming import Checkpoint
from taylor_tune.sources.world import model_dir

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)  # one module per family (sources/families)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# Llama-3-style GQA (4 query heads per key/value head) at toy size; heads x head_dim (128) != hidden (64)
# exercises an explicit head_dim. Qwen2 adds q/k/v biases by design.
_TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=16,
    num_key_value_heads=4, head_dim=8, max_position_embeddings=512, rms_norm_eps=1e-5,
)


def builtin_path(spec: str) -> Path | None:
    """The shipped folder of a trained tiny model, else None."""
    if spec not in TRAINED_MODELS:
        return None
    return model_dir(spec)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device: {device!r} was asked for but CUDA is not available here; use cpu or auto")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    return getattr(torch, dtype)


@lru_cache(maxsize=1)
def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens + <s>, </s>, <pad>) built offline; lossless on any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(["<s>", "</s>", "<pad>"])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_config(name: str) -> PretrainedConfig:
    tok = byte_tokenizer()
    family = FAMILIES[TINY_MODELS[name]]
    return AutoConfig.for_model(
        family.model_type, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False, **(_TINY_SHAPE | family.tiny),
    )


def gguf_folder(path: Path) -> Path:
    """The cached HF folder of a GGUF file (converted on first use, keyed by the file's sha256)."""
    target = home() / "gguf" / file_sha256(path)[:16]
    if (target / MANIFEST).is_file():
        return target
    check_home()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
        out = convert_gguf(path, Path(tmp) / "out")
        (out / MANIFEST).write_text(json.dumps({"source": str(path.resolve())}) + "\n")
        os.replace(out, target)
    return target


def _source(spec: str) -> tuple[str, str]:
    """(loader, location) for a model spec: tiny, pruned, folder or hub. A missing local path is an error here."""
    if spec in TINY_MODELS:
        return "tiny", spec
    if spec in MODEL_ASSETS:
        return "folder", str(require_asset(spec))
    path = builtin_path(spec) or Path(spec)
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except OSError:  # a name too long for a path, say: no such file or folder
        is_file = is_dir = False
    if spec.endswith(".gguf") and is_file:
        return "folder", str(gguf_folder(path))
    if is_dir:
        return ("pruned" if (path / PRUNED_MANIFEST).is_file() else "folder"), str(path)
    if _HUB_ID.match(spec) and not spec.startswith((".", "/")):
        return "hub", spec
    names = ", ".join(MODEL_ASSETS + TRAINED_MODELS + tuple(TINY_MODELS))
    raise ModelLoadError(
        f"model: {shown(spec)} is not a built-in model ({names}), an existing folder, or a hub id (org/name)"
    )


def load_model_config(spec: str, *, trust_remote_code: bool = False) -> PretrainedConfig:
    """The model's config only (cheap): used to validate the run before any weight is read."""
    source, location = _source(spec)
    if source == "tiny":
        config = tiny_config(spec)
    else:
        try:
            config = AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"model: cannot read the config of {spec!r}: {str(error).splitlines()[0]}") from None
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"model: architecture {config.model_type!r} of {spec!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return config


def load_tokenizer(spec: str, *, trust_remote_code: bool = False):
    source, location = _source(spec)
    if source == "tiny":
        return byte_tokenizer()
    try:
        return AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"model: cannot load the tokenizer of {spec!r}: {str(error).splitlines()[0]}") from None


def load_model(
    spec: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False, seed: int = 0,
) -> PreTrainedModel:
    """The model in eval mode on `device` in `dtype`. Tiny models are initialised from `seed`."""
    source, location = _source(spec)
    config = load_model_config(spec, trust_remote_code=trust_remote_code)
    if source == "tiny":
        with torch.random.fork_rng(devices=[]), building():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            # transformers starts biases at zero; random ones make a test see a bias kept or dropped by mistake
            with torch.no_grad():
                for module in model.modules():
                    if isinstance(module, torch.nn.Linear) and module.bias is not None:
                        module.bias.normal_(0.0, config.initializer_range)
        model = model.to(device=device, dtype=dtype)
    elif source == "pruned":
        model = load_pruned(location, device=device, dtype=dtype)
    else:
        if source == "folder":
            check_safetensors(Path(location), spec)
        try:  # safetensors only: pickled weights (pytorch_model.bin) are never read, from a folder or the hub
            with building(), load_report_silenced():
                model, loading = AutoModelForCausalLM.from_pretrained(
                    location, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True,
                    output_loading_info=True,
                )
            model = model.to(device)
        except Exception as error:  # transformers and safetensors raise many kinds for a damaged folder
            first = str(error).splitlines()[0] if str(error) else ""
            raise ModelLoadError(
                f"model: cannot load the weights of {spec!r}: {type(error).__name__}: {first}"
            ) from None
        check_loaded(spec, config, loading)
    return held_split(model).eval()


def stream_model(spec: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 trust_remote_code: bool = False) -> Checkpoint:
    """The model held one decoder layer at a time (`streaming.Checkpoint`): a folder of safetensors (a built-in
    asset, a local folder, a converted GGUF, a pruned folder, a hub id's files, downloaded first where they are not
    in the hub's cache); ModelLoadError for a tiny model built in memory."""
    location, config, cls = streamable(spec, trust_remote_code=trust_remote_code, fetch=True)
    return Checkpoint(location, config, device=torch.device(device), dtype=dtype, cls=cls)


# what a hub model's streaming reads: its config, tokenizer and safetensors (never a pickled checkpoint)
HUB_STREAMED = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]


def streamable(spec: str, *, trust_remote_code: bool = False,
               fetch: bool = False) -> tuple[str, PretrainedConfig, type | None]:
    """Where a model to stream is, its config and its class (None: its config's own), read without its weights;
    ModelLoadError naming why it cannot be streamed. A hub id is fetched (its safetensors, config and tokenizer into
    the hub's cache) only with `fetch`: a preflight checks, a trial downloads."""
    source, location = _source(spec)
    if source == "tiny":
        raise ModelLoadError(f"model: {shown(spec)} is built in memory; streaming reads a folder of safetensors "
                             "weights")
    if source == "hub":
        config = load_model_config(spec, trust_remote_code=trust_remote_code)
        if not fetch:
            return spec, config, None
        from huggingface_hub import snapshot_download

        try:
            location = snapshot_download(spec, allow_patterns=HUB_STREAMED)
        except Exception as error:  # network, authentication, a gated model: one line naming it
            raise ModelLoadError(f"model: cannot fetch {spec!r} to stream it: {type(error).__name__}: "
                                 f"{str(error).splitlines()[0] if str(error) else ''}") from None
        source = "folder"
    check_safetensors(Path(location), spec)
    if source == "pruned":
        config, cls, _ = _pruned_class(Path(location))
        return location, config, None if cls is AutoModelForCausalLM else cls
    return location, load_model_config(str(location), trust_remote_code=trust_remote_code), None


@contextlib.contextmanager
def load_report_silenced():
    """transformers' warnings off within (its load report among them, a table of keys on stderr): what it reports
    `check_loaded` turns into one line, and the CLI's contract is one line."""
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


def check_loaded(spec: str, config: PretrainedConfig, loading: dict) -> None:
    """transformers loads a checkpoint whose tensors its config's class does not hold (unused ones left out, missing
    ones left at their random start, mismatched shapes re-initialised) with a report on stderr only: a config.json
    naming llama over Qwen2's tensors evaluated without its biases, over Gemma 2's at perplexity 419, exit 0. Any of
    the three is a ModelLoadError naming how many and the first."""
    for kind, said in (("missing_keys", "that its weights lack"), ("unexpected_keys", "that its class does not use"),
                       ("mismatched_keys", "of another shape than its class's")):
        keys = sorted(str(key[0] if isinstance(key, tuple) else key) for key in loading.get(kind) or ())
        if keys:
            raise ModelLoadError(f"model: {shown(spec)}'s weights do not match its config.json ({config.model_type}): "
                                 f"{len(keys)} tensors {said}, e.g. {keys[0]}; is config.json this checkpoint's?")


def held_split(model: PreTrainedModel) -> PreTrainedModel:
    """`model` with its family's fused projections (`Family.fused`: Phi-3's qkv_proj, gate_up_proj) held as their
    parts, in place: how taylor_tune holds every model it loads or builds."""
    fused = FAMILIES[model.config.model_type].fused
    if fused:
        split_fused(model, fused)
    return model


def check_safetensors(folder: Path, spec: str) -> None:
    """A model folder holds its weights as safetensors; ModelLoadError otherwise (pickle-based weights such as
    pytorch_model.bin can run code when read, and are never loaded)."""
    if not any(folder.glob("*.safetensors")):
        pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        found = f" (it has {', '.join(pickled[:3])}: pickled weights, never loaded)" if pickled else ""
        raise ModelLoadError(f"model: {spec!r} holds no safetensors weights{found}; save the model with "
                             "save_pretrained(..., safe_serialization=True) or convert it to safetensors")


def pruned_class_of(model_type: str) -> type:
    """The class that loads a free-layout folder of a dense family: its stock causal-LM class (transformers' own
    mapping, which also holds a class registered with `AutoModelForCausalLM.register`) with each layer shrunk to
    the folder's layout (`pruned_modeling.pruned_class`)."""
    return pruned_class(MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]])


def _pruned_class(directory: Path) -> tuple[PretrainedConfig, type, torch.dtype]:
    """A pruned folder's config, the class that builds it (its family's stock class when uniform, else the pruned
    class of `pruned_modeling`) and the dtype it was saved in; ModelLoadError for what is not one."""
    try:
        manifest = json.loads((directory / PRUNED_MANIFEST).read_text())
        config = AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"model: {directory} is not a readable pruned model: {str(error).splitlines()[0]}"
        ) from None
    uniform = manifest.get("uniform") is True  # a stock folder: the config's own class builds it
    if manifest.get("format") != 2 or not (uniform or hasattr(config, "pruned_layout")):
        raise ModelLoadError(f"model: {directory} is a pruned folder of an older format ({PRUNED_MANIFEST} format "
                             f"{manifest.get('format')}); prune the model again")
    cls = AutoModelForCausalLM if uniform else pruned_class_of(config.model_type)
    return config, cls, getattr(torch, manifest["dtype"])


def load_pruned(
    directory: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """Rebuild a model saved by `pruning.apply.save_pruned`; logits equal the saved model's exactly (same dtype).

    The folder's own copy of the modeling file is never run: the classes come from `pruned_modeling` here."""
    directory = Path(directory)
    config, cls, saved_dtype = _pruned_class(directory)
    check_safetensors(directory, str(directory))
    try:
        with building():
            model = cls.from_pretrained(directory, dtype=saved_dtype, use_safetensors=True)
    except (
        Exception
    ) as error:  # transformers and safetensors raise many kinds for a damaged folder; all mean "cannot load"
        first = str(error).splitlines()[0] if str(error) else ""
        raise ModelLoadError(
            f"model: cannot load the pruned model in {directory}: {type(error).__name__}: {first}"
        ) from None
    return held_split(model).to(device=device, dtype=dtype or saved_dtype).eval()
