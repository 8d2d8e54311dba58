"""Granite-MoE (Granite-3.x-1B-A400M, 3B-A800M): Granite's four scalars (`granite`) and in every layer a sparse
block (`block_sparse_moe`) of `num_local_experts` experts: the top `num_experts_per_tok` logits, softmax over those
alone. GGUF: llama.cpp's `granitemoe`, the four scalars as
`granite`'s."""

from taylor_tune.sources.families import granite
from taylor_tune.sources.families.base import Experts, Family

FAMILY = Family(
    "granitemoe", world_seed=12, gguf="granitemoe", gguf_free=False,
    tiny=dict(granite.FAMILY.tiny, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2),
    scalars=granite.FAMILY.scalars,
    experts=Experts(block="block_sparse_moe", router="router", count="num_local_experts"),
)
