"""Qwen3 (dense): Llama's layer shape, no q/k/v biases, `head_dim` given explicitly, and `q_norm` / `k_norm`: an
RMSNorm over `head_dim` applied to every query (key) head with one shared weight. Pruning heads keeps the norms as
they are: slicing them would be wrong (they are not per head), and they belong to no group. GGUF: llama.cpp's
`qwen3` (the two norms as `attn_q_norm` / `attn_k_norm`, RoPE in HF's order) for the uniform and depth layouts;
the free layout is refused (`deci`, the per-layer architecture, has no head norms)."""

from taylor_tune.sources.families.base import Family

FAMILY = Family("qwen3", world_seed=3, gguf="qwen3", gguf_free=False, head_norm="shared")
