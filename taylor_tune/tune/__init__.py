"""The Ray Tune adapter: search spaces, the trainable, the sweep driver and status. The only package that imports ray."""
