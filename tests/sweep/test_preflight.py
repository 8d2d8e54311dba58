"""The checks before Ray starts, in process (the CLI's one-line refusals are tested in test_user_errors and
test_experiment, slow): every distinct planning setting of the space is planned, the largest calibration draw of
every text is drawn, a refusal names the settings that fail, and `trust_remote_code` reaches every loader."""

import pytest

from taylor_tune.errors import ConfigError
from taylor_tune.sweep import preflight
from taylor_tune.sweep.experiment import load_experiment
from tests.sweep_helpers import SMALL, write_experiment


def experiment(tmp_path, prune=None, **space):
    return load_experiment(write_experiment(tmp_path, "pre", search_space={**SMALL["search_space"], **space},
                                            prune=prune or SMALL["prune"]))


UNFIXED = {k: v for k, v in SMALL["prune"].items() if k != "sparsity"}
NO_TEXT = {k: v for k, v in SMALL["prune"].items() if k != "calibration"}


def test_distinct_keeps_each_restricted_point_once_in_the_order_first_seen(tmp_path):
    exp = experiment(tmp_path, UNFIXED, sparsity={"grid": [0.1, 0.2]}, uniform={"grid": [False, True]})
    fields = ("pruning_method", "sparsity")
    by_hand = []
    for point in exp.space_points():
        part = {k: v for k, v in point.items() if k in fields}
        if part not in by_hand:
            by_hand.append(part)
    assert len(by_hand) == 4 and preflight._distinct(exp, fields) == by_hand


def test_every_planning_setting_is_planned_and_the_failing_one_is_named(tmp_path):
    # the impossible point comes last in the space: a check of the first point alone would pass
    exp = experiment(tmp_path, UNFIXED, pruning_method={"grid": ["taylor"]}, sparsity={"grid": [0.2, 0.5, 0.9]},
                     uniform={"grid": [True]})
    with pytest.raises(ConfigError) as refused:
        preflight.check_plans(exp)
    assert str(refused.value).startswith(
        "prune: taylor on tiny-llama cannot be planned with these settings (sparsity 0.9, uniform True): ")
    preflight.check_plans(experiment(tmp_path, UNFIXED, pruning_method={"grid": ["taylor"]},
                                     sparsity={"grid": [0.2, 0.5]}, uniform={"grid": [True]}))


def test_a_refusal_without_searched_settings_names_none(tmp_path):
    exp = experiment(tmp_path, {**SMALL["prune"], "sparsity": 0.99}, pruning_method={"grid": ["taylor"]})
    with pytest.raises(ConfigError, match=r"^prune: taylor on tiny-llama cannot be planned with these settings: "):
        preflight.check_plans(exp)


def test_the_largest_draw_of_each_text_is_drawn(tmp_path, monkeypatch):
    drawn = []
    real = preflight.draw_calibration
    monkeypatch.setattr(preflight, "draw_calibration", lambda config, tok: drawn.append(config) or real(config, tok))
    text = tmp_path / "own.txt"
    text.write_text(" ".join(f"word{i} of a calibration text." for i in range(3000)))
    exp = experiment(tmp_path, NO_TEXT, taylor_num_samples={"grid": [2, 8, 4]},
                     calibration={"grid": ["world", str(text)]})
    preflight.check_calibration_sizes(exp)
    # one draw per text, at the longest seq_len and the most samples of the space, seed 0
    assert sorted((c.calibration, c.seq_len, c.num_samples, c.seed) for c in drawn) == sorted(
        [("world", 48, 8, 0), (str(text), 48, 8, 0)])


def test_a_short_second_text_is_refused(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("too short to calibrate on. " * 5)
    exp = experiment(tmp_path, NO_TEXT, calibration={"grid": ["world", str(text)]})
    with pytest.raises(ConfigError, match=r"^search_space: the largest draw of tiny-llama \(8 x 48 tokens\) does not "):
        preflight.check_calibration_sizes(exp)


def test_a_draw_larger_than_the_text_is_refused_naming_its_size(tmp_path, monkeypatch):
    text = tmp_path / "own.txt"  # the draw of 100000 x 48 cannot fit, the one of 2 x 48 would
    text.write_text("\n\n".join(f"word{i} of a calibration text." for i in range(3000)))
    exp = experiment(tmp_path, NO_TEXT, taylor_num_samples={"grid": [2, 100000]}, calibration={"grid": [str(text)]})
    drawn = []
    real = preflight.draw_calibration
    monkeypatch.setattr(preflight, "draw_calibration", lambda config, tok: drawn.append(config) or real(config, tok))
    with pytest.raises(ConfigError, match=r"^search_space: the largest draw of tiny-llama \(100000 x 48 tokens\) "
                                          r"does not fit: "):
        preflight.check_calibration_sizes(exp)
    assert [(c.seq_len, c.num_samples) for c in drawn] == [(48, 100000)]


@pytest.mark.parametrize("trust", [False, True])
def test_trust_remote_code_reaches_every_loader(tmp_path, monkeypatch, trust):
    seen = []

    def spy(real):
        def wrapped(*args, **kwargs):
            seen.append((real.__name__, kwargs.get("trust_remote_code")))
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(preflight, "meta_layout", spy(preflight.meta_layout))
    monkeypatch.setattr(preflight, "load_tokenizer", spy(preflight.load_tokenizer))
    exp = experiment(tmp_path, {**SMALL["prune"], "trust_remote_code": trust})
    preflight.check_plans(exp)
    preflight.check_calibration_sizes(exp)
    assert {name for name, _ in seen} == {"meta_layout", "load_tokenizer"}
    assert all(value is trust for _, value in seen), seen


def test_two_names_of_one_text_are_drawn_once(tmp_path, monkeypatch):
    drawn = []
    real = preflight.draw_calibration
    monkeypatch.setattr(preflight, "draw_calibration", lambda config, tok: drawn.append(config) or real(config, tok))
    # `auto` is the model's own world's text: for tiny-llama, `world`
    preflight.check_calibration_sizes(experiment(tmp_path, NO_TEXT, calibration={"grid": ["auto", "world"]}))
    assert len(drawn) == 1


@pytest.mark.parametrize("criterion", ["taylor", "block_influence", "angular", "measured_loss", "last"])
def test_a_depth_cut_is_planned_before_the_run_with_what_its_criterion_ranks_by(criterion):
    """Found by the pre-start property test: depth's taylor criterion ranks whole layers by their groups' Taylor
    scores, so the check plans it from equal group scores (it was handed the layers' similarity: AttributeError
    before Ray started); the hidden-state criteria from equal similarities; measured_loss and last from nothing."""
    from taylor_tune.config import PruneConfig
    from taylor_tune.pruning.prune import check_plan, meta_layout

    layout = meta_layout("tiny-llama")
    check_plan(PruneConfig(model="tiny-llama", method="depth", depth_criterion=criterion, sparsity=0.2), layout)
    with pytest.raises(Exception, match="layer"):  # a cut of every layer cannot be had, whatever the criterion
        check_plan(PruneConfig(model="tiny-llama", method="depth", depth_criterion=criterion, sparsity=0.99), layout)
