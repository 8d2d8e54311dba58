"""An experiment's checks and counts in process. `check_models` against the real tiny-llama config (maximum context
512): each length it checks is allowed up to the maximum context and refused one token past it, a length that is not
measured is not checked, `trust_remote_code` reaches the config loader. The recovery text is refused where the
evaluation scores it, naming the field. The grid's points and sizes against loops over the space."""

import itertools

import pytest
from transformers import PretrainedConfig

import taylor_tune.sources.models as models
from taylor_tune.errors import ConfigError
from taylor_tune.sweep.experiment import check_models, check_recovery_text, check_sources, load_experiment
from tests.sweep_helpers import SMALL, write_experiment

LIMIT = 512  # tiny-llama's max_position_embeddings


def experiment(tmp_path, seq_len=32, prune=None, **evaluation):
    return load_experiment(write_experiment(
        tmp_path, "models", search_space={**SMALL["search_space"], "taylor_seq_len": {"grid": [16, seq_len]}},
        prune=prune or SMALL["prune"], evaluation={**SMALL["evaluation"], **evaluation}))


def test_the_tiny_models_maximum_context_is_the_one_these_tests_use():
    assert models.load_model_config("tiny-llama").max_position_embeddings == LIMIT


def test_a_seq_len_of_the_maximum_context_passes_and_one_more_is_refused(tmp_path):
    check_models(experiment(tmp_path, seq_len=LIMIT))
    with pytest.raises(ConfigError, match=rf"^search_space.taylor_seq_len: {LIMIT + 1} exceeds the maximum context "
                                          rf"\({LIMIT}\) of tiny-llama$"):
        check_models(experiment(tmp_path, seq_len=LIMIT + 1))


def test_the_perplexity_window_is_checked_only_when_perplexity_is_measured(tmp_path):
    check_models(experiment(tmp_path, ppl="world", ppl_window=LIMIT))
    with pytest.raises(ConfigError, match=rf"^evaluation.ppl_window: {LIMIT + 1} is longer than the maximum context"):
        check_models(experiment(tmp_path, ppl="world", ppl_window=LIMIT + 1))
    check_models(experiment(tmp_path, ppl=None, ppl_window=LIMIT + 1))  # no perplexity: the window is not used


@pytest.mark.parametrize(("prefill_len", "prompt_len", "new_tokens"), [(LIMIT, 8, 4), (8, LIMIT - 4, 4)])
def test_the_timed_sequences_may_fill_the_maximum_context_and_not_one_token_more(tmp_path, prefill_len, prompt_len,
                                                                                  new_tokens):
    speed = {"prefill_len": prefill_len, "prompt_len": prompt_len, "new_tokens": new_tokens}
    check_models(experiment(tmp_path, speed=speed))
    longer = {**speed, "prefill_len": prefill_len + 1} if prefill_len == LIMIT else {**speed, "new_tokens": 5}
    with pytest.raises(ConfigError, match=rf"^evaluation.speed: sequences of {LIMIT + 1} tokens"):
        check_models(experiment(tmp_path, speed=longer))


def test_without_speed_nothing_timed_is_checked(tmp_path):
    check_models(experiment(tmp_path, speed=None))


def test_a_config_without_a_maximum_context_checks_no_length(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "load_model_config", lambda model, **kw: PretrainedConfig())
    check_models(experiment(tmp_path, seq_len=LIMIT * 4, ppl="world", ppl_window=LIMIT * 4))


@pytest.mark.parametrize("trust", [False, True])
def test_trust_remote_code_reaches_the_config_loader(tmp_path, monkeypatch, trust):
    seen, real = [], models.load_model_config
    monkeypatch.setattr(models, "load_model_config",
                        lambda model, **kw: seen.append((model, kw)) or real(model, **kw))
    check_models(experiment(tmp_path, prune={**SMALL["prune"], "trust_remote_code": trust}))
    assert seen == [("tiny-llama", {"trust_remote_code": trust})]


