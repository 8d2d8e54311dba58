"""Mistral: Llama's layer shape; its sliding window is off in the tiny model (the models pruned here use full
attention at the lengths evaluated)."""

from taylor_tune.sources.families.base import Family

FAMILY = Family("mistral", world_seed=2, gguf="llama", tiny={"sliding_window": None})
