"""GGUF checkpoint -> an HF folder (safetensors + tokenizer), the form every other loader reads.

Needs torch and transformers; `assets` imports it only when a model asset is converted, so that fetching data
assets never imports torch.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from taylor_tune.compat.transformers import building, no_init_weights, one_gguf_parse
from taylor_tune.errors import ModelLoadError


def convert_gguf(gguf: Path, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A GGUF checkpoint as an HF folder (safetensors + tokenizer): transformers dequantizes it to `dtype`.

    The model transformers loads from GGUF carries a quantization_config and refuses save_pretrained, so its
    weights move into a fresh model of the same class built from the config without it.
    """
    gguf = Path(gguf)
    try:
        with one_gguf_parse():
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(f"model: cannot read the GGUF file {gguf}: {str(error).splitlines()[0]}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with building(), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
