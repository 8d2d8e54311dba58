"""Bad input found by adversarial use (issue 27): one line naming the problem, exit 2, no traceback, nothing written
where it should not be. Each case failed before its fix (a traceback, a write outside the storage folder, exit 0)."""

import shutil

import pytest
import yaml

from taylor_tune.cli import main
from tests.sweep_helpers import SMALL

NOT_UTF8 = b"caf\xe9 \xff\xfe text\n"


def run(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(code, err, expected):
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("taylor-tune: error: ") and "Traceback" not in err, err
    assert expected in err, err


def experiment(tmp_path, **changes):
    data = {"name": "exp", **SMALL, "storage_path": str(tmp_path / "sweeps"), **changes}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("name", ["..", ".", "../escape", ".hidden"])
def test_an_experiment_name_is_one_path_component(capsys, tmp_path, name):
    code, _, err = run(capsys, "sweep", experiment(tmp_path), "--name", name)
    one_line(code, err, "name: String should match pattern")
    assert not (tmp_path / "sweeps").exists() and not list(tmp_path.glob("*.json"))  # nothing written, no state


def test_a_non_utf8_experiment_file_is_one_line(capsys, tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_bytes(NOT_UTF8)
    code, _, err = run(capsys, "sweep", path)
    one_line(code, err, "exp.yaml: not a UTF-8 text file")


@pytest.mark.parametrize("content, expected", [
    (b"taylor_seq_len: [1, 2\n", "is not valid YAML"),
    (b"taylor_seq_len: !!python/object:os.system {}\n", "is not valid YAML"),  # safe_load refuses the tag
    (NOT_UTF8, "is not a UTF-8 text file"),
    (b"root:x:0:0:root:/root:/bin/bash\nsecret-line-of-the-file\n", "does not hold a mapping of dimensions"),
])
def test_a_bad_search_space_file_is_one_line_and_not_echoed(capsys, tmp_path, content, expected):
    space = tmp_path / "space.yaml"
    space.write_bytes(content)
    code, _, err = run(capsys, "sweep", experiment(tmp_path, search_space=str(space)))
    one_line(code, err, f"search_space: {space} {expected}")
    assert "secret-line" not in err and "root:x" not in err


def test_a_storage_that_cannot_take_the_sweep_is_refused_before_torch_is_imported(tmp_path):
    """The storage and the folder are checked before the preflight's torch and transformers are imported (seconds
    of CPU): a refused storage is said at once. A fresh process, since this one has imported them already."""
    import json
    import subprocess
    import sys

    from tests.sweep_helpers import REPO, env

    code = ("import json, sys; from taylor_tune.cli import main; code = main(['sweep', sys.argv[1]]); "
            "print(json.dumps([code, sorted(m for m in ('torch', 'transformers') if m in sys.modules)]))")
    proc = subprocess.run([sys.executable, "-c", code, str(experiment(tmp_path, storage_path="/proc/no-write"))],
                          capture_output=True, text=True, cwd=REPO, env=env(), timeout=120)
    assert "storage_path: /proc/no-write is not writable" in proc.stderr, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [2, []]


def test_an_experiment_folder_that_is_a_file_is_one_line(capsys, tmp_path):
    (tmp_path / "sweeps").mkdir()
    (tmp_path / "sweeps" / "exp").write_text("not a folder")
    code, _, err = run(capsys, "sweep", experiment(tmp_path))
    one_line(code, err, "is a file, not an experiment folder")


def test_non_utf8_calibration_and_perplexity_texts_are_one_line(capsys, tmp_path):
    text = tmp_path / "latin1.txt"
    text.write_bytes(NOT_UTF8 * 50)
    code, _, err = run(capsys, "prune", "--model", "tiny-llama-random", "--calibration", text, "--seq-len", "8",
                       "--num-samples", "2", "--device", "cpu", "--output", tmp_path / "out")
    one_line(code, err, f"calibration: {text} is not a UTF-8 text file")
    code, _, err = run(capsys, "evaluate", "--model", "tiny-llama-random", "--ppl", text, "--tasks", "",
                       "--device", "cpu", "--output", tmp_path / "e.json")
    one_line(code, err, f"ppl: {text} is not a UTF-8 text file")


def test_report_refuses_a_folder_that_is_no_experiment_and_an_output_that_is_a_file(capsys, tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("not a sweep")
    code, _, err = run(capsys, "report", tmp_path / "plain", "--output", tmp_path / "r")
    one_line(code, err, "not a Tune experiment folder")
    assert not (tmp_path / "r").exists()  # no empty report

    sweep = tmp_path / "sweep"
    shutil.copytree(tmp_path / "plain", sweep)
    (sweep / "experiment_state-2026-01-01_00-00-00.json").write_text('{"trial_data": []}')  # started, no trial yet
    (tmp_path / "file").write_text("a file")
    code, _, err = run(capsys, "report", sweep, "--output", tmp_path / "file")
    one_line(code, err, "--output: ")
    assert (tmp_path / "file").read_text() == "a file"


def test_a_sweep_does_not_resume_from_a_folder_other_users_can_write(capsys, tmp_path, monkeypatch):
    """Resuming unpickles Ray's state: a folder (or state file) others can write is refused unless the user opts in."""
    from taylor_tune.errors import StorageError
    from taylor_tune.storage.folder import check_resume_trust

    folder = tmp_path / "sweeps" / "exp"
    folder.mkdir(parents=True)
    (folder / "tuner.pkl").write_bytes(b"\x80\x05N.")
    (folder / "experiment_state-2026-01-01_00-00-00.json").write_text("{}")
    (folder / "taylor_tune_experiment.json").write_text("{}")  # a taylor_tune sweep's folder
    check_resume_trust(str(folder))  # yours alone: fine
    (folder / "tuner.pkl").chmod(0o664)
    check_resume_trust(str(folder))  # group-writable: every file of a user whose umask is 002
    (folder / "tuner.pkl").chmod(0o666)
    with pytest.raises(StorageError, match="tuner.pkl is writable by every user"):
        check_resume_trust(str(folder))
    code, _, err = run(capsys, "sweep", experiment(tmp_path))  # refused before Ray starts
    one_line(code, err, "is writable by every user, and resuming the sweep would unpickle its state")
    monkeypatch.setenv("TAYLOR_TUNE_TRUST_EXPERIMENT", "1")
    check_resume_trust(str(folder))


class Planted:
    """A pickle that, unpickled, writes the file it names: what a hostile tuner.pkl does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_tune_folder_taylor_tune_did_not_write_is_refused_before_anything_in_it_is_read(capsys, tmp_path,
                                                                                          monkeypatch):
    """Issue 62, finding 1: a plain Ray Tune experiment's folder (state, no taylor_tune settings record) named by a
    sweep: one line, exit 2, nothing unpickled (the planted tuner.pkl writes no marker), nothing written into it."""
    import json
    import pickle

    folder = tmp_path / "sweeps" / "exp"
    folder.mkdir(parents=True)
    marker = tmp_path / "unpickled"
    (folder / "tuner.pkl").write_bytes(pickle.dumps(Planted(marker)))
    (folder / "experiment_state-2026-01-01_00-00-00.json").write_text(json.dumps({"trial_data": []}))
    before = sorted(p.name for p in folder.iterdir())
    code, _, err = run(capsys, "sweep", experiment(tmp_path))
    one_line(code, err, "holds a Ray Tune experiment (experiment_state-2026-01-01_00-00-00.json, tuner.pkl) that "
             "taylor_tune did not write")
    assert not marker.exists() and sorted(p.name for p in folder.iterdir()) == before
    pickle.loads((folder / "tuner.pkl").read_bytes())  # the plant works: unpickling it would have run it
    assert marker.exists()


def test_a_searcher_state_others_can_write_or_cut_short_is_refused_before_anything_is_unpickled(capsys, tmp_path):
    """Issue 80: a TPE sweep's `searcher-state-<ts>.pkl` (Ray's restore unpickles it) made world-writable and replaced
    by a planted pickle: refused as tuner.pkl is, one line, exit 2, the plant never runs. Cut short (no malice):
    refused with one line naming it, where Ray printed a traceback, restarted the search and handed out finished
    configurations again."""
    import json
    import pickle

    folder = tmp_path / "sweeps" / "exp"
    folder.mkdir(parents=True)
    (folder / "tuner.pkl").write_bytes(pickle.dumps({"tuner": "state"}))
    (folder / "experiment_state-2026-01-01_00-00-00.json").write_text(json.dumps({"trial_data": []}))
    (folder / "taylor_tune_experiment.json").write_text("{}")
    marker = tmp_path / "unpickled"
    searcher = folder / "searcher-state-2026-01-01_00-00-00.pkl"
    searcher.write_bytes(pickle.dumps(Planted(marker)))
    searcher.chmod(0o666)
    code, _, err = run(capsys, "sweep", experiment(tmp_path))
    one_line(code, err, f"{searcher} is writable by every user, and resuming the sweep would unpickle its state")
    assert not marker.exists()

    searcher.chmod(0o644)
    whole = pickle.dumps({"studies": {"tiny-llama": list(range(50))}, "proposed": {"tiny-llama": 3}})
    for damaged in (whole[:-7], b"", b"not a pickle at all"):
        searcher.write_bytes(damaged)
        code, _, err = run(capsys, "sweep", experiment(tmp_path))
        one_line(code, err, f"{searcher} is damaged (")
        assert "a resume would restart the search from nothing over the finished trials" in err
    assert sorted(p.name for p in folder.iterdir()) == ["experiment_state-2026-01-01_00-00-00.json",
                                                        searcher.name, "taylor_tune_experiment.json", "tuner.pkl"]


def test_status_and_report_read_an_experiment_folder_as_data_and_unpickle_nothing(capsys, tmp_path):
    """docs/operations.md's trust section: status and report read a folder as data only. A finished sweep's folder
    (a taylor_tune record, trial folders) with pickles planted where Ray keeps them: tuner.pkl, a CLOUDPICKLE_FALLBACK
    blob in the state's trial config and runtime, a trial's checkpoint. Both commands read it (exit 0) and no plant
    runs."""
    import json
    import pickle

    from tests.report_helpers import synthetic_trials, write_tune_folder

    folder = write_tune_folder(synthetic_trials().head(6), tmp_path / "sweeps" / "exp")
    marker = tmp_path / "unpickled"
    blob = {"_type": "CLOUDPICKLE_FALLBACK", "value": pickle.dumps(Planted(marker)).hex()}
    (folder / "tuner.pkl").write_bytes(pickle.dumps(Planted(marker)))
    (folder / "taylor_tune_experiment.json").write_text("{}")
    trials = sorted(p for p in folder.iterdir() if p.is_dir())
    (trials[0] / "checkpoint.pkl").write_bytes(pickle.dumps(Planted(marker)))
    state = [[json.dumps({"trial_id": f"abcde_{i:05d}", "status": "TERMINATED", "config": {"model": "tiny-llama",
                                                                                          "planted": blob}}),
              json.dumps({"last_result": {"planted": blob}, "planted": blob})] for i in range(len(trials))]
    (folder / "experiment_state-2026-11-21_00-00-00.json").write_text(json.dumps({"trial_data": state}))
    code, out, err = run(capsys, "status", folder)
    assert code == 0 and out.startswith(f"trials: {len(trials)} ("), err
    code, out, err = run(capsys, "report", folder, "--output", tmp_path / "report")
    assert code == 0 and f"{len(trials)} trials ({len(trials)} valid" in out, err
    assert not marker.exists()
    pickle.loads((folder / "tuner.pkl").read_bytes())  # the plants work: unpickling one would have run it
    assert marker.exists()


def test_one_driver_per_experiment_folder(capsys, tmp_path):
    import json
    import os
    import socket
    import subprocess
    import sys

    from taylor_tune.errors import StorageError
    from taylor_tune.storage.lock import LOCK, driver_lock

    folder = tmp_path / "sweeps" / "exp"
    with driver_lock(str(folder)):
        with pytest.raises(StorageError, match="another driver"), driver_lock(str(folder)):
            pass
        held = json.loads((folder / LOCK).read_text())
        assert held == {"pid": os.getpid(), "host": socket.gethostname()}
        code, _, err = run(capsys, "sweep", experiment(tmp_path))  # a second driver: refused before Ray starts
        one_line(code, err, f"another driver (pid {os.getpid()} on this host) is running this sweep")
    assert not (folder / LOCK).exists()  # released

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (folder / LOCK).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    with driver_lock(str(folder)):  # a driver killed without releasing it: taken over
        assert json.loads((folder / LOCK).read_text())["pid"] == os.getpid()
    (folder / LOCK).write_text(json.dumps({"pid": 1, "host": "another-node"}))
    with pytest.raises(StorageError, match="another driver .pid 1 on another-node. holds"), driver_lock(str(folder)):
        pass


def test_an_edited_experiment_is_not_silently_resumed_with_its_old_settings(capsys, tmp_path):
    import json

    from taylor_tune.errors import ConfigError
    from taylor_tune.sweep.experiment import load_experiment
    from taylor_tune.sweep.folder import SAVED_EXPERIMENT, check_unchanged

    path = experiment(tmp_path)
    folder = tmp_path / "sweeps" / "exp"
    check_unchanged(load_experiment(path), str(folder))  # the first start records its settings
    assert (folder / SAVED_EXPERIMENT).is_file()
    (folder / "experiment_state-2026-01-01_00-00-00.json").write_text('{"trial_data": []}')  # Tune saved its state
    check_unchanged(load_experiment(path), str(folder))  # the same file resumes
    space = {**SMALL["search_space"], "pruning_method": {"grid": ["taylor", "blockwise", "layerwise"]}}
    edited = experiment(tmp_path, search_space=space, prune={**SMALL["prune"], "sparsity": 0.3})
    code, _, err = run(capsys, "sweep", edited)
    one_line(code, err, "was started with other settings (prune.sparsity, search_space.pruning_method.grid differ)")
    code, _, err = run(capsys, "sweep", edited, "--name", "exp")  # naming the same folder changes nothing
    assert code == 2

    # a record written before a newer taylor_tune added a field (evaluation.speed) resumes where the field has its
    # default, and not where the file sets another value
    saved = json.loads((folder / SAVED_EXPERIMENT).read_text())
    del saved["evaluation"]["speed"], saved["objectives"]  # and the dimensions added with the wider search space
    saved["search_space"] = {k: v for k, v in saved["search_space"].items() if k in SMALL["search_space"]}
    (folder / SAVED_EXPERIMENT).write_text(json.dumps(saved))
    check_unchanged(load_experiment(experiment(tmp_path)), str(folder))  # the original file again
    faster = experiment(tmp_path, evaluation={**SMALL["evaluation"], "speed": {"repeats": 5}})
    with pytest.raises(ConfigError, match=r"evaluation\.speed\.repeats differ"):
        check_unchanged(load_experiment(faster), str(folder))
    wider = experiment(tmp_path, search_space={**SMALL["search_space"], "uniform": {"grid": [False, True]}},
                       objectives=[{"metric": "acc_mean"}, {"metric": "decode_speedup"}])
    with pytest.raises(ConfigError, match=r"objectives, search_space\.uniform\.grid differ"):
        check_unchanged(load_experiment(wider), str(folder))


@pytest.mark.slow  # writes whole reports: seconds
@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_private_file_linked_into_a_trial_is_never_copied_into_the_report(capsys, tmp_path, link):
    """Issue 91, case 4: a trial's error.txt made a link (symbolic or hard) to a 0600 file outside the sweep: its last
    line went into all_methods_results.csv and both best-config files (0644). Every file read from a sweep is now a
    regular file of its own (`reporting.frame.read_text`): the linked one is not read, and no report file holds it."""
    import os

    from tests.report_helpers import synthetic_trials, write_tune_folder

    path = write_tune_folder(synthetic_trials(n_items=50).head(6), tmp_path / "exp")
    secret = tmp_path / "private.txt"
    secret.write_text("Traceback\nPrivateError: the-private-line-of-a-file-outside\n")
    secret.chmod(0o600)
    trials = sorted(p for p in path.iterdir() if p.is_dir())
    for trial in trials:
        (trial / "error.txt").unlink(missing_ok=True)
        (trial / "error.txt").symlink_to(secret) if link == "symbolic" else os.link(secret, trial / "error.txt")
    code, _, err = run(capsys, "report", path, "--output", tmp_path / "r")
    assert code == 0, err
    written = [p for p in (tmp_path / "r").rglob("*") if p.is_file()]
    assert any(p.name == "all_methods_results.csv" for p in written) and any(p.name == "best_config.json"
                                                                           for p in written)
    assert not [p for p in written if b"the-private-line" in p.read_bytes()]
    assert secret.read_text().endswith("outside\n")  # untouched


@pytest.mark.slow  # writes whole reports: seconds
def test_report_follows_no_symbolic_link_out_of_a_trial_or_into_the_output(capsys, tmp_path):
    from tests.report_helpers import synthetic_trials, write_tune_folder

    path = write_tune_folder(synthetic_trials(n_items=200), tmp_path / "exp")
    secret = tmp_path / "secret.json"
    secret.write_text('{"secret": "outside the experiment"}')
    for trial in path.glob("*/"):  # every trial's config.json is a link out of its folder
        (trial / "config.json").unlink(missing_ok=True)
        (trial / "config.json").symlink_to(secret)
    code, _, err = run(capsys, "report", path, "--output", tmp_path / "r")
    assert code == 0, err
    copied = list((tmp_path / "r").rglob("artifacts/config.json"))
    assert copied == [] and not any("outside the experiment" in p.read_text() for p in (tmp_path / "r").rglob("*.json"))
    assert "symbolic link out of the trial folder" in next((tmp_path / "r").rglob("MISSING.txt")).read_text()

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "r2").mkdir()
    (tmp_path / "r2" / "final_analysis_report.txt").symlink_to(victim)
    code, _, err = run(capsys, "report", path, "--output", tmp_path / "r2")
    one_line(code, err, "is a symbolic link, and the report would write through it")
    assert victim.read_text() == "keep me"


@pytest.mark.parametrize("changes, expected", [
    (dict(prune={**SMALL["prune"], "sparsity": 0.99}), "prune: taylor on tiny-llama cannot be planned"),
    pytest.param(dict(search_space={**SMALL["search_space"], "taylor_num_samples": {"grid": [8, 100000]}}),
                 "search_space: the largest draw of tiny-llama (100000 x 48 tokens) does not fit",
                 marks=pytest.mark.slow),  # tokenizes the whole corpus: seconds
    (dict(evaluation={**SMALL["evaluation"], "ppl": "world", "ppl_window": 100000}),
     "evaluation.ppl_window: 100000 is longer than the maximum context"),
    (dict(resources={"cpu": 1000, "gpu": 0}), "resources.cpu: 1000 CPUs per trial requested, but this machine has"),
    (dict(evaluation={**SMALL["evaluation"], "speed": {"prefill_len": 4096}}),
     "evaluation.speed: sequences of 4096 tokens (prefill_len, or prompt_len + new_tokens) exceed the maximum context"),
    (dict(prune={**SMALL["prune"], "uniform": True, "uniform_multiple": 100000}),
     "prune: taylor on tiny-llama cannot be planned with these settings: uniform_multiple: 100000 is wider"),
    (dict(prune={**SMALL["prune"], "servable": True}),  # tiny-llama's MLP is 256 channels: nothing to align to 256
     "prune: taylor on tiny-llama cannot be planned with these settings: servable: 256 is not narrower than the "
     "model's MLP (256 channels)"),
    (dict(search_space={**SMALL["search_space"], "taylor_seq_len": {"grid": [True]}}), "search_space.taylor_seq_len"),
    (dict(resources={"cpu": 1, "gpu": 0, "memory": 0.25}, prune={**SMALL["prune"], "micro_batch_size": 64},
          search_space={"taylor_seq_len": {"grid": [256]}, "taylor_num_samples": {"grid": [64]}}),
     "memory: taylor on tiny-llama: the importance pass needs at least"),
    (dict(prune={**SMALL["prune"], "sparsity": 0.9},  # a searched depth_share is planned at each of its values
          search_space={**SMALL["search_space"], "pruning_method": {"grid": ["taylor"]},
                        "depth_share": {"grid": [0.99]}}),
     "prune: taylor on tiny-llama cannot be planned with these settings (depth_share 0.99): depth: sparsity 0.89"),
    (dict(resources={"cpu": 1, "gpu": 0, "memory": 100000}),
     "resources.memory: 100000 GiB per trial requested, but this machine has"),
])
def test_what_prune_and_evaluate_refuse_is_refused_for_the_whole_space_before_ray(capsys, tmp_path, changes, expected):
    code, _, err = run(capsys, "sweep", experiment(tmp_path, **changes))
    one_line(code, err, expected)
    assert not (tmp_path / "sweeps" / "exp" / "tuner.pkl").exists()  # Tune never started


def test_a_damaged_experiment_state_is_not_resumed_over_and_status_reads_the_intact_one(capsys, tmp_path):
    """The newest state truncated, an older one intact: the sweep refuses in one line before Ray starts (Ray used to
    log a warning and start an empty sweep over the finished one, exit 0), and status reads the intact one."""
    import json

    folder = tmp_path / "sweeps" / "exp"
    folder.mkdir(parents=True)
    (folder / "tuner.pkl").write_bytes(b"\x80\x05N.")
    (folder / "taylor_tune_experiment.json").write_text("{}")  # a taylor_tune sweep's folder
    trial = {"trial_id": "t_00000", "status": "TERMINATED", "config": {"model": "tiny-llama"}}
    intact = json.dumps({"trial_data": [[json.dumps(trial), json.dumps({"last_result": {}})]]})
    (folder / "experiment_state-2026-01-01_00-00-00.json").write_text(intact)
    (folder / "experiment_state-2026-01-02_00-00-00.json").write_text(intact[: len(intact) // 2])
    code, _, err = run(capsys, "sweep", experiment(tmp_path))
    one_line(code, err, "experiment_state-2026-01-02_00-00-00.json: the experiment state is damaged")
    assert "the previous state experiment_state-2026-01-01_00-00-00.json is intact" in err
    code, out, err = run(capsys, "status", folder)
    assert code == 0, err
    assert out.startswith("trials: 1 (pending 0, running 0, finished 1, errored 0)")


@pytest.mark.parametrize("method, criterion, ranks", [("random", "flap", "ranks by no criterion"),
                                                      ("magnitude", "wanda_sp", "ranks by l1 or l2 only"),
                                                      ("depth", "l2", "ranks by no criterion")])
def test_a_criterion_the_method_does_not_use_is_refused_not_recorded(capsys, tmp_path, method, criterion, ranks):
    """Issue 62, finding 4: `prune --method random --criterion flap` exited 0 and its summary named a criterion the
    method never used. Refused in one line before the model loads; magnitude's own l1 is taken."""
    code, _, err = run(capsys, "prune", "--model", "tiny-llama", "--method", method, "--criterion", criterion,
                       "--output", tmp_path / "out")
    one_line(code, err, f"criterion: {method} {ranks}, so {criterion} would be recorded without being used")
    assert not (tmp_path / "out").exists()
    from taylor_tune.config import build_prune_config

    assert build_prune_config({"model": "tiny-llama", "method": "magnitude", "criterion": "l1"}).criterion == "l1"


@pytest.mark.parametrize("state", ['{"foo": 1, "trial_data": "x"}', '{"trial_data": [1, 2]}', '[1, 2]',
                                   '{"trial_data": [["{}", "[]"]]}'])
def test_a_state_that_is_not_tunes_is_named_as_such_by_status_and_report(capsys, tmp_path, state):
    """Issue 62, finding 7: a folder whose experiment_state-*.json is not a Tune state (another program's, or
    damaged): status blamed a Ray upgrade, report exited 0 after writing 9 files. Now both: one line naming the file
    as not Tune's, exit 2, nothing written."""
    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / "experiment_state-2026-01-01_00-00-00.json").write_text(state)
    expected = "experiment_state-2026-01-01_00-00-00.json is not a Tune experiment state"
    code, _, err = run(capsys, "status", folder)
    one_line(code, err, expected)
    code, _, err = run(capsys, "report", folder, "--output", tmp_path / "out")
    one_line(code, err, expected)
    assert not (tmp_path / "out").exists()


def test_status_leaves_out_a_trial_whose_saved_state_its_result_json_contradicts(capsys, tmp_path):
    """Issue 80: status read the experiment state alone, so an acc_mean edited there made another trial the best.
    Now each trial's last result in the state is held to the same report in its result.json: one that disagrees is
    left out of the best and named."""
    import json

    from tests.report_helpers import synthetic_trials, write_tune_folder

    folder = write_tune_folder(synthetic_trials().head(4), tmp_path / "sweeps" / "exp")
    (folder / "taylor_tune_experiment.json").write_text("{}")
    trials = sorted(p for p in folder.iterdir() if p.is_dir())
    finals = [json.loads((t / "result.json").read_text().splitlines()[-1]) for t in trials]

    def write_state(results):
        state = [[json.dumps({"trial_id": r["trial_id"], "status": "TERMINATED", "config": r["config"]}),
                  json.dumps({"last_result": {k: v for k, v in r.items() if k != "config"}})] for r in results]
        (folder / "experiment_state-2026-11-21_00-00-00.json").write_text(json.dumps({"trial_data": state}))

    write_state(finals)
    code, out, err = run(capsys, "status", folder)
    best = max(finals, key=lambda r: r["acc_mean"])
    assert code == 0 and f"(trial {best['trial_id']})" in out and "disagree" not in out, err
    worst = min(finals, key=lambda r: r["acc_mean"])
    write_state([r | {"acc_mean": 0.999} if r is worst else r for r in finals])
    code, out, err = run(capsys, "status", folder)
    assert code == 0 and f"(trial {best['trial_id']})" in out, out
    assert (f"trial {worst['trial_id']}: the experiment state and its result.json disagree on acc_mean; left out of "
            "the best") in out


@pytest.mark.parametrize("field, value, expected", [
    ("align", True, "prune: align: Input should be a valid integer (got True)"),
    ("align", "64", "align: Input should be a valid integer (got '64')"),
    ("servable", "yes", "servable: Input should be a valid boolean (got 'yes')"),
    ("sparsity", "0.2", "sparsity: Input should be a valid number (got '0.2')"),
])
def test_the_prune_block_takes_values_as_typed_as_the_search_space_does(capsys, tmp_path, field, value, expected):
    """Issue 91, case 7: `prune: {align: true}` ran as align 1, and `servable: "yes"`, `align: "64"` were taken in the
    prune block while the search space refused the same values. One line, exit 2, before Ray; the same as a prune
    config file."""
    code, _, err = run(capsys, "sweep", experiment(tmp_path, prune={**SMALL["prune"], field: value}))
    one_line(code, err, expected.removeprefix("prune: "))
    assert not (tmp_path / "sweeps").exists()
    (tmp_path / "prune.yaml").write_text(yaml.safe_dump({"model": "tiny-llama", field: value}))
    code, _, err = run(capsys, "prune", "--config", tmp_path / "prune.yaml", "--output", tmp_path / "out")
    one_line(code, err, expected.removeprefix("prune: "))
    assert not (tmp_path / "out").exists()


def test_prune_refuses_a_recovery_warm_up_longer_than_its_steps_as_a_sweep_does(capsys, tmp_path):
    """Issue 91, case 7: `prune --recovery-steps 4` (warm-up 10 by default) ran silently, its held-out loss unchanged,
    where a sweep refused the same setting. The one rule (`config.check_schedule`) now holds for both."""
    code, _, err = run(capsys, "prune", "--model", "tiny-llama", "--recovery-steps", "4", "--output", tmp_path / "o")
    one_line(code, err, "recovery.warmup_steps: 10 warm-up steps for 4 steps")
    assert not (tmp_path / "o").exists()
    code, _, err = run(capsys, "sweep", experiment(tmp_path, recovery={"steps": 4}))
    one_line(code, err, "recovery.warmup_steps: 10 warm-up steps for 4 steps")


@pytest.mark.parametrize("tensors", ["tiny-qwen2", "tiny-gemma2"])
def test_a_config_naming_another_family_over_a_checkpoints_tensors_is_one_line(capsys, tmp_path, tensors):
    """Issue 91, case 7: a folder whose config.json says llama over Qwen2's tensors was evaluated with its biases
    dropped; over Gemma 2's, at perplexity 419, exit 0 (only transformers' load report on stderr said so). Now the
    tensors the class does not use, lacks or shapes otherwise are one line naming how many and the first, exit 2."""
    import json
    import subprocess
    import sys

    from taylor_tune.sources.world import model_dir

    folder = tmp_path / "model"
    shutil.copytree(model_dir(tensors), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "llama",
                                                             "architectures": ["LlamaForCausalLM"]}))
    flags = ("--tasks", "piqa", "--task-data", "world", "--ppl", "world", "--limit", "4")
    # as a user runs it (a process of its own: transformers' progress bars off from its import, as the CLI sets)
    proc = subprocess.run([sys.executable, "-m", "taylor_tune", "evaluate", "--model", str(folder), *flags,
                           "--output", str(tmp_path / "eval.json")], capture_output=True, text=True, timeout=300)
    code, err = proc.returncode, proc.stderr
    one_line(code, err, f"model: {str(folder)!r}'s weights do not match its config.json (llama): ")
    assert "is config.json this checkpoint's?" in err and not (tmp_path / "eval.json").exists()
    code, _, err = run(capsys, "evaluate", "--model", model_dir(tensors), *flags, "--output", tmp_path / "eval.json")
    assert code == 0, err  # the folder as shipped loads


