"""An experiment's folder (`<storage_path>/<name>`), guarded before a sweep starts or resumes in it: whose it is
(resuming unpickles its state), whether its state is intact, whether it was started with other settings, and
whether its storage has room. Reads JSON only; unpickles nothing. The experiment file's schema is `experiment`."""

from __future__ import annotations

import json
import logging
import os
import posixpath
import shutil
import tempfile
from fnmatch import fnmatch
from pathlib import Path

from taylor_tune.config import Evaluation
from taylor_tune.errors import ConfigError
from taylor_tune.jsonio import linked_part, write_whole
from taylor_tune.reporting.frame import open_filesystem
from taylor_tune.schema import EXPERIMENT_RECORD, RACE_FILE
from taylor_tune.storage import storage_problem
from taylor_tune.sweep.experiment import Experiment, Resources, Search
from taylor_tune.sweep.race_state import RaceStateError, check_race

SAVED_EXPERIMENT = EXPERIMENT_RECORD  # the settings a sweep started with, written before Tune saves state


def check_experiment_folder(experiment: Experiment) -> None:
    """`<storage_path>/<name>` is a folder or does not exist yet (a local path)."""
    if "://" in experiment.storage_path:
        return
    folder = Path(experiment.storage_path) / experiment.name
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"name: {folder} is a file, not an experiment folder; choose another name or storage_path")


def _top_files(folder: str) -> tuple[object, dict[str, str]]:
    """The experiment folder's filesystem and its top-level files (name -> path inside that filesystem; {} where the
    folder does not exist yet): the one reading of a folder's Tune state that every guard below shares, a local path
    and a URI alike, so that none of them holds on a disk and not in a bucket."""
    from pyarrow import fs

    filesystem, root = open_filesystem(folder)
    try:
        found = filesystem.get_file_info(fs.FileSelector(root, allow_not_found=True, recursive=False))
    except OSError as error:
        raise ConfigError(f"{folder}: cannot be listed ({_first_line(error)})") from None
    return filesystem, {i.base_name: i.path for i in found if i.type == fs.FileType.File}


def _read_bytes(filesystem, path: str, shown: str) -> bytes:
    try:
        with filesystem.open_input_stream(path) as stream:
            return stream.read()
    except OSError as error:
        raise ConfigError(f"{shown}: unreadable ({_first_line(error)}); a resume reads it") from None


def _first_line(error: BaseException) -> str:
    """An OSError's reason (a local one's strerror, an object store's first line), without its traceback."""
    text = getattr(error, "strerror", None) or str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def _states(files: dict[str, str]) -> list[str]:
    """The names of a folder's experiment states, oldest first (Tune names them by time)."""
    return sorted(n for n in files if n.startswith("experiment_state-") and n.endswith(".json"))


def check_ours(folder: str) -> None:
    """A folder that holds a Tune experiment's state (`tuner.pkl`, `experiment_state-*.json`) but not the settings
    record every taylor_tune sweep writes before Tune saves anything (`SAVED_EXPERIMENT`) is another program's: a
    resume would unpickle its state, so it is refused before anything in it is read, in a bucket as on a disk
    (TAYLOR_TUNE_TRUST_EXPERIMENT=1 opts in, as for `check_resume_trust`)."""
    if os.environ.get("TAYLOR_TUNE_TRUST_EXPERIMENT") == "1":
        return
    _, files = _top_files(folder)
    tune_state = [n for n in files if n == "tuner.pkl" or n in _states(files)]
    if tune_state and SAVED_EXPERIMENT not in files:
        found = ", ".join(sorted(tune_state)[:2])
        raise ConfigError(f"{folder} holds a Ray Tune experiment ({found}) that taylor_tune did not write (no "
                          f"{SAVED_EXPERIMENT}); resuming would unpickle its state: choose another name or "
                          "storage_path, or set TAYLOR_TUNE_TRUST_EXPERIMENT=1 if you trust it")


def check_resume_trust(folder: str) -> None:
    """Resuming is Ray's `Tuner.restore`, which unpickles the folder's state (`pickled_state`: `tuner.pkl`, the
    searcher's `searcher-state-*.pkl`, the `*state*.json` files with pickled blobs): a local folder, or one of those
    files, that another user owns or every user can write is refused unless the user opts in with
    TAYLOR_TUNE_TRUST_EXPERIMENT=1 (README: what is trusted in an experiment folder). Group-writable is let through:
    with per-user groups (umask 002) it is every file a user writes. A bucket has no owner per file: its access
    control is the trust decision there (docs/operations.md)."""
    root = Path(folder)
    if "://" in folder or not root.is_dir() or os.environ.get("TAYLOR_TUNE_TRUST_EXPERIMENT") == "1":
        return
    for path in (root, *(root / name for name in pickled_state(p.name for p in root.iterdir()))):
        info = path.stat()
        problem = ("is owned by another user" if info.st_uid != os.getuid()
                   else "is writable by every user" if info.st_mode & 0o002 else None)
        if problem:
            raise ConfigError(f"{path} {problem}, and resuming the sweep would unpickle its state (running code it "
                              "names); make it yours alone (chmod o-w) or set TAYLOR_TUNE_TRUST_EXPERIMENT=1")


