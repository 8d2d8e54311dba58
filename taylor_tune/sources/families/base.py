"""What a family declares (`Family`): the one place where a model family's traits live."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    """A decoder family taylor_tune prunes (transformers' `model_type`) and the traits that matter for it.

    - `pruned_class`: the class of `sources.pruned_modeling` that loads a free-layout folder of this family;
    - `gguf`: llama.cpp's architecture for the uniform and depth layouts, None where `export --gguf` refuses;
    - `gguf_free`: whether the free layout (layers of different widths) is written as llama.cpp's `deci`, whose
      graph is Llama's; a family whose layers hold more than Llama's (Qwen3's head norms) is refused there, naming
      the uniform layout;
    - `tiny`: the fields the tiny random model's config adds to the shared tiny shape (`models.tiny_config`), so that
      it keeps the family's traits;
    - `head_norm`: "shared" when the attention normalises each head's q and k over `head_dim` with one weight for
      every head (Qwen3's `q_norm` / `k_norm`): never sliced with the heads, never part of a group."""

    model_type: str
    pruned_class: str
    gguf: str | None
    gguf_free: bool = True
    tiny: dict = field(default_factory=dict)
    head_norm: str | None = None
