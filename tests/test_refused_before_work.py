"""Bad input found by issue 37's adversarial run, refused before any work: one line, exit 2, no traceback, never
more than ~200 characters of a bad value echoed, nothing recorded that blocks the experiment's name afterwards.
Each case failed on 1faffce (a traceback, a 312 MB error line, a hang, a silently accepted value)."""

import copy
import json
import re
import time

import pytest
import yaml

from taylor_tune.cli import main
from taylor_tune.reporting import best_under, parse_constraint
from taylor_tune.reporting.pareto import _CONSTRAINT
from taylor_tune.reporting.stats import Objective
from tests.sweep_helpers import SMALL

MAX_LINE = 1000  # characters: the message and at most ~200 of the bad value


def run(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(code, err, *expected):
    assert code == 2, err[:2000]
    assert err.count("\n") == 1 and err.startswith("taylor-tune: error: ") and "Traceback" not in err, err[:2000]
    assert len(err) < MAX_LINE, f"{len(err)} characters: {err[:300]}..."
    for text in expected:
        assert text in err, err


def write(tmp_path, text: str):
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    return path


def experiment(tmp_path, **changes):
    data = copy.deepcopy({"name": "exp", **SMALL, "storage_path": str(tmp_path / "sweeps")})
    for key, value in changes.items():  # "search.repeats" -> data["search"]["repeats"]
        *parents, leaf = key.split(".")
        node = data
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return write(tmp_path, yaml.safe_dump(data))


def nothing_started(tmp_path):
    assert not (tmp_path / "sweeps" / "exp").exists()  # no Tune state, no settings record: the name stays free


# ---------------------------------------------------------------- finding 5: YAML, huge values, Ray's own limits

def test_a_yaml_alias_bomb_is_refused_at_once(capsys, tmp_path):
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    path = write(tmp_path, "\n".join(lines) + f"\nname: *a8\n{yaml.safe_dump({k: v for k, v in SMALL.items()})}")
    assert path.stat().st_size < 2000
    start = time.perf_counter()
    code, _, err = run(capsys, "sweep", path)
    assert time.perf_counter() - start < 10
    one_line(code, err, "aliases (*name) are not allowed")
    nothing_started(tmp_path)


@pytest.mark.slow  # megabytes of YAML parsed twice: seconds
def test_a_huge_value_is_not_echoed_whole(capsys, tmp_path):
    code, _, err = run(capsys, "sweep", experiment(tmp_path, name="x" * 5_000_000))
    one_line(code, err, "name: String should have at most 100 characters", "(5000002 characters)")
    code, _, err = run(capsys, "sweep", experiment(tmp_path, models=["m" * 1_000_000]))
    assert code == 2 and len(err) < MAX_LINE, err[:300]


def test_a_key_given_twice_is_refused(capsys, tmp_path):
    text = yaml.safe_dump({"name": "exp", **SMALL, "storage_path": str(tmp_path / "sweeps")})
    code, _, err = run(capsys, "sweep", write(tmp_path, text + "prune: {sparsity: 0.5}\n"))
    one_line(code, err, "the key 'prune' is given twice")
    nested = text.replace("  sparsity: 0.2\n", "  sparsity: 0.2\n  sparsity: 0.4\n")
    assert nested != text
    code, _, err = run(capsys, "sweep", write(tmp_path, nested))
    one_line(code, err, "the key 'sparsity' is given twice")
    nothing_started(tmp_path)


@pytest.mark.parametrize("key, value, expected", [
    ("search.reduction_factor", float("inf"), "search.reduction_factor"),
    ("search.reduction_factor", 1.5, "search.reduction_factor: Input should be greater than or equal to 2"),
    ("resources.cpu", 0.000001, "resources.cpu: Input should be greater than or equal to 0.01"),
    ("resources.cpu", float("inf"), "resources.cpu"),
    ("resources.gpu", -1, "resources.gpu"),
    ("resources.gpu", 0.000001, "resources.gpu"),
    ("search.repeats", 1_000_000, "search.repeats: 1000000 seeds x 6 configurations = 6000000 trials per model"),
    ("models", ["tiny-llama", "tiny-llama"], "models: 'tiny-llama' is listed twice"),
    ("evaluation.fidelities", [40, 10], "limits must increase strictly"),
    ("evaluation.fidelities", [10, 10], "limits must increase strictly"),
    ("evaluation.fidelities", [None, 10], "null (every item) is the most expensive pass"),
])
def test_a_setting_ray_or_the_search_cannot_use_is_refused_before_ray(capsys, tmp_path, key, value, expected):
    changes = {key: value} | ({"search.scheduler": "asha"} if key == "search.reduction_factor" else {})
    if key == "search.reduction_factor":
        changes["evaluation.fidelities"] = [5, 10]
    code, _, err = run(capsys, "sweep", experiment(tmp_path, **changes))
    one_line(code, err, expected)
    nothing_started(tmp_path)


def test_one_model_folder_spelled_two_ways_is_listed_twice(capsys, tmp_path, monkeypatch):
    """Issue 80: `a/model` and `a/./model` (and the same folder by its absolute path) ran as two models."""
    folder = tmp_path / "a" / "model"
    folder.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for second in ("a/./model", "./a/model", str(folder), "a/model/"):
        code, _, err = run(capsys, "sweep", experiment(tmp_path, models=["a/model", second]))
        one_line(code, err, f"models: 'a/model' is listed twice (as 'a/model' and {second!r})"
                 if second != "a/model" else "listed twice")
        nothing_started(tmp_path)


def test_a_built_in_model_and_the_folder_it_loads_from_are_one_model(capsys, tmp_path):
    """Issue 91, case 7: `models: [tiny-llama, <the package's own tiny-llama folder>]` ran one model twice, as two."""
    from taylor_tune.sources.world import model_dir

    folder = str(model_dir("tiny-llama"))
    code, _, err = run(capsys, "sweep", experiment(tmp_path, models=["tiny-llama", folder]))
    one_line(code, err, f"models: 'tiny-llama' is listed twice (as 'tiny-llama' and {folder!r})")
    nothing_started(tmp_path)


def test_a_refused_start_leaves_the_name_free_for_other_settings(capsys, tmp_path):
    """A record of settings written by a run that never saved a Tune state does not bind the name."""
    import json

    folder = tmp_path / "sweeps" / "exp"
    folder.mkdir(parents=True)
    (folder / "taylor_tune_experiment.json").write_text(json.dumps({"name": "exp", "other": "settings"}))
    from taylor_tune.sweep.experiment import load_experiment
    from taylor_tune.sweep.folder import check_unchanged

    exp = load_experiment(experiment(tmp_path))
    check_unchanged(exp, str(folder))  # no state saved: the record is rewritten, nothing refused
    assert json.loads((folder / "taylor_tune_experiment.json").read_text())["name"] == "exp"
    assert "other" not in json.loads((folder / "taylor_tune_experiment.json").read_text())
    (folder / "experiment_state-2026-01-01_00-00-00.json").write_text('{"trial_data": []}')
    changed = load_experiment(experiment(tmp_path, **{"prune.sparsity": 0.3}))
    with pytest.raises(Exception, match="was started with other settings"):
        check_unchanged(changed, str(folder))  # once a state is saved, the record binds


# ---------------------------------------------------------------- --output and the asset home, before the work

def test_an_output_under_a_file_is_refused_before_the_model_loads(capsys, tmp_path, monkeypatch):
    import taylor_tune.evaluation.evaluate as evaluate_module
    import taylor_tune.pruning.prune as prune_module

    monkeypatch.setattr(evaluate_module, "evaluate", lambda *a, **k: pytest.fail("evaluated before --output"))
    monkeypatch.setattr(prune_module, "prune", lambda *a, **k: pytest.fail("pruned before --output"))
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    code, _, err = run(capsys, "evaluate", "--model", "tiny-llama", "--tasks", "piqa", "--task-data", "world",
                       "--limit", "2", "--output", blocker / "sub" / "e.json")
    one_line(code, err, f"--output: {blocker} is a file")
    code, _, err = run(capsys, "evaluate", "--model", "tiny-llama", "--output", tmp_path)
    one_line(code, err, "is a folder; give a file's path")
    code, _, err = run(capsys, "prune", "--model", "tiny-llama", "--sparsity", "0.2", "--output", blocker)
    one_line(code, err, f"--output: {blocker} is a file; give a folder's path")
    code, _, err = run(capsys, "report", tmp_path, "--output", blocker / "r")
    one_line(code, err, f"--output: {blocker} is a file")


def test_an_asset_home_that_is_a_file_is_named(capsys, tmp_path, monkeypatch):
    home = tmp_path / "home_is_a_file"
    home.write_text("x")
    monkeypatch.setenv("TAYLOR_TUNE_HOME", str(home))
    code, _, err = run(capsys, "fetch", "wiki")
    one_line(code, err, f"asset home {home}: {home} is a file, not a folder; set TAYLOR_TUNE_HOME")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    code, _, err = run(capsys, "evaluate", "--model", gguf, "--tasks", "piqa", "--task-data", "world", "--limit",
                       "2", "--output", tmp_path / "e.json")
    one_line(code, err, f"asset home {home}")


def test_a_read_only_asset_home_is_named(capsys, tmp_path, monkeypatch):
    import subprocess

    home = tmp_path / "ro"
    home.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(home)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        monkeypatch.setenv("TAYLOR_TUNE_HOME", str(home))
        code, _, err = run(capsys, "fetch", "wiki")
        one_line(code, err, f"asset home {home} is not writable (Read-only file system)")
    finally:
        subprocess.run(["umount", "-l", str(home)], check=False)


# ---------------------------------------------------------------- finding 6: constraints, safetensors only

def test_constraint_parsing_is_linear_and_a_constraint_is_kept_as_given():
    start = time.perf_counter()
    assert _CONSTRAINT.fullmatch("a>=" + "1" * 200_000 + "x") is None  # the pattern alone, without the length cap
    with pytest.raises(ValueError, match=r"\(100004 characters\)"):
        parse_constraint("a>=" + "1" * 100_000 + "x")
    assert time.perf_counter() - start < 1  # on 1faffce: no answer in 60 s
    import pandas as pd

    for text in ("acc_mean>=0.4812345678", "decode_speedup>1.30", "memory_ratio<=1e-1"):
        assert str(parse_constraint(text)) == text
    df = pd.DataFrame({"trial_id": ["a", "b"], "acc_mean": [0.49, 0.48], "pruning_method": ["taylor", "random"]})
    result = best_under(df, (parse_constraint("acc_mean>=0.4812345678"),), Objective("acc_mean", "max"))
    assert result["constraints"] == ["acc_mean>=0.4812345678"] and result["satisfying"] == 1
    for bad in ("a>=1e999", "a>=nan", "a>=" + "1" * 300):
        with pytest.raises(ValueError, match="finite number"):
            parse_constraint(bad)


@pytest.mark.parametrize("pruned", [False, True], ids=["model-folder", "pruned-folder"])
def test_a_folder_with_only_pickled_weights_is_refused(capsys, tmp_path, pruned):
    from taylor_tune.config import build_prune_config
    from taylor_tune.pruning.apply import save_pruned
    from taylor_tune.pruning.prune import prune
    from taylor_tune.sources.models import load_model, load_tokenizer

    folder = tmp_path / "m"
    if pruned:
        result = prune(build_prune_config(dict(model="tiny-llama", method="taylor", sparsity=0.2, seq_len=32,
                                               num_samples=8, calibration="sample", device="cpu", dtype="float32")))
        save_pruned(result.model, folder, tokenizer=result.tokenizer)
    else:
        load_model("tiny-llama").save_pretrained(folder)
        load_tokenizer("tiny-llama").save_pretrained(folder)
    (weights,) = folder.glob("*.safetensors")
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(weights), folder / "pytorch_model.bin")
    weights.unlink()
    capsys.readouterr()  # the set-up's progress bars
    code, _, err = run(capsys, "evaluate", "--model", folder, "--tasks", "piqa", "--task-data", "world", "--limit",
                       "2", "--output", tmp_path / "e.json")
    one_line(code, err, "holds no safetensors weights (it has pytorch_model.bin: pickled weights, never loaded)")
    assert re.search(r"save_pretrained\(\.\.\., safe_serialization=True\)", err)


