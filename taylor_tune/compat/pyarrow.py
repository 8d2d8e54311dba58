"""pyarrow 26's private layout: an `S3FileSystem`'s options as its pickling reduces them (`__reduce__`), the only
place pyarrow gives back the endpoint, region and scheme a filesystem was made with (the storage check makes a
second, anonymous client to the same place from them)."""

from __future__ import annotations

from taylor_tune.compat import missing

TESTED = "26"
S3_OPTIONS = ("endpoint_override", "region", "scheme", "anonymous", "access_key", "secret_key", "session_token",
              "role_arn", "session_name", "external_id")


def s3_options(filesystem) -> dict:
    """The keywords `S3FileSystem(...)` takes to make `filesystem` again; CompatError if pyarrow reduces it
    otherwise."""
    reduced = filesystem.__reduce__()
    arguments = reduced[1] if isinstance(reduced, tuple) and len(reduced) > 1 else ()
    options = arguments[0] if arguments and isinstance(arguments[0], dict) else None
    if options is None:
        missing("pyarrow", TESTED, ["S3FileSystem.__reduce__()'s options"])
    missing("pyarrow", TESTED, [f"S3FileSystem.__reduce__()'s {name!r}" for name in S3_OPTIONS if name not in options])
    return dict(options)


def check() -> None:
    """Raise CompatError if an S3 filesystem no longer reduces to its options."""
    from pyarrow import fs

    s3_options(fs.S3FileSystem(anonymous=True, region="us-east-1", endpoint_override="http://127.0.0.1:9"))
