"""Gemma 2: `head_dim` (256) other than hidden / heads; attention scaled by `query_pre_attn_scalar`, not by the head
size; attention logits and final logits soft-capped (tanh); sliding-window layers alternating with global ones
(`layer_types`); four norms per layer (before and after attention and MLP), each computing x * (1 + w); embeddings
scaled by sqrt(hidden); GeGLU. Pruning keeps every one of them: the pruned config spells out `head_dim`, keeps the
scalar, the caps and the window types (cut with the layers by depth pruning). GGUF: not written yet (refused in one
line, naming the families that are)."""

from taylor_tune.sources.families.base import Family

FAMILY = Family(
    "gemma2", pruned_class="PrunedGemma2ForCausalLM", gguf=None,
    # caps and window small enough to act on the tests' short sequences; neither is the config class's default, so
    # that a pruned config which lost one reloads to other logits
    tiny=dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0, sliding_window=8, query_pre_attn_scalar=8,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    attn_norms={"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm"},
    ffn_norms={"pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"},
)
