"""The synthetic world's generator and trainer: used by scripts/make_offline_world.py (and the regeneration test),
not shipped in the package, which carries only their output (taylor_tune/data/world)."""
