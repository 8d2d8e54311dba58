"""Progress bars: drawn on a terminal (a pseudo-terminal here), absent from pipes."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from tests.sweep_helpers import REPO, env

pytestmark = pytest.mark.slow  # each case starts a CLI process (~10 s of imports)

PRUNE = ["prune", "--model", "tiny-llama", "--method", "taylor", "--seq-len", "16", "--num-samples", "8",
         "--calibration", "world", "--device", "cpu"]
EVALUATE = ["evaluate", "--model", "tiny-llama", "--tasks", "piqa", "--limit", "6", "--ppl", "world", "--device", "cpu"]


def run_on_a_terminal(args: list[str]) -> tuple[int, str]:
    leader, follower = pty.openpty()
    fcntl.ioctl(
        follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0)
    )  # a new pty is 0 x 0: no room for a bar
    proc = subprocess.Popen(
        [sys.executable, "-m", "taylor_tune", *args],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        cwd=REPO,
        env=env(),
        close_fds=True,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return proc.wait(timeout=300), b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize(
    "args, bars",
    [(PRUNE, ["calibration (world)", "importance", "tok/s"]), (EVALUATE, ["perplexity", "zero-shot", "req/s"])],
)
def test_a_terminal_shows_the_stage_bars_and_a_pipe_shows_none(args, bars, tmp_path):
    code, shown = run_on_a_terminal([*args, "--output", str(tmp_path / "tty")])
    assert code == 0, shown[-2000:]
    assert all(b in shown for b in bars), shown[-2000:]
    assert "Running loglikelihood requests" not in shown and "Loading weights" not in shown  # library bars stay off
    piped = subprocess.run([sys.executable, "-m", "taylor_tune", *args, "--output", str(tmp_path / "pipe")],
                           capture_output=True, text=True, cwd=REPO, env=env(), timeout=300)
    assert piped.returncode == 0, piped.stderr[-2000:]
    assert not any(b in piped.stdout + piped.stderr for b in bars), piped.stderr[-2000:]
    assert "%|" not in piped.stderr