def test_a_pruned_folders_own_modeling_file_is_never_run(capsys, tmp_path):
    """docs/operations.md's trust section: a pruned folder loads with taylor_tune's own classes. Its copied modeling
    file (what plain transformers would import with trust_remote_code) replaced by one that writes a marker when
    imported: `evaluate` scores the folder and the marker is never written."""
    from taylor_tune.config import build_prune_config
    from taylor_tune.pruning.apply import save_pruned
    from taylor_tune.pruning.prune import prune

    result = prune(build_prune_config(dict(model="tiny-llama", method="taylor", sparsity=0.2, seq_len=32,
                                           num_samples=8, calibration="sample", device="cpu", dtype="float32")))
    folder = save_pruned(result.model, tmp_path / "m", tokenizer=result.tokenizer)
    marker = tmp_path / "imported"
    (modeling,) = folder.glob("modeling_*.py")
    modeling.write_text(f"open({str(marker)!r}, 'w').close()\n" + modeling.read_text())
    capsys.readouterr()  # the set-up's progress bars
    code, _, err = run(capsys, "evaluate", "--model", folder, "--tasks", "piqa", "--task-data", "world", "--limit",
                       "2", "--ppl", "world", "--ppl-max-windows", "2", "--output", tmp_path / "e.json")
    assert code == 0, err
    assert (tmp_path / "e.json").exists() and not marker.exists()


