"""A sweep's folder (`<storage_path>/<name>`), on a disk or in a bucket alike: its files read (the trials' records,
outcomes and windows, the settings record) and the guards a sweep passes before it starts or resumes there (whose
Tune state it is, whether its pickles are whole, whether its state parses, who could have written it).

Every file read from a sweep comes through `read_text`/`read_bytes`/`read_columns`: on a disk only a regular file
of the sweep's own (`jsonio.read_own`: no symbolic link, no file with other hard links), since what is read goes
into reports made to be shared. Reads JSON and parquet columns only; nothing here unpickles anything."""

from __future__ import annotations

import errno
import json
import logging
import os
import posixpath
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path

import pandas as pd
from pyarrow import fs

from taylor_tune.errors import StorageError
from taylor_tune.jsonio import linked_part, read_own, write_whole
from taylor_tune.storage.cache import StoreStats, retried
from taylor_tune.storage.location import (
    anyone_may_write,
    first_line,
    joined,
    local_folder,
    open_location,
    unreachable,
)
from taylor_tune.storage.names import (
    EXPERIMENT_RECORD,
    LEGACY_RACE_FILE,
    OUTCOME_COLUMNS,
    PPL_WINDOWS_FILE,
    RACE_FILE,
    outcomes_file,
)

log = logging.getLogger(__name__)
TRAINABLE = "sweep_trainable_"  # how Tune names a trial's folder: <trainable>_<trial id>_<index>_<params>_<date>


# ---------------------------------------------------------------- reading files


def read_text(filesystem, path: str, root: str | None = None) -> str | None:
    """A sweep's file as text, None where it is missing or unreadable; on a disk only a file of its own and, with
    `root` (the sweep's folder), none reached through a linked folder below it (a link would copy someone else's
    file into a report)."""
    data = read_bytes(filesystem, path, root)
    return None if data is None else data.decode("utf-8", errors="replace")


def read_bytes(filesystem, path: str, root: str | None = None) -> bytes | None:
    """`read_text`'s bytes."""
    if isinstance(filesystem, fs.LocalFileSystem):
        if root is not None and linked_part(root, path) is not None:
            return None
        return read_own(path)
    try:
        with filesystem.open_input_stream(path) as stream:
            return stream.read()
    except (FileNotFoundError, OSError):
        return None


def linked(folder: str, name: str) -> str | None:
    """The first symbolic link on the way from a local sweep folder to its file `name`, as a path; None where there
    is none, and always in a bucket (no links there)."""
    local = local_folder(folder)
    if local is None:
        return None
    _, root = open_location(folder)
    found = linked_part(root, posixpath.join(root, name))
    return None if found is None else str(found)


def leaves(filesystem, folder: str, name: str) -> bool:
    """Whether a folder's file is a symbolic link to somewhere outside the folder (only a disk has links)."""
    if not isinstance(filesystem, fs.LocalFileSystem):
        return False
    path = Path(folder) / name
    return path.is_symlink() and not path.resolve().is_relative_to(Path(folder).resolve())


def trial_id_of(folder_name: str) -> str:
    """The trial id in a trial folder's name (Tune names it `<trainable>_<trial id>_<index>_<params>_<date>`)."""
    return "_".join(folder_name.split("_")[2:4]) or folder_name


def read_reports(filesystem, trial_dir: str) -> tuple[str | None, list, int]:
    """A trial's result.json: its text (None when missing), every line that parses, and how many did not (a driver
    killed mid-write leaves a truncated last line)."""
    text = read_text(filesystem, posixpath.join(trial_dir, "result.json"))
    reports, broken = [], 0
    for line in (text or "").splitlines():
        if line.strip():
            try:
                reports.append(json.loads(line))
            except json.JSONDecodeError:
                broken += 1
    return text, reports, broken


