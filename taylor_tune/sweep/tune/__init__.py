"""The Ray Tune adapter: the driver, the trainable, the search and the scheduler, the search space, the console, the
metrics and where to watch a sweep (dashboard). With `compat.ray`, the only code that imports ray (a sweep's status
reads Tune's saved state without it)."""
