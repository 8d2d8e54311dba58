"""Issue 93, must-shows 5-6: experiments/moe_tiny.yaml (experiments/moe_grid.yaml with the offline world's four tiny
trained mixtures standing in) through Ray Tune: every trial finishes, each removes the count of experts its share
says from every sparse layer and reports the parameters a token computes with; the report ranks the expert criteria
per model as the trials' own accuracies do, paired on the same items; the best trial exports as a stock mixture whose
card names the experts each layer kept."""

import json

import pandas as pd
import pytest
import torch
import yaml

from taylor_tune.reporting import build_report
from taylor_tune.sources.data import TINY_MODELS, TRAINED_MODELS
from taylor_tune.sources.families import MIXTURES
from tests.sweep_helpers import REPO, shipped_sweep_rows, trial_dirs, write_experiment

CRITERIA = {"experts+frequency", "experts+reap", "experts+ean", "experts+taylor"}


def test_the_moe_experiments_name_a_trained_model_of_every_mixture_and_every_criterion():
    tiny = yaml.safe_load((REPO / "experiments" / "moe_tiny.yaml").read_text())
    assert {TINY_MODELS[f"{name}-random"] for name in tiny["models"]} == set(MIXTURES)
    assert set(tiny["models"]) <= set(TRAINED_MODELS)
    grid = yaml.safe_load((REPO / "search_spaces" / "moe_grid.yaml").read_text())
    assert {f"experts+{c}" for c in grid["expert_criterion"]["grid"]} == CRITERIA
    assert grid["expert_sparsity"]["grid"] == [0.25, 0.5]
    real = yaml.safe_load((REPO / "experiments" / "moe_grid.yaml").read_text())
    assert real["search_space"] == "search_spaces/moe_grid.yaml" and "sparsity" not in real["prune"]


def moe_experiment(tmp_path, method: str = "experts", **changes):
    from taylor_tune.sweep.experiment import load_experiment

    space = {"taylor_seq_len": {"grid": [32]}, "taylor_num_samples": {"grid": [8]},
             "pruning_method": {"grid": [method]}}
    return load_experiment(write_experiment(tmp_path, "moe", models=["tiny-qwen3moe"], search_space=space,
                                            prune={"calibration": "world", "device": "cpu", "dtype": "float32"},
                                            **changes))


def test_what_a_mixture_cannot_take_is_refused_before_ray_starts(tmp_path):
    from taylor_tune.errors import ConfigError
    from taylor_tune.sweep.preflight import check_plans, check_recovery

    with pytest.raises(ConfigError) as refused:
        check_plans(moe_experiment(tmp_path, "taylor"))
    assert str(refused.value) == ("prune: taylor on tiny-qwen3moe cannot be planned with these settings: taylor "
                                  "prunes dense layers, and this model is a mixture of experts: use experts")
    with pytest.raises(ConfigError) as refused:
        check_recovery(moe_experiment(tmp_path, recovery={"steps": 2}))
    assert str(refused.value).startswith("recovery: its LoRA adapters go on a dense model's projections; a mixture "
                                         "pruned by the experts method is not recovered yet")
    check_plans(moe_experiment(tmp_path))  # the experts method plans


@pytest.mark.slow  # a Ray sweep of 32 trials (~30 s on 2 cores)
def test_the_moe_experiment_runs_through_ray_and_the_report_ranks_the_criteria_per_model(tmp_path, ray_head):
    path, rows = shipped_sweep_rows("moe_tiny", tmp_path, ray_head)
    rows = pd.DataFrame(rows)
    assert len(rows) == 32 and rows["acc_mean"].notna().all() and (rows["ppl"] > 1).all()
    folders = trial_dirs(path)
    for _, row in rows.iterrows():
        summary = json.loads((folders[row["trial_id"]] / "pruning_summary.json").read_text())
        removed = [len(layer.get("experts", [])) for layer in summary["removed_groups"]]
        gone = round(row["config/expert_sparsity"] * 8)
        assert {n for n in removed if n} == {gone} and summary["experts_kept"] == [8 - n if n else 0 for n in removed]
        # the same top-2 routed, so a token computes with as many parameters as before
        assert row["active_params_count"] == row["active_params_count_before"] < row["params_count"]
        assert row["params_count"] == row["params_count_before"] - sum(removed) * summary["group_params"]["expert"]
    report = build_report(path)
    for model, group in rows.groupby("model"):
        ranked = report.models[model]
        assert ranked.trials == 8 and ranked.invalid.empty
        assert set(ranked.methods["table"].index) == CRITERIA
        means = group.groupby("config/expert_criterion")["acc_mean"].mean()  # pandas, apart from the report
        assert ranked.methods["best_method_by_mean"] == f"experts+{means.idxmax()}"
        paired = ranked.paired["method"]
        assert set(paired["level"]) | {ranked.methods["best_method"]} == CRITERIA and (paired["pairs"] == 2).all()

    from transformers import AutoModelForCausalLM

    from taylor_tune.export import export

    out = export(str(path), tmp_path / "exported", model="tiny-olmoe")
    card = (out / "README.md").read_text()
    chosen = json.loads((out / "export.json").read_text())["trial_id"]
    summary = json.loads((folders[chosen] / "pruning_summary.json").read_text())
    for layer in summary["removed_groups"]:
        kept = [e for e in range(8) if e not in layer["experts"]]
        assert f"| {layer['layer']} | {', '.join(map(str, kept))} |" in card
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(reloaded).__name__ == "OlmoeForCausalLM"
    assert reloaded.config.num_experts == 8 - len(summary["removed_groups"][0]["experts"])
    with torch.no_grad():
        assert torch.isfinite(reloaded(torch.tensor([[1, 2, 3]])).logits).all()
