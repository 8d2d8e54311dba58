"""The model families taylor_tune prunes, each declared in one module of this package (`base.Family`): adding a
family is one module here, its tiny model (generated: scripts/make_offline_world.py trains it, `models.tiny_config`
builds its random one from the declaration) and its tests. Everything that depends on the family (the supported
list, the tiny models' names, the pruned folder's class, the GGUF architecture, the arch-wide tests) reads
`FAMILIES`, which is every module of this package that declares a `FAMILY`, in the order of their world seeds.
"""

import importlib
import pkgutil

from taylor_tune.sources.families.base import Experts, Family, Window


def declared() -> dict[str, Family]:
    """model_type -> Family for every module of this package that declares one, by world seed (then name)."""
    found = [getattr(importlib.import_module(f"{__name__}.{module.name}"), "FAMILY", None)
             for module in pkgutil.iter_modules(__path__) if module.name != "base"]
    ordered = sorted((f for f in found if isinstance(f, Family)),
                     key=lambda f: (f.world_seed is None, f.world_seed or 0, f.model_type))
    return {f.model_type: f for f in ordered}


FAMILIES: dict[str, Family] = declared()
# The dense families (every method) and the mixtures of experts (the experts method): `Family.experts`
DENSE = tuple(t for t, f in FAMILIES.items() if f.experts is None)
MIXTURES = tuple(t for t, f in FAMILIES.items() if f.experts is not None)

__all__ = ["DENSE", "FAMILIES", "MIXTURES", "Experts", "Family", "Window", "declared"]
