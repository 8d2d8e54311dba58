"""The sweep: experiment files, one trial without Ray, the shared importance cache, and `tune/`, the Ray adapter.
The top of the pipeline: it may import every stage."""
