"""A location: a local (or shared) folder, or a URI (`s3://bucket/sweeps`, `gs://...`, any scheme pyarrow opens).
This module is the one place that tells them apart (`is_uri`) and the one opener of either (`open_location`); the
rest of the package asks it. Whether a storage can hold a sweep is checked here too, before Ray starts."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

from pyarrow import fs

from taylor_tune.compat.pyarrow import s3_options
from taylor_tune.errors import StorageError

# What an object store's error says, and what it means for the user (pyarrow's AWS errors carry the SDK's code)
_STORAGE_ERRORS = (
    (("NETWORK_CONNECTION", "Could not connect", "Couldn't connect", "curlCode", "timed out", "Timeout",
      "Could not resolve"), "its endpoint cannot be reached"),
    (("NO_SUCH_BUCKET", "NoSuchBucket", "bucket does not exist"), "its bucket does not exist"),
    (("INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "InvalidAccessKeyId", "SignatureDoesNotMatch",
      "EXPIRED_TOKEN", "ExpiredToken", "No credentials", "MISSING_AUTHENTICATION_TOKEN"),
     "its credentials are refused"),
    (("ACCESS_DENIED", "AccessDenied", "Forbidden", "403"), "access is denied"),
)


def is_uri(location: str | Path) -> bool:
    """Whether `location` names object storage (a scheme: `s3://...`) rather than a folder of this machine's."""
    return "://" in str(location)


def local_folder(location: str | Path) -> Path | None:
    """The folder a local location names, None for a URI: what only a disk has (owners, modes, links, free space)."""
    return None if is_uri(location) else Path(location)


def open_location(location: str | Path, filesystem: fs.FileSystem | None = None) -> tuple[fs.FileSystem, str]:
    """(filesystem, path in it) of a folder or a URI (credentials and endpoint from the environment, as Ray Tune
    opens its own storage); with `filesystem` given, `location` is already a path in it. StorageError in one line
    when a URI cannot be opened (an unknown scheme, a bad parameter)."""
    location = str(location)
    if filesystem is not None:
        return filesystem, location
    if is_uri(location):
        try:
            return fs.FileSystem.from_uri(location)
        except Exception as error:  # ArrowInvalid for an unknown scheme or parameter, OSError for a filesystem's start
            raise StorageError(f"{location}: cannot be opened ({first_line(error)})") from None
    return fs.LocalFileSystem(), str(Path(location).resolve())


def as_given(location: str | Path, path: str) -> str:
    """A path inside `location`'s filesystem as the user names it: with its scheme for a URI (`s3://bucket/...`, not
    `bucket/...`), as it is for a folder."""
    location = str(location)
    return f"{location.split('://', 1)[0]}://{path}" if is_uri(location) else path


def joined(location: str | Path, *names: str) -> str:
    """`location`/`names` as the user names it: a URI with `/`, a folder as this machine's path."""
    if is_uri(location):
        return "/".join([str(location).rstrip("/"), *names])
    return str(Path(location).resolve().joinpath(*names))


def shown(path: str | Path) -> str:
    """A location as a card made to be published shows it: a URI as given; a folder relative to the current one where
    it lies inside it, else its last two parts (the machine's folders above them are nobody else's business)."""
    if is_uri(path):
        return str(path)
    absolute = Path(path).absolute()
    if absolute.is_relative_to(Path.cwd()):
        return str(absolute.relative_to(Path.cwd())) or "."
    return str(Path(*absolute.parts[-2:]))


def first_line(error: BaseException) -> str:
    """An OSError's reason (a local one's strerror, an object store's first line), without its traceback."""
    text = getattr(error, "strerror", None) or str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def storage_problem(error: Exception) -> str:
    """What an object store's error means for the user, in a few words (its endpoint cannot be reached, ...)."""
    text = str(error)
    for needles, meaning in _STORAGE_ERRORS:
        if any(needle in text for needle in needles):
            return meaning
    return "it cannot be used"


def unreachable(location: str | Path, error: OSError) -> StorageError:
    """The StorageError for a location that could not be listed or read: what the store's error means, and its
    first line."""
    return StorageError(f"{location}: {storage_problem(error)} ({first_line(error)})")


# ---------------------------------------------------------------- can it hold a sweep?

# Free space a local sweep needs before it starts: its state (rewritten every second), trials' folders and caches.
MIN_FREE_BYTES = 64 * 2**20


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the file system of a local path (or of its nearest existing parent); None for a URI."""
    folder = local_folder(path)
    if folder is None:
        return None
    existing = next(p for p in (folder, *folder.parents) if p.exists())
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


def check_storage(storage_path: str) -> None:
    """The storage path must be writable: a folder by writing a probe, with at least MIN_FREE_BYTES free; a URI by
    `check_object_storage`. StorageError in one line naming storage_path."""
    folder = local_folder(storage_path)
    if folder is None:
        check_object_storage(storage_path)
        return
    if folder.exists() and not folder.is_dir():
        raise StorageError(f"storage_path: {storage_path} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise StorageError(f"storage_path: {storage_path} is not writable ({error.strerror})") from None
    if (full := storage_full(storage_path)) is not None:
        raise StorageError(f"{full}; free space or choose another storage_path")


def check_object_storage(storage_path: str) -> None:
    """A URI storage (s3://, gs://, any pyarrow opens) checked before Ray starts: it opens, its bucket exists, the
    credentials are taken, and this process can write there (a probe object written and removed). StorageError in
    one line naming storage_path and what failed; nothing is left behind."""
    try:
        filesystem, root = fs.FileSystem.from_uri(storage_path)
    except Exception as error:  # ArrowInvalid for an unknown scheme or parameter, OSError for a filesystem's start
        raise StorageError(f"storage_path: {storage_path} cannot be opened ({str(error).splitlines()[0]})") from None
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
        raise StorageError(f"storage_path: {storage_path}: {storage_problem(error)} ({step}: {said}); nothing was "
                           "written") from None


def anyone_may_write(filesystem: fs.FileSystem, folder: str) -> bool | None:
    """Whether a client without credentials may write into `folder` of an S3 bucket: a probe object written
    anonymously, and removed if it was. What a world-writable file is on a disk: a bucket has no owner per file,
    but one whose policy lets anyone write can hold a pickle that anyone planted. None where it cannot be told (a
    store other than S3)."""
    if not isinstance(filesystem, fs.S3FileSystem):
        return None
    options = s3_options(filesystem)  # the same endpoint, region and scheme, without the credentials
    anonymous = fs.S3FileSystem(**{**options, "anonymous": True, "access_key": None, "secret_key": None,
                                   "session_token": None, "role_arn": "", "session_name": "", "external_id": "",
                                   "retry_strategy": fs.AwsStandardS3RetryStrategy(max_attempts=1)})
    probe = f"{folder.rstrip('/')}/.taylor-tune-anyone-probe-{uuid.uuid4().hex}"
    try:
        with anonymous.open_output_stream(probe) as stream:
            stream.write(b"taylor_tune")
    except OSError:
        return False
    try:
        filesystem.delete_file(probe)
    except OSError:
        pass
    return True
