"""Mixtral (8x7B, 8x22B): Mistral's attention and in every layer a sparse block of `num_local_experts` experts:
softmax over every expert's logit, the top `num_experts_per_tok`, always renormalised. GGUF: llama.cpp writes Mixtral
as `llama` with experts."""

from taylor_tune.sources.families.base import Experts, Family

FAMILY = Family(
    "mixtral", world_seed=10, gguf="llama", gguf_free=False,
    tiny=dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    experts=Experts(block="mlp", router="gate", count="num_local_experts"),
)
