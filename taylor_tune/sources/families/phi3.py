"""Phi-3 (Phi-3, 3.5 and Phi-4, dense): q, k and v in one fused `qkv_proj` (rows: every query head, then the key
heads, then the value heads) and gate and up in one fused `gate_up_proj` (the gate's rows, then the up's), so an
attention group's rows sit in three slices of one matrix and an MLP channel's in two; partial RoPE (Phi-4-mini
rotates 3/4 of each head). Declared here as `fused`: each fused projection is held, once loaded, as its parts (the
same rows in that order, `pruned_modeling.split_fused`), so every method prunes Phi-3 as it prunes Llama, and a
stock folder is written fused again. GGUF: llama.cpp's `phi3` (`attn_qkv` and `ffn_up` fused as its converter writes
them, NeoX RoPE over the rotated dimensions) for the depth layout and MLP-only width cuts: its loader sizes q and
the attention output from the hidden size (src/llama-model.cpp), so a model with heads pruned is refused in one line,
as is the free layout (`deci` has no fused projections or partial RoPE)."""

from taylor_tune.sources.families.base import Family

FAMILY = Family(
    "phi3", world_seed=8, gguf="phi3", gguf_free=False, gguf_whole_attention=True,
    fused={"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")},
    gguf_fused={"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
    # Phi-4-mini's partial RoPE; no sliding window (llama.cpp's phi3 computes without one)
    tiny=dict(partial_rotary_factor=0.75, sliding_window=None),
)