def pickled_state(names) -> list[str]:
    """Of an experiment folder's top-level names, every file that Ray's restore unpickles: each pickle (`tuner.pkl`,
    the searcher's `searcher-state-*.pkl`, and any other a Tune version adds there) and each state file in JSON that
    carries pickled blobs (`experiment_state-*.json`, `search_gen_state-*.json`, `basic-variant-state-*.json`)."""
    return sorted(n for n in names if fnmatch(n, "*.pkl") or fnmatch(n, "*state*.json"))


def check_pickles_whole(folder: str) -> None:
    """Every pickle a resume would read is whole (`pickled_state`: the .pkl files, and Ray's pickles under a .json name
    such as `basic-variant-state-*.json`): its opcodes are walked up to the STOP that ends it (`pickletools`: read,
    never run). A searcher state cut short made Ray print a traceback, restart the search and hand out finished
    configurations again; it is refused with one line instead, in a bucket as on a disk."""
    import pickletools

    filesystem, files = _top_files(folder)
    for name in pickled_state(files):
        shown = f"{folder.rstrip('/')}/{name}"
        data = _read_bytes(filesystem, files[name], shown)
        if not name.endswith(".pkl") and data[:1] != b"\x80":  # JSON (a pickle starts with PROTO, Ray's .json too)
            continue
        try:
            for _ in pickletools.genops(data):
                pass
        except Exception as error:  # genops raises ValueError for a cut, others for bytes that are no pickle
            raise ConfigError(f"{shown} is damaged ({str(error).splitlines()[0] or type(error).__name__}), and a "
                              "resume would restart the search from nothing over the finished trials; restore it "
                              "from a copy, or run the experiment under another --name") from None


def check_state_intact(folder: str) -> None:
    """The experiment state a resume would start from parses, or none does. Ray restores from the newest
    `experiment_state-*.json`; a damaged one made it log a warning and start an empty sweep over the finished one
    (every result gone from its state). With an intact older state, refused: the user moves the damaged one aside
    to resume from it. With none intact (a state cut short by a full disk before any whole one was written) the
    sweep starts afresh (`set_aside_damaged_state`), reusing every finished trial from its folder. Read as JSON only:
    nothing is unpickled here."""
    filesystem, files = _top_files(folder)
    states = _states(files)
    parses = {name: _parses(filesystem, files[name]) for name in states}
    if states and not parses[states[-1]] and any(parses[name] for name in states[:-1]):
        intact = next(name for name in reversed(states) if parses[name])
        raise ConfigError(f"{folder.rstrip('/')}/{states[-1]}: the experiment state is damaged, and resuming from it "
                          f"would start the sweep afresh over its finished trials; the previous state {intact} is "
                          "intact: move the damaged file aside to resume from it (the trials' folders hold every "
                          "finished result)")


def check_race_state(folder: str) -> None:
    """A racing sweep resumes only from a race whose state reads back whole and whose compared items are what its
    trials reported (`race_state.check_race`): otherwise one line naming the file, before Ray starts. Read through
    the sweep's storage, a local folder or a URI alike."""
    filesystem, root = open_filesystem(folder)
    if "://" not in folder and (linked := linked_part(root, posixpath.join(root, RACE_FILE))) is not None:
        raise ConfigError(f"{linked} is a symbolic link, and a racing sweep keeps its state there ({RACE_FILE}): it "
                          "would be read and written outside the sweep; make it a folder of the sweep's own")
    try:
        check_race(filesystem, root)
    except RaceStateError as error:
        raise ConfigError(str(error)) from None


def has_state(folder: str) -> bool:
    """Whether the folder holds an experiment state to resume from (the newest parses)."""
    filesystem, files = _top_files(folder)
    states = _states(files)
    return bool(states) and _parses(filesystem, files[states[-1]])


def set_aside_damaged_state(folder: str) -> list[str]:
    """Every experiment state file in a folder where none is intact, renamed to `<name>.damaged` (kept, never read
    again; in a bucket, copied and removed): the sweep then starts afresh rather than resuming from a state cut
    short. Call with the driver lock. Returns the new names."""
    filesystem, files = _top_files(folder)
    states = _states(files)
    if not states or _parses(filesystem, files[states[-1]]):
        return []
    logging.getLogger(__name__).warning(
        "%s: no intact experiment state (%s set aside as .damaged); the sweep starts afresh and reuses every "
        "finished trial from its folder", folder, ", ".join(states))
    for name in states:
        filesystem.move(files[name], files[name] + ".damaged")
    return [name + ".damaged" for name in states]


