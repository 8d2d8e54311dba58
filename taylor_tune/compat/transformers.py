"""transformers 5.23's private names: building a model from its config without initialising weights that a
state dict will overwrite at once (GGUF conversion)."""

from __future__ import annotations

from taylor_tune.compat import missing

TESTED = "5.23"


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
