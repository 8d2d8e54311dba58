"""The sweep: experiment files and their checks before Ray starts, one trial without Ray (`trial`), a sweep's status,
and `tune/`, the Ray adapter. The top of the pipeline: it may import every stage."""
