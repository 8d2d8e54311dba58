"""Gemma 3 (text; `gemma3_text`): Gemma 2's layer (explicit `head_dim`, `query_pre_attn_scalar`, four norms of
x * (1 + w), embeddings scaled by sqrt(hidden)) without soft-capping, with Qwen3's per-head `q_norm` / `k_norm` (one
weight over `head_dim` shared by every head: kept whole), and sliding-window layers (five to one in the released
models) whose RoPE base differs from the global layers' (`rope_parameters` per layer type). GGUF: llama.cpp's `gemma3`
(its norms, q_norm and k_norm included, as 1 + w; the global layers' RoPE base) where llama.cpp computes what the model
does: it hard-codes the window pattern (five sliding layers, then a global one) and the sliding layers' RoPE (base
10000), and scales attention by 1/sqrt(head_dim); a pruned Gemma 3 that left that pattern (most depth cuts) is refused
in one line."""

from taylor_tune.sources.families.base import Family, Window

FAMILY = Family(
    "gemma3_text", world_seed=7, gguf="gemma3", gguf_free=False, head_norm="shared",
    short="gemma3",
    norm_offset=1.0, scalars={"sliding_window": "sliding_window"},
    gguf_f32_tolerance={"mean": 1e-3, "max": 1e-2},  # llama.cpp's GELU through an f16 table (Family)
    tiny=dict(sliding_window=8, query_pre_attn_scalar=8,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]),
    attn_norms={"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm"},
    ffn_norms={"pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"},
    gguf_window=Window(period=6, capped=False, tied_output=False, rope_of="full_attention", sliding_rope_base=10000.0),
)
