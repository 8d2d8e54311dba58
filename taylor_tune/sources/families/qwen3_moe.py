"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (shared `q_norm` / `k_norm`) and, in every layer but
those of `mlp_only_layers` (and those off `decoder_sparse_step`), a sparse block of `num_experts` experts of width
`moe_intermediate_size`: softmax over every expert's logit, the top `num_experts_per_tok`, renormalised to sum to one
when `norm_topk_prob`. The tiny model keeps all of it: a dense layer among the sparse ones, experts narrower than
it, renormalised gates (the tests set `norm_topk_prob` both ways). GGUF: llama.cpp's `qwen3moe`, whose
graph has experts in every layer and renormalises the gates (`norm_topk_prob` true, no `mlp_only_layers`: the
released models' settings); others are refused in one line."""

from taylor_tune.sources.families.base import Experts, Family

FAMILY = Family(
    "qwen3_moe", world_seed=9, gguf="qwen3moe", gguf_free=False, head_norm="shared", short="qwen3moe",
    tiny=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
              decoder_sparse_step=1, mlp_only_layers=[2]),
    experts=Experts(block="mlp", router="gate", count="num_experts", renormalised="norm_topk_prob"),
)
