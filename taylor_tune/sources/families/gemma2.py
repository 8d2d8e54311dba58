"""Gemma 2: `head_dim` (256) other than hidden / heads; attention scaled by `query_pre_attn_scalar`, not by the head
size; attention logits and final logits soft-capped (tanh); sliding-window layers alternating with global ones
(`layer_types`); four norms per layer (before and after attention and MLP), each computing x * (1 + w); embeddings
scaled by sqrt(hidden); GeGLU. Pruning keeps every one of them: the pruned config spells out `head_dim`, keeps the
scalar, the caps and the window types (cut with the layers by depth pruning). GGUF: llama.cpp's `gemma2` (caps and
window as its keys, norms written as 1 + w as its converter writes them, NeoX RoPE) for the uniform and depth
layouts, where llama.cpp can compute what the model does: its graph reads the output from the token embeddings (tied
embeddings only), scales attention by 1/sqrt(head_dim) (`query_pre_attn_scalar` = head_dim only) and puts the
sliding window on every even layer (the window types as they alternate); anything else is refused in one line."""

from taylor_tune.sources.families.base import Family, Window

FAMILY = Family(
    "gemma2", world_seed=6, gguf="gemma2", gguf_free=False, norm_offset=1.0,
    gguf_f32_tolerance={"mean": 1e-3, "max": 1e-2},  # llama.cpp's GELU through an f16 table (Family)
    scalars={"attn_logit_softcapping": "attn_logit_softcapping", "final_logit_softcapping": "final_logit_softcapping",
             "sliding_window": "sliding_window"},
    # caps and window small enough to act on the tests' short sequences; neither is the config class's default, so
    # that a pruned config which lost one reloads to other logits
    tiny=dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0, sliding_window=8, query_pre_attn_scalar=8,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    attn_norms={"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm"},
    ffn_norms={"pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"},
    gguf_window=Window(period=2, capped=True, tied_output=True),
)
