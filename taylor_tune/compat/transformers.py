"""transformers 5.23's private names: building a model from its config without initialising weights that a
state dict will overwrite at once (GGUF conversion); one lock around every model build, because transformers
builds inside process-wide patches (below); and one parse of a GGUF file per conversion."""

from __future__ import annotations

import contextlib
import functools
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


@contextlib.contextmanager
def one_gguf_parse():
    """Within (and under `building()`): `gguf.GGUFReader(path)` parses each file once, and `gguf.get_tensor_name_map`
    builds each architecture's name table once. transformers' GGUF loading imports both from gguf at each call; it
    parses the whole file for the config, again for the tokenizer and again for the weights (the parse reads the
    vocabulary one field part at a time), and builds the name table again for every module of the model. Both are
    read-only once built, so one serves every call; the repeats were most of a model asset's fetch."""
    import gguf

    originals = gguf.GGUFReader, gguf.get_tensor_name_map
    with building():  # the patch is process-wide: no other build may see it half-way
        gguf.GGUFReader, gguf.get_tensor_name_map = map(functools.cache, originals)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = originals


def check() -> None:
    """Raise CompatError if a fenced name is gone."""
    try:
        from transformers.initialization import no_init_weights  # noqa: F401
    except ImportError:
        missing("transformers", TESTED, ["transformers.initialization.no_init_weights"])
