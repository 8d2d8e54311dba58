"""The model families taylor_tune prunes, each declared in one module of this package (`base.Family`): adding a
family is one module here, its pruned class in `sources.pruned_modeling`, and its tests. Everything that depends on
the family (the supported list, the tiny models, the pruned folder's class, the GGUF architecture) reads `FAMILIES`.
"""

from taylor_tune.sources.families import (
    gemma2,
    gemma3,
    granite,
    granitemoe,
    llama,
    mistral,
    mixtral,
    olmo2,
    olmoe,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from taylor_tune.sources.families.base import Experts, Family, Window

FAMILIES: dict[str, Family] = {f.model_type: f for f in (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY,
                                                         granite.FAMILY, olmo2.FAMILY, gemma2.FAMILY,
                                                         gemma3.FAMILY, phi3.FAMILY, qwen3_moe.FAMILY,
                                                         mixtral.FAMILY, olmoe.FAMILY, granitemoe.FAMILY)}
# The dense families (every method) and the mixtures of experts (the experts method): `Family.experts`
DENSE = tuple(t for t, f in FAMILIES.items() if f.experts is None)
MIXTURES = tuple(t for t, f in FAMILIES.items() if f.experts is not None)

__all__ = ["DENSE", "FAMILIES", "MIXTURES", "Experts", "Family", "Window"]
