"""What a family declares (`Family`): the one place where a model family's traits live."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts family's sparse block (`Family.experts`): the decoder layer's attribute that holds it, the
    block's router (a `weight` of one row per expert), and the config field that counts the experts of a layer. The
    experts themselves are transformers' `experts` module of the block: `gate_up_proj` [experts, 2 x width, hidden]
    and `down_proj` [experts, hidden, width], whatever the checkpoint's own names (transformers converts them)."""

    block: str = "mlp"
    router: str = "gate"
    count: str = "num_experts"
    # whether a token's top-k gates sum to one: always (True), or as the named config field says (Qwen3-MoE's and
    # OLMoE's `norm_topk_prob`); and whether the graph of llama.cpp's architecture for the family renormalises them
    # (its qwen3moe, llama and granitemoe do, its olmoe does not): a model whose routing differs is not written
    renormalised: bool | str = True
    gguf_renormalised: bool = True


@dataclass(frozen=True)
class Window:
    """What llama.cpp's graph for a family with sliding-window layers (Gemma's, its src/llama-model.cpp) hard-codes,
    so that a model which differs is refused rather than written to compute something else (`Family.gguf_window`):
    the global layer every `period`th from the start, the others sliding; soft-capped always (`capped`: with its
    defaults, 50 and 30, where the file names none) or never; the output read from the token embeddings
    (`tied_output`); with one RoPE per layer type, the type whose RoPE the file holds (`rope_of`) and the sliding
    layers' plain RoPE base it assumes (`sliding_rope_base`). Attention is scaled by 1/sqrt(head_dim) in all."""

    period: int
    capped: bool
    tied_output: bool
    rope_of: str | None = None
    sliding_rope_base: float | None = None


@dataclass(frozen=True)
class Family:
    """A decoder family taylor_tune prunes (transformers' `model_type`) and the traits that matter for it.

    - `gguf`: llama.cpp's architecture for the uniform and depth layouts, None where `export --gguf` refuses;
    - `gguf_free`: whether the free layout (layers of different widths) is written as llama.cpp's `deci`, whose
      graph is Llama's; a family whose layers hold more than Llama's (Qwen3's head norms) is refused there, naming
      the uniform layout;
    - `tiny`: the fields the tiny random model's config adds to the shared tiny shape (`models.tiny_config`), so that
      it keeps the family's traits;
    - `head_norm`: "shared" when the attention normalises each head's q and k over `head_dim` with one weight for
      every head (Qwen3's `q_norm` / `k_norm`): never sliced with the heads, never part of a group; "sliced" when it
      normalises the whole q (k) projection (OLMo-2's): the weights are sliced with the heads and belong to the group,
      and the pruned model normalises over the rows it kept;
    - `scalars`: config fields that scale the computation (Granite's multipliers), each with the name of the `gguf`
      writer's method suffix (`add_<name>`) that puts it in the file as llama.cpp's converter does;
    - `norm_offset`: what the GGUF's norm weights add to the model's (Gemma computes x * (1 + w); llama.cpp's graph
      x * w, so its converter writes 1 + w);
    - `gguf_f32_tolerance`: the export's check of an f32 file in llama.cpp, where the family's activation is computed
      there less exactly than the default bounds (`to_gguf.TOLERANCE`) allow: llama.cpp's CPU GELU rounds its input
      to f16 and reads an f16 table (ggml-cpu's GGML_GELU_FP16), so Gemma's f32 files are ~1e-4 to 1e-3 nats off;
    - `gguf_whole_attention`: llama.cpp's graph for `gguf` sizes the attention from the hidden size (OLMo-2's:
      q is n_embd x n_embd, head size n_embd / n_head), so a model with heads pruned, or whose heads x head_dim is
      not its hidden size, is refused there in one line (depth and MLP cuts are written); `gguf_whole_kv`: k and v
      too (OLMoE's, whose k_norm is hidden-wide), so grouped-query attention is refused there as well;
    - `attn_norms` / `ffn_norms`: each decoder layer's norms that go with its attention (its MLP), by module name,
      with their GGUF names: where the norms sit differs by family (Llama's before each block, OLMo-2's after);
    - `fused`: projections that hold several of Llama's in one matrix (Phi-3's `qkv_proj`, `gate_up_proj`), by their
      path in a decoder layer, with the parts their rows hold, in order. A loaded model holds each as its parts
      (`pruned_modeling.split_fused`): groups, every method, LoRA and the memory estimate then see Llama's
      projections; a stock folder is written fused again (`pruning.apply.save_pruned`);
    - `gguf_fused`: the GGUF tensor each fused projection is written as (llama.cpp's `attn_qkv`, `ffn_up`);
    - `all_biases`: its config's `attention_bias` / `mlp_bias` put a bias on every projection (Llama's), which its
      stock class builds and llama.cpp's graph for it reads: output biases (FLAP's compensation) stay stock there;
    - `gguf_rope_scalings`: the RoPE scalings written as GGUF (Llama 3.1's `llama3` on Llama, as `rope_freqs`);
    - `gguf_window`: what llama.cpp's graph hard-codes of its sliding-window layers (`Window`), None without them;
    - `world_seed`: the seed its built-in tiny model was trained with (scripts/make_offline_world.py); it also orders
      `FAMILIES` (a new family takes the next);
    - `short`: the built-in tiny models' name for the family where not its `model_type` (`tiny_name`);
    - `experts`: a mixture of experts (`Experts`): its layers' MLP is a router over experts, pruned by removing
      experts (the `experts` method) and saved as a stock model with fewer experts; the width and depth methods are
      the dense families' (None), and such a family has no free layout.

    A dense family's free-layout folder loads through the pruned class made from its stock class
    (`models.pruned_class_of`, `pruned_modeling.pruned_class`): nothing to declare for it."""

    model_type: str
    gguf: str | None
    gguf_free: bool = True
    tiny: dict = field(default_factory=dict)
    head_norm: str | None = None
    scalars: dict[str, str] = field(default_factory=dict)
    gguf_whole_attention: bool = False
    gguf_whole_kv: bool = False
    norm_offset: float = 0.0
    gguf_f32_tolerance: dict | None = None
    attn_norms: dict[str, str] = field(default_factory=lambda: {"input_layernorm": "attn_norm"})
    ffn_norms: dict[str, str] = field(default_factory=lambda: {"post_attention_layernorm": "ffn_norm"})
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    gguf_fused: dict[str, str] = field(default_factory=dict)
    experts: Experts | None = None
    all_biases: bool = False
    gguf_rope_scalings: tuple[str, ...] = ("default",)
    gguf_window: Window | None = None
    world_seed: int | None = None
    short: str | None = None  # the built-in models' name for it where not its model_type (`gemma3` for gemma3_text)

    @property
    def tiny_name(self) -> str:
        """Its built-in model trained on the offline world (`tiny-<name>`); `-random` is its random one."""
        return f"tiny-{self.short or self.model_type}"
