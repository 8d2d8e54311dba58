"""Gemma 3 (text; `gemma3_text`): Gemma 2's layer (explicit `head_dim`, `query_pre_attn_scalar`, four norms of
x * (1 + w), embeddings scaled by sqrt(hidden)) without soft-capping, with Qwen3's per-head `q_norm` / `k_norm` (one
weight over `head_dim` shared by every head: kept whole), and sliding-window layers (five to one in the released
models) whose RoPE base differs from the global layers' (`rope_parameters` per layer type). GGUF: not written yet."""

from taylor_tune.sources.families.base import Family

FAMILY = Family(
    "gemma3_text", pruned_class="PrunedGemma3ForCausalLM", gguf=None, head_norm="shared",
    tiny=dict(sliding_window=8, query_pre_attn_scalar=8,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]),
    attn_norms={"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm"},
    ffn_norms={"pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"},
)
