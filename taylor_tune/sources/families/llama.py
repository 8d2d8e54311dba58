"""Llama (Llama 2, Llama 3 and 3.x, SmolLM2): separate q/k/v/o and gate/up/down projections, grouped-query
attention, no biases by default (`attention_bias` / `mlp_bias` give every projection one); Llama 3.1's `llama3` RoPE
scaling written as llama.cpp's `rope_freqs`."""

from taylor_tune.sources.families.base import Family

FAMILY = Family("llama", world_seed=0, gguf="llama", all_biases=True,
                gguf_rope_scalings=("default", "llama3"))
