"""OLMo-2 (and the same layer in OLMo-3): `q_norm` / `k_norm` are RMSNorms over the **whole** query (key)
projection, `num_heads x head_dim` wide, applied before the heads are split; the norms come after attention and the
MLP (`post_attention_layernorm`, `post_feedforward_layernorm`), none before. Pruning a group slices the norms'
weights with its q and k rows, and they count in the group (their Taylor terms, their parameters). The pruned model
then normalises over the heads it kept: that is its function, and what "masked" means for this family
(`pruning.measured.masked`, and the tests' reference): the removed rows are left out of the norm's mean, not counted as
zeros. GGUF: llama.cpp's `olmo2` (the norms as `attn_q_norm` / `attn_k_norm`, NeoX RoPE, post norms) for the depth
layout and MLP-only width cuts: its loader sizes q as n_embd x n_embd with head size n_embd / n_head (llama.cpp's
src/llama-model.cpp), so a model with heads pruned cannot be expressed and is refused in one line; the free layout is
refused too (`deci` has neither norm)."""

from taylor_tune.sources.families.base import Family

FAMILY = Family(
    "olmo2", world_seed=5, gguf="olmo2", gguf_free=False, head_norm="sliced",
    gguf_whole_attention=True,
    attn_norms={"post_attention_layernorm": "post_attention_norm"},
    ffn_norms={"post_feedforward_layernorm": "post_ffw_norm"},
)
