"""The pruning engine: groups, one gradient pass of importance, pure planners, applying a plan to a model, the
diagnostics, and `prune.prune` running those stages in order. Imports `sources` and the root modules only."""