def test_the_evaluations_own_text_is_refused_as_recovery_text_naming_the_field(tmp_path):
    text = tmp_path / "own.txt"
    text.write_text(" ".join(f"word{i} of a text." for i in range(3000)))
    exp = load_experiment(write_experiment(tmp_path, "rec", evaluation={**SMALL["evaluation"], "ppl": str(text)},
                                           recovery={"data": str(text), "steps": 2}))
    with pytest.raises(ConfigError, match=rf"^recovery.data: .*{text.name}.* is held-out text the evaluation scores; "):
        check_sources(exp)
    check_recovery_text(str(text), None)  # scored by nothing: allowed


def test_a_missing_instruction_file_is_refused_under_the_field_that_names_it(tmp_path):
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match=r"^search_space.recovery_data: .*missing.jsonl"):
        check_recovery_text(missing, None, "search_space.recovery_data")
    with pytest.raises(ConfigError, match=r"^recovery.data: "):
        check_recovery_text(missing, None)


@pytest.mark.parametrize("algorithm", ["grid", "tpe"])
def test_the_grid_points_and_size_equal_loops_over_models_seeds_and_the_space(tmp_path, algorithm):
    exp = load_experiment(write_experiment(tmp_path, "grid", models=["tiny-llama", "tiny-qwen2"],
                                           search={"algorithm": algorithm, "num_trials": 3,
                                                   "repeats": 2 if algorithm == "grid" else 1}))
    space = [dict(zip(("taylor_seq_len", "taylor_num_samples", "pruning_method"), combo))
             for combo in itertools.product([16, 32, 48], [8], ["taylor", "blockwise"])]
    seeds = range(exp.search.repeats)
    by_hand = [{"model": m, "seed": s, **p} for m in ["tiny-llama", "tiny-qwen2"] for s in seeds for p in space]
    assert exp.grid_points() == by_hand
    size = exp.grid_size()  # a count of trials: an int (the CLI and Tune's num_samples take it as one)
    assert isinstance(size, int) and size == (len(by_hand) if algorithm == "grid" else 3 * 2)


def test_an_experiment_without_recovery_reports_no_recovery_points(tmp_path):
    assert load_experiment(write_experiment(tmp_path, "none")).recovery_points() == 0


def test_a_points_prune_config_is_the_one_written_by_hand(tmp_path):
    from taylor_tune.config import PruneConfig

    exp = experiment(tmp_path)
    point = {"taylor_seq_len": 32, "taylor_num_samples": 8, "pruning_method": "blockwise"}
    by_hand = dict(model="tiny-llama", sparsity=0.2, calibration="world", device="cpu", dtype="float32", seq_len=32,
                   num_samples=8, method="blockwise")
    assert exp.prune_config("tiny-llama", point) == PruneConfig(**by_hand)  # the calibration seed PruneConfig's own
    assert exp.prune_config("tiny-llama", point, seed=3) == PruneConfig(**by_hand, seed=3)


def test_a_dimension_neither_searched_nor_fixed_takes_its_default(tmp_path):
    from taylor_tune.config import PruneConfig

    exp = experiment(tmp_path)
    assert exp.values_of("layerwise_max_ratio") == (PruneConfig.model_fields["layerwise_max_ratio"].default,)
    assert exp.values_of("sparsity") == (0.2,) and exp.values_of("taylor_seq_len") == (16, 32)
    assert exp.values_of("recovery_steps") == ()  # no recovery block


def space_experiment(root, space: str):
    """An experiment file in root/experiments/ whose search_space is the path `space`."""
    (root / "experiments").mkdir(parents=True, exist_ok=True)
    return write_experiment(root / "experiments", "spaced", search_space=space)


