"""The sweep console's watch of a full storage (issue 62, finding 8): the sweep is ended once, and Ray's records are
dropped from the moment the storage is full, never before."""

import logging

from taylor_tune.sweep.tune.console import FullStorage, QuietWhenFull, quiet_when_full, trial_line


class Disk:
    def __init__(self):
        self.full, self.looks = False, 0

    def __call__(self, path: str) -> str | None:
        self.looks += 1
        return f"{path} has 0.0 MB free" if self.full else None


def test_a_full_storage_ends_the_sweep_once_looking_at_most_every_second():
    disk, now, stops = Disk(), [0.0], []
    watch = FullStorage("/sweeps", clock=lambda: now[0], is_full=disk)
    watch.stop = lambda: stops.append(now[0])
    for t in (0.0, 0.4, 0.9, 1.0, 1.5):  # Tune steps
        now[0] = t
        watch.on_step_begin(0, [])
    assert disk.looks == 2 and stops == []  # at 0.0 and 1.0
    disk.full = True
    for t in (1.5, 2.0, 2.2, 3.0, 9.0):
        now[0] = t
        watch.on_step_begin(0, [])
    assert stops == [2.0] and watch.full and disk.looks == 3  # once, at the first look after it filled


def test_rays_records_are_dropped_only_while_the_storage_is_full():
    disk = Disk()
    quiet = QuietWhenFull("/sweeps", is_full=disk)
    record = lambda level: logging.LogRecord("ray.tune", level, __file__, 1, "Saving state failed", None, None)  # noqa: E731
    assert quiet.filter(record(logging.WARNING)) and quiet.filter(record(logging.INFO))
    assert disk.looks == 1  # an INFO record does not look at the disk
    disk.full = True
    assert quiet.filter(record(logging.INFO))  # not looked at: kept
    assert not quiet.filter(record(logging.ERROR)) and not quiet.filter(record(logging.INFO))  # full: all dropped
    assert disk.looks == 2


def test_the_filter_sits_on_rays_handlers_for_the_duration_only():
    handler = logging.StreamHandler()
    logging.getLogger("ray").addHandler(handler)
    try:
        with quiet_when_full("/sweeps") as quiet:
            assert quiet in handler.filters
        assert quiet not in handler.filters
    finally:
        logging.getLogger("ray").removeHandler(handler)


class Trial:
    def __init__(self, status="TERMINATED"):
        self.status, self.config, self.last_result = status, {"model": "tiny-llama"}, {}


def test_the_console_counts_the_trials_the_search_will_run_not_those_created_so_far():
    """Tune creates a limited grid's trials one at a time: the first of two used to read [1/1]."""
    import io

    from taylor_tune.sweep.tune.console import ConsoleCallback

    out, now = io.StringIO(), [0.0]
    console = ConsoleCallback("zero_shot_4", out=out, clock=lambda: now[0], total=2)
    console.on_trial_complete(0, [Trial()], Trial())
    now[0] = 60.0
    console.on_step_end(0, [Trial()])
    first, status = out.getvalue().splitlines()
    assert first.startswith("[1/2] tiny-llama") and status.endswith("1 finished, 0 running, 0 pending, 0 errored, of 2")
    console.on_trial_complete(0, [Trial()] * 3, Trial())  # more than planned (a resumed sweep's extra): what Tune has
    assert out.getvalue().splitlines()[-1].startswith("[2/3]")


def test_once_the_storage_is_full_the_console_prints_no_errored_trial_and_no_status_count():
    """A status line printed after the disk filled read "1 errored": the trial's error is the disk's, which the CLI
    says once. Before it fills, the status line counts as always."""
    import io

    from taylor_tune.sweep.tune.console import ConsoleCallback

    disk, out, now = Disk(), io.StringIO(), [0.0]
    console = ConsoleCallback("zero_shot_4", out=out, clock=lambda: now[0], storage="/sweeps", total=2, is_full=disk)
    now[0] = 31.0
    console.on_step_end(0, [Trial(), Trial("RUNNING")])
    assert out.getvalue().splitlines()[-1].endswith("1 finished, 1 running, 0 pending, 0 errored, of 2")
    disk.full = True
    errored = Trial("ERROR")
    errored.get_error = lambda: "OSError: [Errno 28] No space left on device"
    console.on_trial_error(0, [Trial(), errored], errored)
    now[0] = 62.0
    console.on_step_end(0, [Trial(), errored])
    assert len(out.getvalue().splitlines()) == 1 and console.ended == 1
    disk.full = False  # the same console with room: the error is the trial's own, and says so
    console.on_trial_error(0, [Trial(), errored], errored)
    assert out.getvalue().splitlines()[-1] == "[2/2] tiny-llama: errored: OSError: [Errno 28] No space left on device"


def test_a_trials_line_shows_its_decode_speedup_with_the_pairs_interval():
    config = {"model": "m", "pruning_method": "taylor", "taylor_seq_len": 64}
    result = {"ppl": 12.345, "acc_mean": 0.5, "decode_speedup": 1.153, "decode_speedup_low": 0.9,
              "decode_speedup_high": 1.478, "time_total_s": 7.4, "stage": "zero_shot_10"}
    line = trial_line(config, result, "zero_shot_10")
    assert line.endswith(": ppl 12.35, acc_mean 0.5000, decode 1.15x [0.90, 1.48], 7 s"), line
    one_pair = result | {"decode_speedup_low": None, "decode_speedup_high": None}  # no interval: none shown
    assert "decode 1.15x, 7 s" in trial_line(config, one_pair, "zero_shot_10")
