"""Qwen2 and Qwen2.5: Llama's layer shape with biases on q, k and v (sliced with their rows)."""

from taylor_tune.sources.families.base import Family

FAMILY = Family("qwen2", pruned_class="PrunedQwen2ForCausalLM", gguf="qwen2")
