"""taylor_tune: search for the best group-normalized Taylor structured-pruning configuration per LLM.

The engine (models, calibration, importance, methods, apply, prune) works without Ray; the Ray
adapter lives apart. Nothing here runs at import time: import the submodule you need.
"""

__version__ = "0.1.0"
