"""Configuration: YAML through safe_load, every error naming its field, config importing neither torch nor ray."""

import subprocess
import sys

import pytest

from taylor_tune.config import build_prune_config, load_prune_config
from taylor_tune.errors import ConfigError


def test_yaml_round_trip_and_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny-qwen2\nmethod: layerwise\nsparsity: 0.3\n")
    config = load_prune_config(path)
    assert (config.model, config.method, config.sparsity, config.seq_len) == ("tiny-qwen2", "layerwise", 0.3, 64)
    assert config.layerwise_cap == pytest.approx(0.6) and config.extreme_threshold == pytest.approx(0.6)
    assert config.trust_remote_code is False


def test_every_bad_field_is_named_at_once():
    with pytest.raises(ConfigError) as error:
        build_prune_config({"model": "x", "sparsity": -1, "seq_len": 0, "colour": "red"})
    text = str(error.value)
    assert "sparsity: Input should be greater than 0 (got -1)" in text
    assert "seq_len: Input should be greater than 1 (got 0)" in text
    assert "colour: unknown key" in text


def test_yaml_is_loaded_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("model: !!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_prune_config(path)


def test_a_yaml_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_prune_config(path)


def test_config_and_planning_import_neither_torch_nor_ray():
    code = ("import sys, taylor_tune.config, taylor_tune.pruning.methods, taylor_tune.pruning.diagnostics; "
            "print('torch' in sys.modules or 'ray' in sys.modules)")
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


@pytest.mark.parametrize("field", ["fidelities", "ppl_fidelities"])
@pytest.mark.parametrize("limits", [(0,), (0, 10), (-5, None)])
def test_a_pass_of_no_items_is_refused(field, limits):
    """Issue 91, must-show 5: a fidelity of 0 (a pass scoring nothing, reported as a result) passed every tier.
    Positive limits, null for every item, are what a pass takes."""
    from taylor_tune.config import Evaluation

    with pytest.raises(ValueError, match="limits must be positive"):
        Evaluation(**{field: limits})
    assert getattr(Evaluation(**{field: (1, 10, None)}), field) == (1, 10, None)
