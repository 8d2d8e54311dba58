"""Evaluation of an in-memory model: perplexity, the zero-shot tasks through lm-eval, the scorers, and `evaluate`,
the one path that runs them. Imports `sources` and the root modules only (never `pruning`)."""