def read_columns(trial_dir: str, name: str, columns: tuple[str, ...], index, filesystem=None) -> pd.DataFrame | None:
    """Plain columns of a parquet file in a trial's folder (`read_bytes`; nothing is unpickled), indexed by `index`;
    None when the trial did not write it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    filesystem, root = open_location(trial_dir, filesystem)
    data = read_bytes(filesystem, posixpath.join(root, name))
    if data is None:
        return None
    try:
        table = pq.read_table(pa.BufferReader(data), columns=list(columns))
    except OSError:
        return None
    return pd.DataFrame({column: table.column(column).to_numpy() for column in columns}).set_index(index)


def read_outcomes(trial_dir: str, stage: str, filesystem=None) -> pd.DataFrame | None:
    """A trial's per-item outcomes of one zero-shot pass (`names.outcomes_file`), indexed by (task, doc_id), columns
    acc and acc_norm (NaN where the task has none); None when the trial did not write them (it stopped before that
    pass, or ran before they were kept)."""
    return read_columns(trial_dir, outcomes_file(stage), OUTCOME_COLUMNS, ["task", "doc_id"], filesystem)


def read_ppl_windows(trial_dir: str, filesystem=None) -> pd.DataFrame | None:
    """A trial's perplexity windows (`names.PPL_WINDOWS_FILE`): each window's summed NLL and predicted tokens,
    indexed by window; None when the trial did not write them."""
    return read_columns(trial_dir, PPL_WINDOWS_FILE, ("window", "nll", "tokens"), "window", filesystem)


def trial_file(folder: str, name: str) -> tuple[str, str]:
    """(where, text) of a file of a trial's folder, a local path or a URI: on a disk only a regular file of the
    trial's own (`jsonio.read_own`), as every file read from a sweep. OSError when it cannot be read, ValueError when
    it is not UTF-8."""
    filesystem, root = open_location(folder)
    where, path = f"{str(folder).rstrip('/')}/{name}", posixpath.join(root, name)
    if isinstance(filesystem, fs.LocalFileSystem):
        data = read_own(path)
        if data is None:
            raise FileNotFoundError(errno.ENOENT, "missing, or not a regular file of the trial's own")
    else:
        with filesystem.open_input_stream(path) as stream:
            data = stream.read()
    try:
        return where, data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"not UTF-8 ({error.reason})") from None


# ---------------------------------------------------------------- the race's state


def race_file(filesystem, root: str) -> str | None:
    """A racing sweep's state file under the experiment folder `root` (`names.RACE_FILE`; an older version kept it
    at the top, `LEGACY_RACE_FILE`), None for a sweep that never raced."""
    for name in (RACE_FILE, LEGACY_RACE_FILE):
        path = posixpath.join(root, name)
        if filesystem.get_file_info(path).type == fs.FileType.File:
            return path
    return None


def write_race(filesystem, root: str, data: bytes) -> None:
    """The race's state written whole at `names.RACE_FILE`, never through a link planted below the sweep folder."""
    write_whole(filesystem, posixpath.join(root, RACE_FILE), data, root)


# ---------------------------------------------------------------- a running trial's files in storage


def upload(filesystem, path: str, data: bytes, stats: StoreStats) -> None:
    """A file of a trial into its folder in storage, whole and never through a link planted there
    (`jsonio.write_whole`: the storage may be a folder others can write); transient errors retried and counted."""
    retried(lambda: write_whole(filesystem, path, data), stats, path)


def copy_out(filesystem, folder: str, names, into: Path) -> bool:
    """The files `names` of a folder in storage, copied into the local folder `into` (each read as `read_bytes`
    reads it: on a disk a regular file of the folder's own, never through a link); False where one is missing or
    cannot be read."""
    for name in names:
        data = read_bytes(filesystem, f"{folder}/{name}")
        if data is None:
            return False
        (into / name).write_bytes(data)
    return True


def sibling_folders_holding(filesystem, folder: str, name: str, wanted) -> Iterator[str]:
    """The other folders beside `folder` (the experiment's other trials) whose JSON file `name` holds `wanted`."""
    for info in filesystem.get_file_info(fs.FileSelector(posixpath.dirname(folder))):
        if info.type != fs.FileType.Directory or info.path == folder:
            continue
        data = read_bytes(filesystem, f"{info.path}/{name}")
        try:
            same = data is not None and json.loads(data) == wanted
        except ValueError:  # not a trial folder's file (UnicodeDecodeError is one)
            continue
        if same:
            yield info.path


def restore(filesystem, path: str, local: Path) -> bool:
    """A file in storage copied to `local` where it exists there (read as `read_bytes` reads it); False where it does
    not or cannot be read."""
    data = read_bytes(filesystem, path)
    if data is None:
        return False
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_bytes(data)
    return True


