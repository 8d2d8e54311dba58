"""A trial's stages, each one's glue in its own module: run (what the stages share), pruning, speed, recovery,
evaluation. `sweep.trial` lists them in order and runs them."""
