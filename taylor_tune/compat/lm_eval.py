"""lm-eval 0.4.13's private names: the task YAML loader and the HFLM internals the prefix scorer
builds on (it overrides `_loglikelihood_tokens` and reads the attributes HFLM's own version reads)."""

from __future__ import annotations

from pathlib import Path

from taylor_tune.compat import missing

TESTED = "0.4.13"
HFLM_METHODS = ("_loglikelihood_tokens", "_model_call", "_detect_batch_size")
HFLM_ATTRIBUTES = ("backend", "mixed_precision_dtype", "softmax_dtype", "cache_hook", "rank", "max_length", "device")


def load_task_yaml(path: Path) -> dict:
    """A registered task's YAML with its `!function` entries resolved, as lm-eval's TaskManager reads it."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return dict(load_yaml(path, resolve_func=True))


def check(lm=None) -> None:
    """Raise CompatError if a fenced name is gone; `lm`: an HFLM instance, to check its attributes too."""
    from lm_eval.models.huggingface import HFLM

    gone = [f"HFLM.{name}" for name in HFLM_METHODS if not callable(vars(HFLM).get(name))]  # HFLM's own, not a base's
    try:
        from lm_eval.tasks._yaml_loader import load_yaml  # noqa: F401
    except ImportError:
        gone.append("lm_eval.tasks._yaml_loader.load_yaml")
    if lm is not None:
        gone += [f"HFLM().{name}" for name in HFLM_ATTRIBUTES if not hasattr(lm, name)]
    missing("lm-eval", TESTED, gone)