# ---------------------------------------------------------------- the folder's listing


def experiment_entries(location: str, filesystem=None) -> tuple[fs.FileSystem, str, list[fs.FileInfo]]:
    """(filesystem, root, its top-level entries) of an experiment folder; StorageError naming the location when it
    cannot be listed (an object store's endpoint down, credentials refused) or is no folder."""
    filesystem, root = open_location(location, filesystem)
    try:
        if not isinstance(filesystem, fs.LocalFileSystem):  # a listing first: a GET's error names its cause (a
            filesystem.get_file_info(fs.FileSelector(root, allow_not_found=True))  # HEAD's has no body to say it)
        info = filesystem.get_file_info(root)
        entries = filesystem.get_file_info(fs.FileSelector(root, recursive=False)) \
            if info.type == fs.FileType.Directory else []
    except OSError as error:
        raise unreachable(location, error) from None
    if info.type != fs.FileType.Directory:
        raise StorageError(f"{location}: no such experiment folder")
    return filesystem, root, entries


def trial_dirs(filesystem, entries: list[fs.FileInfo]) -> list[str]:
    """The trial folders among an experiment's entries: folders holding a params.json; on a disk never a linked one
    (it is another's, never read as ours)."""
    local = isinstance(filesystem, fs.LocalFileSystem)
    return sorted(e.path for e in entries if e.type == fs.FileType.Directory
                  and not (local and os.path.islink(e.path))
                  and filesystem.get_file_info(posixpath.join(e.path, "params.json")).type == fs.FileType.File)


def trial_folders(filesystem, root: str) -> dict[str, str]:
    """trial id -> its folder under the experiment, for every folder Tune named as a trial's."""
    found = {}
    for info in filesystem.get_file_info(fs.FileSelector(root, recursive=False)):
        if info.type == fs.FileType.Directory and info.base_name.startswith(TRAINABLE):
            found.setdefault(trial_id_of(info.base_name), info.path)
    return found


def top_files(folder: str) -> tuple[fs.FileSystem, dict[str, str]]:
    """The experiment folder's filesystem and its top-level files (name -> path inside that filesystem; {} where the
    folder does not exist yet): the one reading of a folder's Tune state that every guard below shares, so that none
    of them holds on a disk and not in a bucket."""
    filesystem, root = open_location(folder)
    try:
        found = filesystem.get_file_info(fs.FileSelector(root, allow_not_found=True, recursive=False))
    except OSError as error:
        raise StorageError(f"{folder}: cannot be listed ({first_line(error)})") from None
    return filesystem, {i.base_name: i.path for i in found if i.type == fs.FileType.File}


def _read_whole(filesystem, path: str, shown: str) -> bytes:
    try:
        with filesystem.open_input_stream(path) as stream:
            return stream.read()
    except OSError as error:
        raise StorageError(f"{shown}: unreadable ({first_line(error)}); a resume reads it") from None


# ---------------------------------------------------------------- the settings record


def started(folder: str) -> bool:
    """Whether Tune has saved the sweep's state in the folder (`tuner.pkl` or an experiment state)."""
    _, files = top_files(folder)
    return "tuner.pkl" in files or bool(states(files))


def read_record(folder: str) -> dict | None:
    """The settings a started sweep recorded (`EXPERIMENT_RECORD`), None where the sweep has not started (no Tune
    state) or has no record; StorageError when the record is there and cannot be read."""
    filesystem, files = top_files(folder)
    if not ("tuner.pkl" in files or states(files)) or EXPERIMENT_RECORD not in files:
        return None
    try:
        with filesystem.open_input_stream(files[EXPERIMENT_RECORD]) as stream:
            return json.loads(stream.read().decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnicodeDecodeError) as error:
        raise StorageError(f"{folder.rstrip('/')}/{EXPERIMENT_RECORD}: unreadable ({type(error).__name__}); it records "
                           "the settings the sweep started with") from None


def write_record(folder: str, settings: dict) -> None:
    """The settings a sweep starts with, written whole into its folder before Tune saves anything."""
    filesystem, root = open_location(folder)
    write_whole(filesystem, f"{root.rstrip('/')}/{EXPERIMENT_RECORD}",
                (json.dumps(settings, indent=2, sort_keys=True) + "\n").encode())


