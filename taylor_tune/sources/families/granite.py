"""Granite (IBM Granite 3.x dense): Llama's layer shape with four scalars in place of Llama's constants: the
embeddings times `embedding_multiplier`, each residual branch times `residual_multiplier`, attention scores times
`attention_multiplier` (not 1/sqrt(head_dim)), the logits divided by `logits_scaling`. Pruning touches none of them;
a pruned config must carry all four, or the reloaded model computes something else. GGUF: llama.cpp's `granite`,
the four as `embedding_scale`, `residual_scale`, `attention.scale` and `logit_scale`, as its converter writes them;
the free layout is refused (`deci` has none of the four)."""

from taylor_tune.sources.families.base import Family

FAMILY = Family(
    "granite", world_seed=4, gguf="granite", gguf_free=False,
    # away from 1 and from 1/sqrt(head_dim), so that a pruned config that lost one of them computes other logits
    tiny=dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.25, logits_scaling=8.0),
    scalars={"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
             "attention_multiplier": "attention_scale", "logits_scaling": "logit_scale"},
)
