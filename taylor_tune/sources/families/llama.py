"""Llama (Llama 2, Llama 3 and 3.x, SmolLM2): separate q/k/v/o and gate/up/down projections, grouped-query
attention, no biases by default."""

from taylor_tune.sources.families.base import Family

FAMILY = Family("llama", pruned_class="PrunedLlamaForCausalLM", gguf="llama")
