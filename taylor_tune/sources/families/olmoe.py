"""OLMoE (OLMoE-1B-7B): OLMo's attention, its `q_norm` / `k_norm` over the whole q and k projections, and in every
layer a sparse block of `num_experts` experts: softmax over every logit, the top `num_experts_per_tok`, renormalised
only when `norm_topk_prob` (off in the released model). GGUF: llama.cpp's `olmoe`, whose graph
does not renormalise (`norm_topk_prob` true is refused there in one line) and sizes q, k and their norms from the
hidden size (no grouped-query attention, as in the release)."""

from taylor_tune.sources.families.base import Experts, Family

FAMILY = Family(
    "olmoe", world_seed=11, gguf="olmoe", gguf_free=False, head_norm="sliced", gguf_whole_attention=True,
    gguf_whole_kv=True,
    # its q_norm spans hidden_size: heads x head_dim must be the hidden size (8 x 8 = 64 in the tiny shape)
    tiny=dict(intermediate_size=64, num_attention_heads=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    experts=Experts(block="mlp", router="gate", count="num_experts", renormalised="norm_topk_prob",
                    gguf_renormalised=False),
)