def test_a_search_space_path_is_read_from_the_project_then_the_working_folder_or_as_absolute(tmp_path, monkeypatch):
    # experiments/x.yaml names search_spaces/y.yaml from the project's root (the experiment folder's parent),
    # wherever the command runs; a path found only from the working folder is read from there
    import yaml

    grid = {"taylor_seq_len": {"grid": [16, 24]}}
    (tmp_path / "project" / "search_spaces").mkdir(parents=True)
    (tmp_path / "project" / "search_spaces" / "y.yaml").write_text(yaml.safe_dump(grid))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "z.yaml").write_text(yaml.safe_dump({"taylor_seq_len": {"grid": [8]}}))
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert load_experiment(space_experiment(tmp_path / "project", "search_spaces/y.yaml")).values_of(
        "taylor_seq_len") == (16, 24)
    assert load_experiment(space_experiment(tmp_path / "project", "z.yaml")).values_of("taylor_seq_len") == (8,)
    absolute = str(tmp_path / "project" / "search_spaces" / "y.yaml")
    assert load_experiment(space_experiment(tmp_path / "other", absolute)).values_of("taylor_seq_len") == (16, 24)


def test_a_search_space_in_utf8_reads_under_an_ascii_locale(tmp_path):
    # read as UTF-8 whatever the locale says: a comment in another language must not break a sweep on a server
    # whose locale is C without Python's UTF-8 mode
    import os
    import subprocess
    import sys

    (tmp_path / "search_spaces").mkdir()
    (tmp_path / "search_spaces" / "y.yaml").write_text("# Größe der Stichprobe\ntaylor_seq_len: {grid: [16]}\n",
                                                      encoding="utf-8")
    path = space_experiment(tmp_path, "search_spaces/y.yaml")
    code = ("import locale, sys; from taylor_tune.sweep.experiment import load_experiment; "
            "assert locale.getpreferredencoding(False).lower() in ('ascii', 'ansi_x3.4-1968'); "
            "print(load_experiment(sys.argv[1]).values_of('taylor_seq_len'))")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env,
                         encoding="utf-8")
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.strip() == "(16,)"


def test_a_bad_search_space_names_what_it_holds_and_yamls_own_words_on_one_bounded_line(tmp_path):
    import yaml

    (tmp_path / "search_spaces").mkdir()
    listed = tmp_path / "search_spaces" / "list.yaml"
    listed.write_text("- 16\n- 32\n")
    with pytest.raises(ConfigError, match=r"does not hold a mapping of dimensions \(it holds a list\)$"):
        load_experiment(space_experiment(tmp_path, "search_spaces/list.yaml"))
    broken = tmp_path / "search_spaces" / "broken.yaml"
    broken.write_text("taylor_seq_len: [1, 2\n  pruning_method: x\n")
    with pytest.raises(yaml.YAMLError) as parsed:
        yaml.safe_load(broken.read_text())
    with pytest.raises(ConfigError) as refused:
        load_experiment(space_experiment(tmp_path, "search_spaces/broken.yaml"))
    said = str(refused.value).split("is not valid YAML: ", 1)[1]
    assert "\n" not in said and said.split() == str(parsed.value).split()
    # a tag safe_load refuses, with a name of 2,000 characters: the message stops at 500
    tagged = tmp_path / "search_spaces" / "tagged.yaml"
    tagged.write_text(f"taylor_seq_len: !!python/object:{'a' * 2000} {{}}\n")
    with pytest.raises(ConfigError) as long:
        load_experiment(space_experiment(tmp_path, "search_spaces/tagged.yaml"))
    assert len(str(long.value).split("is not valid YAML: ", 1)[1]) == 500


def test_an_unreadable_experiment_file_is_called_an_experiment(tmp_path):
    with pytest.raises(ConfigError, match=r"^cannot read experiment file .*none\.yaml: No such file"):
        load_experiment(tmp_path / "none.yaml")
    (tmp_path / "listed.yaml").write_text("- a\n")
    with pytest.raises(ConfigError, match=r"expected a mapping of experiment keys, got list$"):
        load_experiment(tmp_path / "listed.yaml")
