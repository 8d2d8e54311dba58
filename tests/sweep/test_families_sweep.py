"""Issue 82, must-show 4: the shipped experiments/families.yaml, every family's tiny model trained on the offline
world, through Ray Tune in one sweep: every trial finishes, and the report ranks each family's configurations apart,
its best the one Ray's own reading of the experiment ranks first."""

import pandas as pd
import pytest
import yaml

from taylor_tune.reporting import build_report
from taylor_tune.sources.data import TINY_MODELS, TRAINED_MODELS
from taylor_tune.sources.families import DENSE
from tests.sweep_helpers import REPO, shipped_sweep_rows

# the dense families' trained models (the mixtures' are swept by experiments/moe_grid.yaml)
DENSE_TRAINED = {name for name in TRAINED_MODELS if TINY_MODELS[f"{name}-random"] in DENSE}


def test_the_families_experiment_names_a_trained_model_of_every_family():
    experiment = yaml.safe_load((REPO / "experiments" / "families.yaml").read_text())
    assert set(experiment["models"]) == DENSE_TRAINED
    families = {TINY_MODELS[f"{name}-random"] for name in experiment["models"]}
    assert families == set(DENSE)


@pytest.mark.slow  # a Ray sweep of 18 trials
def test_every_family_is_swept_through_ray_and_ranked_apart(tmp_path, ray_head):
    path, rows = shipped_sweep_rows("families", tmp_path, ray_head)
    rows = pd.DataFrame(rows)
    assert len(rows) == 2 * len(DENSE_TRAINED) and rows["acc_mean"].notna().all() and (rows["ppl"] > 1).all()
    report = build_report(path)
    assert set(report.models) == DENSE_TRAINED
    for model, group in rows.groupby("model"):
        ranked = report.models[model]
        assert ranked.trials == 2 and len(ranked.valid) == 2 and ranked.invalid.empty
        top = group[group["acc_mean"] == group["acc_mean"].max()]  # ties at the top are possible on 40 items
        assert ranked.best["pruning_method"] in set(top["pruning_method"])
