"""What `export` promises, in the fast tier (issue 91, must-show 5: each slip below passed every tier before):
- the trial chosen under several `--constraint`s meets all of them, and is the best of those that do (a pandas
  recomputation), not the best under the last one alone;
- the rebuild is checked against the perplexity the trial reported, its last pass's, not an earlier pass's."""

import json
import math

import pytest

from taylor_tune.config import Evaluation, PruneConfig
from taylor_tune.export.choose import Chosen, choose
from taylor_tune.export.rebuild import rebuild
from taylor_tune.jsonio import json_safe
from taylor_tune.reporting.stats import Objective
from taylor_tune.storage.folder import read_ppl_windows
from taylor_tune.sweep.trial import TrialConfig, run_trial
from tests.export.test_export import tune_folder
from tests.report_helpers import synthetic_trials, write_tune_folder


def test_every_constraint_holds_for_the_chosen_trial_and_it_is_the_best_that_meets_them(tmp_path):
    rows = synthetic_trials()
    rows = rows[rows["model"] == rows["model"].iloc[0]].sort_values("acc_mean", ascending=False, ignore_index=True)
    # the best fails the speed constraint, the second the size one, the third meets both; the rest meet neither
    rows["decode_speedup"] = [1.0, 1.3, 1.25] + [1.0] * (len(rows) - 3)
    rows["params_count"] = [900, 990, 950] + [990] * (len(rows) - 3)
    path = write_tune_folder(rows, tmp_path / "exp")
    both = ("decode_speedup>=1.2", "params_count<=960")
    chosen = choose(str(path), constraints=both)
    meets = rows[(rows["decode_speedup"] >= 1.2) & (rows["params_count"] <= 960)]  # pandas, from the table itself
    assert chosen.row["decode_speedup"] >= 1.2 and chosen.row["params_count"] <= 960
    assert chosen.row["acc_mean"] == meets["acc_mean"].max() == rows["acc_mean"].iloc[2]
    # each constraint alone chooses another trial: a constraint left out shows
    assert choose(str(path), constraints=both[:1]).row["acc_mean"] == rows["acc_mean"].iloc[1]
    assert choose(str(path), constraints=both[1:]).row["acc_mean"] == rows["acc_mean"].iloc[0]


def test_the_rebuild_is_checked_against_the_last_perplexity_pass_the_trial_reported(tmp_path):
    """Two perplexity passes (2 windows, then all 6): their perplexities differ, the trial reports the last, and
    the rebuild gives it back to the last bit on this CPU; an earlier pass's would be refused as not coming back."""
    evaluation = Evaluation(tasks="piqa", task_data="world", ppl="world", ppl_max_windows=6, batch_size=16,
                            fidelities=[4], ppl_fidelities=[2, None], speed=None)
    prune = PruneConfig(model="tiny-llama", sparsity=0.25, seq_len=32, num_samples=8, calibration="world",
                        device="cpu", dtype="float32")
    trial = TrialConfig(prune=prune, evaluation=evaluation, sample_counts=(8,))
    folder = tune_folder(tmp_path / "exp", "t", 0, trial)
    metrics = run_trial(trial, folder)
    (folder / "result.json").write_text(json.dumps(json_safe(metrics)) + "\n")
    chosen = Chosen("t_00000", str(folder), "tiny-llama", metrics, Objective("acc_mean", "max"), "named")
    rebuilt = rebuild(chosen, tmp_path / "work")
    assert rebuilt.checks["ppl"] == (metrics["ppl"], metrics["ppl"])
    # the first pass's 2 windows give another perplexity than the 6 (their per-token losses differ), so a check
    # against it would fail: the test can tell the passes apart
    windows = read_ppl_windows(str(folder))
    per_token = windows["nll"] / windows["tokens"]
    assert len(windows) == 6 and per_token.max() - per_token.min() > 1e-3
    assert math.exp(windows["nll"].sum() / windows["tokens"].sum()) == pytest.approx(metrics["ppl"], rel=1e-12)


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
