"""The Ray Tune adapter: search spaces, the trainable, the sweep driver and status. With `compat.ray`, the only
code that imports ray."""