def _parses(filesystem, path: str) -> bool:
    try:
        with filesystem.open_input_stream(path) as stream:
            return isinstance(json.loads(stream.read().decode("utf-8")).get("trial_data"), list)
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        return False


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
    from pyarrow import fs  # pyarrow's file systems: the record is kept in the sweep's storage, local or a URI

    now = json.loads(json.dumps(experiment.model_dump(exclude={"storage_path"}), default=str))
    filesystem, root = open_filesystem(folder)
    saved_path = f"{folder.rstrip('/')}/{SAVED_EXPERIMENT}"
    record = f"{root.rstrip('/')}/{SAVED_EXPERIMENT}"
    names = {i.base_name for i in filesystem.get_file_info(fs.FileSelector(root, allow_not_found=True))}
    started = "tuner.pkl" in names or any(n.startswith("experiment_state-") and n.endswith(".json") for n in names)
    try:
        if not started or SAVED_EXPERIMENT not in names:
            raise FileNotFoundError
        with filesystem.open_input_stream(record) as stream:
            saved = json.loads(stream.read().decode("utf-8"))
    except FileNotFoundError:
        write_whole(filesystem, record, (json.dumps(now, indent=2, sort_keys=True) + "\n").encode())
        return
    except (OSError, ValueError, UnicodeDecodeError) as error:
        raise ConfigError(f"{saved_path}: unreadable ({type(error).__name__}); it records the settings the sweep "
                          "started with") from None
    old, new, defaults = flat(saved), flat(now), _added_defaults()
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k)
                     and not (k not in old and k in defaults and new[k] == defaults[k]))
    if changed:
        raise ConfigError(f"{folder} was started with other settings ({', '.join(changed)} differ); a resume runs the "
                          f"settings it started with: restore the file, or run the edited one under another --name")


# Free space a local sweep needs before it starts: its state (rewritten every second), trials' folders and caches.
MIN_FREE_BYTES = 64 * 2**20


def free_bytes(path: str) -> int | None:
    """Free bytes on the file system of a local path (or of its nearest existing parent); None for a URI."""
    if "://" in path:
        return None
    existing = next(p for p in (Path(path), *Path(path).parents) if p.exists())
    return shutil.disk_usage(existing).free


def megabytes(count: int) -> str:
    return f"{count / 2**20:.1f} MB"


def storage_full(storage_path: str) -> str | None:
    """A one-line description of a local storage with less than MIN_FREE_BYTES free, else None."""
    free = free_bytes(storage_path)
    if free is None or free >= MIN_FREE_BYTES:
        return None
    return (f"storage_path: {storage_path} has {megabytes(free)} free, and a sweep needs at least "
            f"{megabytes(MIN_FREE_BYTES)} there (its state, trial folders and caches)")


def check_object_storage(storage_path: str) -> None:
    """A URI storage (s3://, gs://, any pyarrow opens) checked before Ray starts: it opens, its bucket exists, the
    credentials are taken, and this process can write there (a probe object written and removed). ConfigError in one
    line naming storage_path and what failed; nothing is left behind."""
    import uuid

    from pyarrow import fs

    try:
        filesystem, root = fs.FileSystem.from_uri(storage_path)
    except Exception as error:  # ArrowInvalid for an unknown scheme or parameter, OSError for a filesystem's start
        raise ConfigError(f"storage_path: {storage_path} cannot be opened ({str(error).splitlines()[0]})") from None
    probe = f"{root.rstrip('/')}/.taylor-tune-write-probe-{uuid.uuid4().hex}"
    # a listing (a GET, whose error body names the cause: a HEAD's has none), then a probe written and removed
    step = f"listing {root}"
    try:
        filesystem.get_file_info(fs.FileSelector(root, allow_not_found=True, recursive=False))
        bucket = root.strip("/").split("/")[0]
        step = f"reading the bucket {bucket}"
        if filesystem.get_file_info(bucket).type == fs.FileType.NotFound:  # some servers would make it on a write
            raise OSError(f"NO_SUCH_BUCKET: the bucket {bucket} does not exist")
        existed = filesystem.get_file_info(root).type != fs.FileType.NotFound
        step = "writing a probe object"
        with filesystem.open_output_stream(probe) as stream:
            stream.write(b"taylor_tune")
        step = "removing the probe object"
        filesystem.delete_file(probe)
        if not existed:  # pyarrow leaves a folder marker where the probe was: the folder was not there before
            filesystem.delete_dir(root)
    except Exception as error:
        said = str(error).splitlines()[0][:200]
        raise ConfigError(f"storage_path: {storage_path}: {storage_problem(error)} ({step}: {said}); nothing was "
                          "written") from None


def check_storage(storage_path: str) -> None:
    """The storage path must be writable (local paths: by writing a probe, with at least MIN_FREE_BYTES free; a URI
    such as s3:// by `check_object_storage`)."""
    if "://" in storage_path:
        check_object_storage(storage_path)
        return
    if Path(storage_path).exists() and not Path(storage_path).is_dir():
        raise ConfigError(f"storage_path: {storage_path} is a file, not a folder")
    try:
        Path(storage_path).mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=storage_path, prefix=".write-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise ConfigError(f"storage_path: {storage_path} is not writable ({error.strerror})") from None
    if (full := storage_full(storage_path)) is not None:
        raise ConfigError(f"{full}; free space or choose another storage_path")
