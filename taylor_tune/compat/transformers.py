"""transformers 5.23's private names: building a model from its config without initialising weights that a
state dict will overwrite at once (GGUF conversion); and one lock around every model build, because transformers
builds inside process-wide patches (below)."""

from __future__ import annotations

import threading

from taylor_tune.compat import missing

TESTED = "5.23"

# `from_pretrained` builds a model inside `no_tie_weights()` (it swaps `PreTrainedModel.tie_weights` for a no-op on
# the class) and `local_torch_dtype` (the process's default dtype). Two threads building at once interleave the saves
# and restores: the later restore puts the no-op back for good, and every tied model loaded afterwards in that
# process keeps its head on the meta device ("Cannot copy out of meta tensor"). Reentrant: a pruned folder's load
# nests a config read inside a load.
_BUILDING = threading.RLock()


def building() -> threading.RLock:
    """The lock each `from_pretrained` / `from_config` of the package holds: one model build per process at a time."""
    return _BUILDING


def no_init_weights():
    """A context manager in which `from_config` skips weight initialisation."""
    check()
    from transformers.initialization import no_init_weights as context

    return context()


def check() -> None:
    """Raise CompatError if a fenced name is gone."""
    try:
        from transformers.initialization import no_init_weights  # noqa: F401
    except ImportError:
        missing("transformers", TESTED, ["transformers.initialization.no_init_weights"])