# ---------------------------------------------------------------- issue 62: recovery refused before the run


ALPACA = {"instruction": "Name the colour of the sky on a clear day.", "input": "", "output": "Blue."}


@pytest.mark.parametrize("case, changes, expected", [
    ("rank", {"recovery": {"lora_rank": 100000}},
     "recovery.lora_rank: 100000 is larger than tiny-llama's hidden size"),
    ("steps", {"recovery": {"steps": 1000000000000}}, "recovery.steps: 1000000000000 steps of 1 x 4 sequences"),
    ("text steps", {"recovery": {"steps": 100000, "data": "world"}},
     "tokens, and the recovery text world holds at most"),
    ("window", {"recovery": {"seq_len": 32, "data": "ALPACA"}},
     "recovery.seq_len: 32 tokens hold only the prompt of every record drawn"),
    ("empty text", {"recovery": {"data": "EMPTY"}}, "empty.txt holds at most 0"),
    ("binary text", {"recovery": {"data": "BINARY"}}, "is not a UTF-8 text file"),
    # issue 80: the default warm-up (10 steps) longer than the steps, accepted silently before
    ("warm-up", {"recovery": {"steps": 4}},
     "recovery.warmup_steps: 10 warm-up steps for 4 steps: the learning rate would never reach recovery.lr"),
    ("searched warm-up", {"recovery": {"steps": 40}, "search_space.recovery_warmup_steps": {"grid": [4, 50]}},
     "recovery.warmup_steps: 50 warm-up steps for 40 steps"),
])
def test_a_recovery_that_cannot_do_what_it_says_is_refused_before_ray(capsys, tmp_path, case, changes, expected):
    """Issue 62, findings 2, 3 and 5: a LoRA rank far beyond the model's width and a step count whose token tensors
    outgrow the machine ate 8-10 GB and never finished; a window the prompts fill trained on nothing and reported a
    recovery; an empty or binary recovery text failed after pruning with a traceback. Each is refused in one line
    before Ray starts, nothing written."""
    (tmp_path / "alpaca.jsonl").write_text("".join(json.dumps(ALPACA) + "\n" for _ in range(3)))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 8)
    files = {"ALPACA": tmp_path / "alpaca.jsonl", "EMPTY": tmp_path / "empty.txt", "BINARY": tmp_path / "binary.txt"}
    recovery = {k: str(files.get(v, v)) if k == "data" else v for k, v in changes["recovery"].items()}
    others = {k: v for k, v in changes.items() if k != "recovery"}
    code, _, err = run(capsys, "sweep", experiment(tmp_path, recovery=recovery, **others))
    one_line(code, err, expected)
    nothing_started(tmp_path)