# ---------------------------------------------------------------- the guards on Tune's state


def states(files) -> list[str]:
    """The names of a folder's experiment states, oldest first (Tune names them by time)."""
    return sorted(n for n in files if n.startswith("experiment_state-") and n.endswith(".json"))


def pickled_state(names) -> list[str]:
    """Of an experiment folder's top-level names, every file that Ray's restore unpickles: each pickle (`tuner.pkl`,
    the searcher's `searcher-state-*.pkl`, and any other a Tune version adds there) and each state file in JSON that
    carries pickled blobs (`experiment_state-*.json`, `search_gen_state-*.json`, `basic-variant-state-*.json`)."""
    return sorted(n for n in names if fnmatch(n, "*.pkl") or fnmatch(n, "*state*.json"))


def trusted() -> bool:
    """The user's opt-in to resume from a folder the guards would refuse (TAYLOR_TUNE_TRUST_EXPERIMENT=1)."""
    return os.environ.get("TAYLOR_TUNE_TRUST_EXPERIMENT") == "1"


def check_experiment_folder(folder: str) -> None:
    """The experiment's folder is a folder, or does not exist yet (a bucket has no files in the way of a prefix)."""
    local = local_folder(folder)
    if local is not None and local.exists() and not local.is_dir():
        raise StorageError(f"name: {local} is a file, not an experiment folder; choose another name or storage_path")


def check_ours(folder: str, listed: tuple | None = None) -> None:
    """A folder that holds a Tune experiment's state (`tuner.pkl`, `experiment_state-*.json`) but not the settings
    record every taylor_tune sweep writes before Tune saves anything (`EXPERIMENT_RECORD`) is another program's: a
    resume would unpickle its state, so it is refused before anything in it is read, in a bucket as on a disk
    (TAYLOR_TUNE_TRUST_EXPERIMENT=1 opts in, as for `check_resume_trust`)."""
    if trusted():
        return
    _, files = listed or top_files(folder)
    tune_state = [n for n in files if n == "tuner.pkl" or n in states(files)]
    if tune_state and EXPERIMENT_RECORD not in files:
        found = ", ".join(sorted(tune_state)[:2])
        raise StorageError(f"{folder} holds a Ray Tune experiment ({found}) that taylor_tune did not write (no "
                           f"{EXPERIMENT_RECORD}); resuming would unpickle its state: choose another name or "
                           "storage_path, or set TAYLOR_TUNE_TRUST_EXPERIMENT=1 if you trust it")


def check_resume_trust(folder: str, listed: tuple | None = None) -> None:
    """Resuming is Ray's `Tuner.restore`, which unpickles the folder's state (`pickled_state`): refused unless the
    user opts in with TAYLOR_TUNE_TRUST_EXPERIMENT=1 (README: what is trusted in an experiment folder) where someone
    else could have written it. On a disk: the folder, or one of those files, owned by another user or writable by
    every user (group-writable is let through: with per-user groups, umask 002, it is every file a user writes). In
    an S3 bucket, which has no owner per file: a folder that a client without credentials may write into
    (`location.anyone_may_write`), checked where there is state to unpickle."""
    if trusted():
        return
    local = local_folder(folder)
    if local is None:
        filesystem, files = listed or top_files(folder)
        if pickled_state(files) and anyone_may_write(filesystem, open_location(folder)[1]):
            raise StorageError(f"{folder} can be written by anyone (a client without credentials wrote a probe "
                               "there), and resuming the sweep would unpickle its state (running code it names); "
                               "close the bucket's policy to writes without credentials, or set "
                               "TAYLOR_TUNE_TRUST_EXPERIMENT=1")
        return
    if not local.is_dir():
        return
    for path in (local, *(local / name for name in pickled_state(p.name for p in local.iterdir()))):
        info = path.stat()
        problem = ("is owned by another user" if info.st_uid != os.getuid()
                   else "is writable by every user" if info.st_mode & 0o002 else None)
        if problem:
            raise StorageError(f"{path} {problem}, and resuming the sweep would unpickle its state (running code it "
                               "names); make it yours alone (chmod o-w) or set TAYLOR_TUNE_TRUST_EXPERIMENT=1")


