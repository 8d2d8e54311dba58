"""An experiment's settings against its folder: a sweep resumes only with the settings it started with
(`check_unchanged`), and a racing sweep only from a race state its trials agree with (`check_race_state`). The
folder itself, its files and the guards on Tune's state are the storage room's (`storage.folder`)."""

from __future__ import annotations

import json

from taylor_tune.config import Evaluation
from taylor_tune.errors import ConfigError
from taylor_tune.storage.folder import linked, read_record, write_record
from taylor_tune.storage.location import open_location
from taylor_tune.storage.location import storage_full as storage_full  # where a resumed sweep's pickles name it
from taylor_tune.storage.names import EXPERIMENT_RECORD, RACE_FILE
from taylor_tune.sweep.experiment import Experiment, Resources, Search
from taylor_tune.sweep.race_state import RaceStateError, check_race

SAVED_EXPERIMENT = EXPERIMENT_RECORD  # the settings a sweep started with, written before Tune saves state


def check_race_state(folder: str) -> None:
    """A racing sweep resumes only from a race whose state reads back whole and whose compared items are what its
    trials reported (`race_state.check_race`): otherwise one line naming the file, before Ray starts. Read through
    the sweep's storage, a local folder or a URI alike."""
    if (link := linked(folder, RACE_FILE)) is not None:
        raise ConfigError(f"{link} is a symbolic link, and a racing sweep keeps its state there ({RACE_FILE}): it "
                          "would be read and written outside the sweep; make it a folder of the sweep's own")
    filesystem, root = open_location(folder)
    try:
        check_race(filesystem, root)
    except RaceStateError as error:
        raise ConfigError(str(error)) from None


def flat(value, prefix: str = "") -> dict:
    """A nested mapping as one level of dotted keys (`prune.seed`)."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): value}


def _added_defaults() -> dict:
    """The flat default of every field of the sections with defaults: a record written before a newer taylor_tune
    added one of them (evaluation.speed, say) lacks it, and its default there is no change (an added field whose
    default is None, such as objectives or search_space.sparsity, reads as None from the record either way)."""
    sections = {"evaluation": Evaluation(), "search": Search(), "resources": Resources()}
    return flat(json.loads(json.dumps({k: v.model_dump() for k, v in sections.items()}, default=str)))


def check_unchanged(experiment: Experiment, folder: str) -> None:
    """A sweep resumes only with the settings it was started with: the first start records them in the experiment
    folder, a later one compares and names every field that differs (Tune's restore would silently keep the old
    ones); a field the record lacks that has its default is not a difference. Another name (`--name`) starts the
    edited experiment anew. The record binds only once Tune has saved the sweep's state: a run refused or stopped
    before any state was saved leaves nothing to resume, and its name is free for other settings."""
    now = json.loads(json.dumps(experiment.model_dump(exclude={"storage_path"}), default=str))
    saved = read_record(folder)
    if saved is None:
        write_record(folder, now)
        return
    old, new, defaults = flat(saved), flat(now), _added_defaults()
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k)
                     and not (k not in old and k in defaults and new[k] == defaults[k]))
    if changed:
        raise ConfigError(f"{folder} was started with other settings ({', '.join(changed)} differ); a resume runs the "
                          f"settings it started with: restore the file, or run the edited one under another --name")