@pytest.mark.parametrize("model, uniform", [("tiny-llama", True), ("tiny-llama", False), ("tiny-gemma2", True)])
def test_the_prunes_last_line_says_which_folder_it_wrote(capsys, tmp_path, model, uniform):
    """Issue 91, case 7: a `--uniform` pruning whose shapes its stock config cannot say (a Gemma whose head count no
    longer divides its hidden size) writes taylor_tune's pruned folder, documented, but the prune's last line did
    not say so. The line now says which folder it is, and that agrees with the folder: a stock one loads in
    transformers without remote code, a pruned one does not."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    code, said, err = run(capsys, "prune", "--model", model, "--sparsity", "0.4", "--seq-len", "16", "--num-samples",
                          "4", "--calibration", "world", "--device", "cpu", *(["--uniform"] if uniform else []),
                          "--output", out)
    assert code == 0, err
    stock = said.strip().endswith("(model/ is a stock transformers folder)")
    assert stock or "(model/ is taylor_tune's pruned folder (load_pruned, or transformers with trust_remote_code)" \
        in said, said
    assert stock == (": uniform, but" not in said) if uniform else not stock
    try:
        AutoModelForCausalLM.from_pretrained(out / "model", trust_remote_code=False)
        loads = True
    except Exception:  # a pruned folder's config names its own class (auto_map): refused without remote code
        loads = False
    assert loads == stock, said