def check_pickles_whole(folder: str, listed: tuple | None = None) -> None:
    """Every pickle a resume would read is whole (`pickled_state`: the .pkl files, and Ray's pickles under a .json name
    such as `basic-variant-state-*.json`): its opcodes are walked up to the STOP that ends it (`pickletools`: read,
    never run). A searcher state cut short made Ray print a traceback, restart the search and hand out finished
    configurations again; it is refused with one line instead, in a bucket as on a disk."""
    import pickletools

    filesystem, files = listed or top_files(folder)
    for name in pickled_state(files):
        shown = f"{folder.rstrip('/')}/{name}"
        data = _read_whole(filesystem, files[name], shown)
        if not name.endswith(".pkl") and data[:1] != b"\x80":  # JSON (a pickle starts with PROTO, Ray's .json too)
            continue
        try:
            for _ in pickletools.genops(data):
                pass
        except Exception as error:  # genops raises ValueError for a cut, others for bytes that are no pickle
            raise StorageError(f"{shown} is damaged ({str(error).splitlines()[0] or type(error).__name__}), and a "
                               "resume would restart the search from nothing over the finished trials; restore it "
                               "from a copy, or run the experiment under another --name") from None


def check_state_intact(folder: str, listed: tuple | None = None) -> None:
    """The experiment state a resume would start from parses, or none does. Ray restores from the newest
    `experiment_state-*.json`; a damaged one made it log a warning and start an empty sweep over the finished one
    (every result gone from its state). With an intact older state, refused: the user moves the damaged one aside
    to resume from it. With none intact (a state cut short by a full disk before any whole one was written) the
    sweep starts afresh (`set_aside_damaged_state`), reusing every finished trial from its folder."""
    filesystem, files = listed or top_files(folder)
    found = states(files)
    parses = {name: _parses(filesystem, files[name]) for name in found}
    if found and not parses[found[-1]] and any(parses[name] for name in found[:-1]):
        intact = next(name for name in reversed(found) if parses[name])
        raise StorageError(f"{folder.rstrip('/')}/{found[-1]}: the experiment state is damaged, and resuming from it "
                           f"would start the sweep afresh over its finished trials; the previous state {intact} is "
                           "intact: move the damaged file aside to resume from it (the trials' folders hold every "
                           "finished result)")


def has_state(folder: str) -> bool:
    """Whether the folder holds an experiment state to resume from (the newest parses)."""
    filesystem, files = top_files(folder)
    found = states(files)
    return bool(found) and _parses(filesystem, files[found[-1]])


def set_aside_damaged_state(folder: str) -> list[str]:
    """Every experiment state file in a folder where none is intact, renamed to `<name>.damaged` (kept, never read
    again; in a bucket, copied and removed): the sweep then starts afresh rather than resuming from a state cut
    short. Call with the driver lock. Returns the new names."""
    filesystem, files = top_files(folder)
    found = states(files)
    if not found or _parses(filesystem, files[found[-1]]):
        return []
    log.warning("%s: no intact experiment state (%s set aside as .damaged); the sweep starts afresh and reuses every "
                "finished trial from its folder", folder, ", ".join(found))
    for name in found:
        filesystem.move(files[name], files[name] + ".damaged")
    return [name + ".damaged" for name in found]


def check_resumable(folder: str) -> None:
    """Every guard a sweep passes before it starts or resumes in `folder`, in order, before Ray starts and before
    anything in the folder is unpickled: it is a folder (or nothing yet), its Tune state is taylor_tune's, no one
    else could have written it, its pickles are whole, and its newest state parses or none does. The folder is
    listed once for all of them (`listed`: what `top_files` returns; one listing of a bucket, not four)."""
    check_experiment_folder(folder)
    listed = top_files(folder)
    check_ours(folder, listed)
    check_resume_trust(folder, listed)
    check_pickles_whole(folder, listed)
    check_state_intact(folder, listed)


def _parses(filesystem, path: str) -> bool:
    try:
        with filesystem.open_input_stream(path) as stream:
            return isinstance(json.loads(stream.read().decode("utf-8")).get("trial_data"), list)
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        return False


def experiment_folder(storage_path: str, name: str) -> str:
    """Where a sweep named `name` keeps its folder in `storage_path`: a URI joined with `/`, a folder resolved."""
    return joined(storage_path, name)

