"""transformers 5.23's private names: building a model from its config without initialising weights that a
state dict will overwrite at once (GGUF conversion); one lock around every model build, because transformers
builds inside process-wide patches (below); and one parse of a GGUF file per conversion."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

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
    """Within (and under `building()`): `gguf.GGUFReader(path)` parses each file once. transformers' GGUF loading
    (`load_gguf_checkpoint`, which imports the reader from gguf at each call) parses the whole file for the config,
    again for the tokenizer and again for the weights, and the parse reads the vocabulary one field part at a time:
    two of the three parses were most of a model asset's fetch. The reader only reads its memory map, so one serves
    all three."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    with building():  # the patch is process-wide: no other build may see it half-way
        gguf.GGUFReader = reader
        try:
            yield
        finally:
            gguf.GGUFReader = original


def check() -> None:
    """Raise CompatError if a fenced name is gone."""
    try:
        from transformers.initialization import no_init_weights  # noqa: F401
    except ImportError:
        missing("transformers", TESTED, ["transformers.initialization.no_init_weights"])
