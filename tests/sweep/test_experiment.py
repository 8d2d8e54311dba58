"""Experiment files: every shipped one validates (sweeps and the prune configs); bad ones are refused before Ray
starts, naming the field."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from taylor_tune.config import load_prune_config
from taylor_tune.errors import ConfigError
from taylor_tune.sweep.experiment import load_experiment
from tests.sweep_helpers import SMALL, env

REPO = Path(__file__).resolve().parents[2]


def test_the_shipped_experiments_validate_and_the_paper_grid_has_135_trials():
    grid = load_experiment(REPO / "experiments" / "paper_grid_20.yaml")
    assert grid.grid_size() == 135 and len(grid.grid_points()) == 135
    assert grid.resources.gpu == 1 and grid.sample_counts() == (128, 256, 512)
    assert load_experiment(REPO / "experiments" / "smoke.yaml").grid_size() == 36
    raced = load_experiment(REPO / "experiments" / "paper_race_20.yaml")  # the same grid, raced on shared items
    assert (raced.search.algorithm, raced.search.scheduler, raced.evaluation.fidelities) == ("grid", "race",
                                                                                            (200, 600, None))
    assert raced.grid_points() == grid.grid_points() and raced.prune == grid.prune and raced.models == grid.models
    tpe = load_experiment(REPO / "experiments" / "tpe_asha.yaml")
    assert tpe.search.scheduler == "asha" and tpe.search.algorithm == "tpe" and tpe.grid_size() == 36
    real = load_experiment(REPO / "experiments" / "real_paper_grid.yaml")
    assert real.grid_size() == 45 and (real.metric, real.mode) == ("ppl", "min") and real.prune["sparsity"] == 0.2
    seeds = load_experiment(REPO / "experiments" / "real_grid_seeds.yaml")
    assert seeds.grid_size() == 6 and seeds.search.repeats == 3 and seeds.evaluation == real.evaluation
    sweeps = sorted(
        p for p in (REPO / "experiments").glob("*.yaml") if not p.name.startswith("prune_")
    )  # prune_*: one pruning's config
    assert len(sweeps) >= 7 and all(load_experiment(path).name == path.stem for path in sweeps)
    assert load_prune_config(REPO / "experiments" / "prune_llama3_8b.yaml").model == "meta-llama/Meta-Llama-3-8B"
    assert load_prune_config(REPO / "experiments" / "prune_tiny_llama.yaml").model == "tiny-llama"


def test_the_tune_param_space_expands_to_the_grid():
    from ray.tune.search.variant_generator import generate_variants

    from taylor_tune.sweep.tune.space import param_space

    experiment = load_experiment(REPO / "experiments" / "paper_grid_20.yaml")
    variants = [v for _, v in generate_variants(param_space(experiment, "/cache"))]
    assert len(variants) == 135
    points = {(v["model"], v["pruning_method"], v["taylor_seq_len"], v["taylor_num_samples"]) for v in variants}
    assert points == {
        (p["model"], p["pruning_method"], p["taylor_seq_len"], p["taylor_num_samples"])
        for p in experiment.grid_points()
    }


UNFIXED = {k: v for k, v in SMALL["prune"].items() if k != "sparsity"}  # the fixed settings, sparsity left to search


def bad(tmp_path, **changes):
    data = {"name": "bad", **SMALL, "storage_path": str(tmp_path / "s")}
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


CASES = [
    (dict(colour="blue"), "colour: unknown key"),
    (dict(max_failures="many"), "max_failures: Input should be a valid integer"),
    (
        dict(
            search_space={
                "taylor_seq_len": {"grid": []},
                "taylor_num_samples": {"grid": [8]},
                "pruning_method": {"grid": ["taylor"]},
            }
        ),
        "search_space.taylor_seq_len: Value error, empty list of values".replace("Value error, ", ""),
    ),
    (dict(models=["no/such-model-here-offline"]), "model: cannot read the config of 'no/such-model-here-offline'"),
    (dict(models=["tiny-gpt"]), "model: 'tiny-gpt' is not a built-in model"),
    (
        dict(
            search_space={
                "taylor_seq_len": {"grid": [16]},
                "taylor_num_samples": {"grid": [8]},
                "pruning_method": {"grid": ["wanda"]},
            }
        ),
        "search_space.pruning_method: unknown method 'wanda'",
    ),
    (dict(evaluation={"tasks": "piqa,squad", "ppl": None}), "tasks: unknown task 'squad'"),
    (dict(resources={"cpu": 1, "gpu": 1}), "resources.gpu: 1.0 GPU per trial requested, but this machine has no GPU"),
    (dict(storage_path="/proc/no-write"), "storage_path: /proc/no-write is not writable"),
    (dict(models=[]), "models: Tuple should have at least 1 item"),
    (dict(search={"algorithm": "tpe", "num_trials": 7}), "search.num_trials: 7 is more than the 6 configurations"),
    (
        dict(search={"algorithm": "tpe", "num_trials": 3, "scheduler": "asha"}),
        "search.scheduler: asha stops trials at a cheap",
    ),
    (
        dict(search={"scheduler": "asha", "reduction_factor": 1}),
        "search.reduction_factor: Input should be greater than or equal to 2",
    ),
    (dict(metric="acc_foo"), "metric: 'acc_foo' is not reported by these trials; one of acc_mean, ppl, acc_piqa"),
    (dict(metric="ppl", mode="min"), "metric: ppl needs evaluation.ppl"),
    (dict(metric="acc_mean", mode="min"), "mode: 'min' would search for the worst acc_mean; use mode: max"),
    (dict(test_fault={"pruning_method": "taylor"}), "test_fault: unknown key"),
    (dict(prune={"calibration": "/no/such.txt"}), "calibration: '/no/such.txt' is neither a dataset"),
    (dict(evaluation={"tasks": "piqa", "task_data": "/no/such", "ppl": None}), "task_data: '/no/such' is neither"),
] + [  # spaces over any pruning setting, and several objectives
    (dict(search_space={"colour": {"grid": [1]}}), "search_space: unknown dimension 'colour'; a search may vary"),
    (dict(search_space={"sparsity": {"grid": [0.1, 1.5]}}, prune=UNFIXED),
     "search_space.sparsity: Input should be less than 1 (got 1.5)"),
    (dict(search_space={"uniform": {"grid": [False, "yes"]}}), "search_space.uniform: Input should be a valid boolean"),
    (dict(search_space={"blockwise_attention": {"grid": ["largest"]}}), "search_space.blockwise_attention: Input "
     "should be 'closest_ratio', 'measured_loss', 'mlp_only' or 'min_loss' (got 'largest')"),
    (dict(search_space={"sparsity": {"grid": [0.1, 0.1]}}, prune=UNFIXED), "a value is listed twice"),
    (dict(search_space={"blockwise_layer_start": {"grid": [1, 3]}, "blockwise_layer_end": {"grid": [2, 4]}}),
     "search_space: the combination (blockwise_layer_start 3, blockwise_layer_end 2) is not a valid pruning: "
     "blockwise_layer_end (2) must be greater than blockwise_layer_start (3)"),
    (dict(search_space={"blockwise_layer_end": {"grid": [2]}}, prune={**UNFIXED, "blockwise_layer_start": 2}),
     "the combination (blockwise_layer_end 2) is not a valid pruning"),
    (dict(search_space={"sparsity": {"grid": [0.1, 0.3]}}), "prune.sparsity is also searched (search_space.sparsity)"),
    (dict(search_space={"pruning_method": {"grid": ["taylor"]}, "sparsity": {"grid": [0.2, 0.9]},
                        "uniform": {"grid": [True]}}, prune=UNFIXED),
     "prune: taylor on tiny-llama cannot be planned with these settings (sparsity 0.9, uniform True)"),
    (dict(search_space={"blockwise_layer_end": {"grid": [3, 40]}, "pruning_method": {"grid": ["blockwise"]}}),
     "(blockwise_layer_end 40): blockwise: layer range [1, 40) is empty or outside the model's 4 layers"),
    (dict(search={"algorithm": "tpe", "num_trials": 1}, search_space={}), "tpe needs at least one dimension"),
    (dict(objectives=[{"metric": "acc_mean"}, {"metric": "speed"}]), "objectives: 'speed' is not reported"),
    (dict(objectives=[{"metric": "acc_mean"}, {"metric": "decode_speedup"}], evaluation={**SMALL["evaluation"],
                                                                                        "speed": None}),
     "objectives: 'decode_speedup' is not reported by these trials (speed metrics need evaluation.speed)"),
    (dict(objectives=[{"metric": "acc_mean"}, {"metric": "memory_ratio", "mode": "max"}]),
     "mode: 'max' would search for the worst memory_ratio; use mode: min"),
    (dict(objectives=[{"metric": "acc_mean"}, {"metric": "acc_mean"}]), "objectives: acc_mean is listed twice"),
    (dict(objectives=[{"metric": "acc_mean"}, {"metric": "decode_speedup"}], metric="acc_mean"),
     "give objectives or metric and mode, not both"),
    (dict(objectives=[{"metric": "acc_mean"}, {"metric": "decode_speedup"}],
          search={"algorithm": "tpe", "num_trials": 3, "scheduler": "asha"},
          evaluation={**SMALL["evaluation"], "fidelities": [5, 10]}),
     "search.scheduler: asha stops trials by one metric and cannot rank several objectives"),
]


def refused(code: int, err: str, message: str) -> None:
    assert code == 2, err
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("changes, message", CASES)
def test_bad_experiment_files_exit_2_before_ray_starts(changes, message, tmp_path, capsys, monkeypatch):
    """`main` in this process (the body of the entry point, which the test below runs as a user would): each case a
    one-line refusal, and no Ray started."""
    import ray
    import torch

    from taylor_tune.cli import main

    if "GPU" in message and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code = main(["sweep", str(bad(tmp_path, **changes))])
    refused(code, capsys.readouterr().err, message)
    assert not ray.is_initialized()


@pytest.mark.slow
def test_a_bad_experiment_file_through_the_entry_point_exits_2_before_ray_starts(tmp_path):
    changes, message = CASES[4]  # an unknown model: the refusal needs the model registry, after the heavy imports
    proc = subprocess.run([sys.executable, "-m", "taylor_tune", "sweep", str(bad(tmp_path, **changes))],
                          capture_output=True, text=True, env={**env(), "RAY_ADDRESS": ""}, timeout=120)
    refused(proc.returncode, proc.stderr, message)
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout


def test_an_unreadable_search_space_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="search_space: cannot read"):
        load_experiment(bad(tmp_path, search_space="search_spaces/none.yaml"))


def test_the_define_by_run_space_samples_the_experiments_domains():
    import optuna

    from taylor_tune.sweep.tune.search import ChoiceSpace, domains_of

    experiment = load_experiment(REPO / "experiments" / "tpe_asha.yaml")
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))
    space = ChoiceSpace(domains_of(experiment))
    for _ in range(20):
        trial = study.ask()
        seq_len, num_samples, method = space(trial)
        assert (seq_len, num_samples, method) == (trial.params["taylor_seq_len"], trial.params["taylor_num_samples"],
                                                  trial.params["pruning_method"])
        assert (
            seq_len in (16, 32, 64, 128, 256)
            and num_samples in (128, 256, 512)
            and method in ("taylor", "layerwise", "blockwise")
        )
        study.tell(trial, 0.5)


def test_grid_search_refuses_choice_domains_and_tpe_refuses_repeats(tmp_path):
    space = {
        "taylor_seq_len": {"choice": [16]},
        "taylor_num_samples": {"grid": [8]},
        "pruning_method": {"grid": ["taylor"]},
    }
    with pytest.raises(ConfigError, match="grid needs grid domains"):
        load_experiment(bad(tmp_path, search_space=space))
    with pytest.raises(ConfigError, match="repeats > 1 is for grid search"):
        load_experiment(bad(tmp_path, search={"algorithm": "tpe", "repeats": 2}))


def test_fault_injection_is_not_a_setting_of_the_product(tmp_path):
    with pytest.raises(ConfigError, match="test_fault: unknown key"):
        load_experiment(bad(tmp_path, test_fault={"pruning_method": "taylor"}))


def test_validation_reads_no_file_and_the_sources_are_checked_as_a_step(tmp_path):
    from taylor_tune.sweep.experiment import check_sources

    experiment = load_experiment(bad(tmp_path, prune={"calibration": "/no/such.txt"}))  # valid where it is built
    with pytest.raises(ConfigError, match="calibration: '/no/such.txt' is neither a dataset"):
        check_sources(experiment)


@pytest.mark.parametrize("changes, message", [
    (dict(search={"scheduler": "race"}), "search.scheduler: race stops trials after a cheap zero-shot pass"),
    (dict(search={"scheduler": "race"}, evaluation={**SMALL["evaluation"], "fidelities": [5, None], "item_seed": None}),
     "evaluation.item_seed: race compares trials on the same seeded items"),
    (dict(search={"scheduler": "race"}, metric="ppl", mode="min",
          evaluation={**SMALL["evaluation"], "fidelities": [5, None], "ppl": "world"}),
     "search.scheduler: race on ppl stops trials after a cheap perplexity pass, and evaluation.ppl_fidelities has "
     "only one"),
    (dict(search={"scheduler": "race"}, metric="acc_piqa",
          evaluation={**SMALL["evaluation"], "fidelities": [5, None]}),
     "search.scheduler: race compares trials item by item (zero-shot items or perplexity windows), so it ranks by "
     "acc_mean or ppl, not acc_piqa"),
    (dict(search={"scheduler": "race"}, metric="ppl", mode="min",
          evaluation={**SMALL["evaluation"], "ppl": "world", "ppl_fidelities": [8, 4, None]}),
     "evaluation.ppl_fidelities: limits must increase strictly"),
    (dict(search={"scheduler": "race", "alpha": 0.5}, evaluation={**SMALL["evaluation"], "fidelities": [5, None]}),
     "search.alpha: Input should be less than 0.5"),
])
def test_a_race_needs_blocks_seeded_items_and_acc_mean_or_ppl(changes, message, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_experiment(bad(tmp_path, **changes))
    load_experiment(bad(tmp_path, search={"scheduler": "race"}, evaluation={**SMALL["evaluation"],
                                                                            "fidelities": [5, None]}))
    load_experiment(bad(tmp_path, search={"scheduler": "race"}, metric="ppl", mode="min",  # one zero-shot pass
                        evaluation={**SMALL["evaluation"], "ppl": "world", "ppl_fidelities": [8, None]}))
