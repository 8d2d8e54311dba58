"""Errors that are the user's to fix. The CLI prints them as one line and exits 2; anything else is a bug."""


SHOWN = 200  # characters of a bad value an error message echoes at most


def shown(value: object) -> str:
    """`repr(value)`, cut to SHOWN characters (a 50 MB value in a config file is not echoed whole)."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters)"


class TaylorTuneError(Exception):
    """Base of every error caused by input (config, files, models), never by our own code."""


class ConfigError(TaylorTuneError):
    """A configuration value is not allowed; the message names the field."""


class ModelLoadError(TaylorTuneError):
    """A model or tokenizer cannot be found, loaded or is of an unsupported architecture."""


class CalibrationError(TaylorTuneError):
    """The calibration source cannot supply the requested sequences."""


class PlanError(TaylorTuneError):
    """A pruning plan cannot meet its target under the method's constraints."""


class EvaluationError(TaylorTuneError):
    """An evaluation cannot run (bad window, missing data) or failed inside a named task."""


class ReportError(TaylorTuneError):
    """A report's input cannot be read (no such experiment, unknown model)."""


class StorageError(TaylorTuneError):
    """A sweep's storage (a folder or a URI) cannot be opened, listed, read or written, or holds what a sweep must
    not resume from (another program's state, a damaged one, one that anyone could have written)."""


class AssetError(TaylorTuneError):
    """A real-world asset is missing, fails its hash check or cannot be downloaded; the message says what to run."""
