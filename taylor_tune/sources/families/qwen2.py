"""Qwen2 and Qwen2.5: Llama's layer shape with biases on q, k and v (sliced with their rows). llama.cpp's qwen2
sizes q as hidden x hidden: a uniform cut of attention heads is written as deci, Llama's graph with those biases."""

from taylor_tune.sources.families.base import Family

FAMILY = Family("qwen2", world_seed=1, gguf="qwen2", gguf_whole_attention=True)
