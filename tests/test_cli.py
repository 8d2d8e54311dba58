"""The `taylor-tune prune` command: artifacts of a good run, and one clear line for every bad input."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import taylor_tune.pruning.prune
from taylor_tune.cli import main
from taylor_tune.sources.calibration import load_calibration
from taylor_tune.sources.models import byte_tokenizer, load_model

REPO = Path(__file__).resolve().parent.parent
EXPERIMENTS = REPO / "experiments"
BASE = [
    "prune",
    "--model",
    "tiny-llama-random",
    "--calibration",
    "sample",
    "--seq-len",
    "32",
    "--num-samples",
    "16",
    "--device",
    "cpu",
]


def run(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_prune_writes_summary_importance_and_model(capsys, tmp_path):
    out = tmp_path / "run"
    code, stdout, _ = run(capsys, *BASE, "--method", "blockwise", "--sparsity", "0.25", "--output", str(out))
    assert code == 0 and "pruning_ratio" in stdout
    summary = json.loads((out / "pruning_summary.json").read_text())
    for key in (
        "params_count",
        "pruning_ratio",
        "layer_pruning_ratio",
        "layer_retention_ratio",
        "extreme_pruning_layers",
        "grad_mean_ratio",
        "grad_norm_ratio",
        "grad_mean_range",
        "grad_norm_range",
        "removed_groups",
        "config",
    ):
        assert key in summary, key
    assert summary["config"]["method"] == "blockwise" and summary["config"]["sparsity"] == 0.25
    model = load_model(str(out / "model"))
    for layer, removed in zip(model.model.layers, summary["removed_groups"]):
        assert layer.self_attn.k_proj.out_features == 8 * (4 - len(removed["attention_groups"]))
        assert layer.mlp.gate_proj.out_features == 192 - len(removed["mlp_channels"])
    tensors = load_file(out / "importance.safetensors")
    expected_ids = load_calibration(byte_tokenizer(), "sample", seq_len=32, num_samples=16, seed=0)
    assert torch.equal(tensors["calibration_input_ids"], expected_ids)
    assert tensors["layers.0.attention_scores"].shape == (4,) and tensors["layers.3.mlp_scores"].shape == (192,)
    # the stored scores are the ones the plan used: every removed channel of layer 1 scores below every kept one
    scores, removed = tensors["layers.1.mlp_scores"].numpy(), summary["removed_groups"][1]["mlp_channels"]
    kept = np.setdiff1d(np.arange(192), removed)
    assert scores[removed].max() <= scores[kept].min()
    assert np.isclose(
        np.max(tensors["layer_grad_mean"].numpy()) / np.min(tensors["layer_grad_mean"].numpy()),
        summary["grad_mean_ratio"],
    )


def test_help_shows_a_worked_example(capsys):
    with pytest.raises(SystemExit):
        main(["prune", "--help"])
    assert "taylor-tune prune --model tiny-llama" in capsys.readouterr().out


@pytest.fixture
def gpt2_folder(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path / "gpt2")
    return str(tmp_path / "gpt2")


@pytest.fixture
def tiny_text(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("only a few words here\n\nand a few more")
    return str(path)


BEFORE_LOADING = [
    (["--sparsity", "1.5"], "sparsity: Input should be less than 1"),
    (["--sparsity", "0"], "sparsity: Input should be greater than 0"),
    (
        ["--method", "pruneall"],
        "method: unknown method 'pruneall'; allowed: blockwise, depth, experts, layerwise, magnitude, random, taylor",
    ),
    (["--seq-len", "1"], "seq_len: Input should be greater than 1"),
    (["--seq-len", "4096"], "seq_len: 4096 exceeds the model's maximum context of 512 tokens"),
    (["--num-samples", "0"], "num_samples: Input should be greater than 0"),
    (["--num-samples", "abc"], "num_samples: Input should be a valid integer"),
    (["--calibration", "missing.txt"], "calibration: 'missing.txt' is neither a dataset"),
    (["--model", "./no/such/folder"], "model: './no/such/folder' is not a built-in model"),
    (["--model", "tiny-gpt"], "model: 'tiny-gpt' is not a built-in model"),
    (["--model", "GPT2"], "architecture 'gpt2'"),
    (["--calibration", "SMALL"], "calibration: SMALL"),
    (["--blockwise-layer-start", "3", "--blockwise-layer-end", "2"], "blockwise_layer_end (2) must be greater"),
    (["--device", "tpu"], "device: unknown device 'tpu'"),
    # issue 93: the experts method and the mixtures of experts go together, each setting with its own method
    (["--method", "experts"], "method: experts removes a mixture's experts, and this model is dense"),
    (["--model", "tiny-qwen3moe"], "method: taylor prunes dense layers, and this model is a mixture of experts: use "
                                   "experts (tiny-qwen3moe is qwen3_moe)"),
    (["--expert-sparsity", "0.5"], "expert_sparsity: only the experts method (a mixture of experts) reads it"),
    (["--model", "tiny-qwen3moe", "--method", "experts", "--sparsity", "0.3"],
     "sparsity: the experts method removes whole experts, the same count in every sparse layer, and reads no "
     "sparsity; set expert_sparsity"),
    (["--model", "tiny-qwen3moe", "--method", "experts", "--expert-criterion", "gate"],
     "expert_criterion: Input should be 'frequency', 'reap', 'ean' or 'taylor'"),
    (["--model", "tiny-qwen3moe", "--method", "experts", "--streaming", "on"],
     "streaming: the experts method holds the whole mixture"),
    (["--model", "tiny-qwen3moe", "--method", "experts", "--recover"],
     "--recover: its LoRA adapters go on a dense model's projections"),
]


@pytest.mark.parametrize("extra, message", BEFORE_LOADING)
def test_bad_input_is_one_line_before_any_weight_loads(
    extra, message, capsys, monkeypatch, tmp_path, gpt2_folder, tiny_text
):
    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the input was validated")

    monkeypatch.setattr(taylor_tune.pruning.prune, "load_model", no_loading)
    extra = [gpt2_folder if x == "GPT2" else tiny_text if x == "SMALL" else x for x in extra]
    message = message.replace("SMALL", tiny_text)
    code, _, err = run(capsys, *BASE, *extra, "--output", str(tmp_path / "out"))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("taylor-tune: error: ")
    assert message in err, err
    assert not (tmp_path / "out").exists()


def test_a_plan_that_would_empty_a_block_is_refused(capsys, tmp_path):
    code, _, err = run(capsys, *BASE, "--method", "blockwise", "--sparsity", "0.9", "--output", str(tmp_path / "o"))
    assert code == 2 and "emptying a block" in err and err.count("\n") == 1


def test_an_expert_share_that_would_leave_fewer_experts_than_the_top_k_is_refused(capsys, tmp_path):
    code, _, err = run(capsys, "prune", "--model", "tiny-qwen3moe", "--method", "experts", "--expert-sparsity", "0.9",
                       "--output", str(tmp_path / "o"))
    assert code == 2 and err.count("\n") == 1
    assert "expert_sparsity: 0.9 removes 7 of 8 experts, leaving fewer than the 2 each token is routed to" in err


def test_the_installed_command_exits_2_without_a_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "taylor_tune", *BASE, "--sparsity", "2", "--output", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "sparsity" in proc.stderr


INTERRUPTED_MAIN = """
import atexit, ctypes, sys
from taylor_tune import cli
def main():
    # an interrupt met inside code run through the C API, as while an extension loads, then handled by `main`
    ctypes.pythonapi.PyRun_SimpleString(b"raise KeyboardInterrupt")
    return cli.EXIT_NOT_DONE
cli.main = main
atexit.register(lambda: print("exit handlers ran", flush=True))
cli.run() if sys.argv[1] == "run" else sys.exit(main())
"""


@pytest.mark.parametrize("entry", ["run", "sys.exit"])
def test_an_interrupted_command_exits_with_its_code_not_by_signal(tmp_path, entry):
    """CI saw `sweep` end by SIGINT (-2) after printing its "interrupted" line and returning 4: CPython remembers an
    interrupt that crossed `PyRun_*` and kills itself at exit. `cli.run` (the installed command, `python -m
    taylor_tune`) exits 4 all the same, after the exit handlers; plain `sys.exit` is the control that dies."""
    (tmp_path / "interrupted_main.py").write_text(INTERRUPTED_MAIN)
    proc = subprocess.run([sys.executable, "-m", "interrupted_main", entry], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "exit handlers ran" in proc.stdout
    assert proc.returncode == (4 if entry == "run" else -signal.SIGINT), proc.stderr[-2000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupt_that_an_extension_turned_into_its_import_error_is_an_interrupt(monkeypatch, capsys, sig):
    """CI saw a SIGTERM during `sweep`'s imports end as a traceback and exit 1: the KeyboardInterrupt it raised inside
    scipy's pybind11 module came out as "ImportError: initialization failed". After a signal, whatever the command
    raises is the interrupt: one line, exit 4 for a sweep. Without a signal, the same ImportError is a bug and
    propagates (the control)."""
    import taylor_tune.cli as cli

    def interrupted_import(args):
        try:
            signal.raise_signal(sig)  # the command's handler raises KeyboardInterrupt, here inside the "import"
        except KeyboardInterrupt:
            raise ImportError("initialization failed") from None  # what pybind11 makes of it
        raise AssertionError("the signal was not handled")

    monkeypatch.setattr(cli, "_run_sweep", interrupted_import)
    assert main(["sweep", "any.yaml"]) == 4
    assert capsys.readouterr().err.strip() == ("taylor-tune: interrupted; run the same command to resume "
                                               "(finished trials are kept)")
    monkeypatch.setattr(cli, "_run_sweep", lambda args: (_ for _ in ()).throw(ImportError("initialization failed")))
    with pytest.raises(ImportError):
        main(["sweep", "any.yaml"])
    assert signal.getsignal(sig) is not cli._interrupt  # the command's handlers are gone once it returns


def test_a_yaml_config_with_overrides_on_the_command_line(capsys, tmp_path):
    code, _, _ = run(capsys, "prune", "--config", str(EXPERIMENTS / "prune_tiny_llama.yaml"), "--num-samples", "8",
                     "--seq-len", "16", "--method", "magnitude", "--output", str(tmp_path / "o"))
    assert code == 0
    config = json.loads((tmp_path / "o" / "pruning_summary.json").read_text())["config"]
    assert (config["model"], config["method"], config["num_samples"], config["trust_remote_code"]) == (
        "tiny-llama",
        "magnitude",
        8,
        False,
    )


def test_every_shipped_experiment_config_validates():
    from taylor_tune.config import load_prune_config

    paths = sorted(EXPERIMENTS.glob("prune_*.yaml"))
    assert paths
    for path in paths:
        load_prune_config(path)


@pytest.mark.slow
def test_evaluate_writes_results_json(capsys, tmp_path):
    out = tmp_path / "eval.json"
    code, stdout, _ = run(capsys, "evaluate", "--model", "tiny-llama", "--tasks", "arc_easy,piqa", "--limit", "20",
                          "--ppl", "world", "--ppl-window", "64", "--device", "cpu", "--output", str(out))
    assert code == 0 and "acc_mean" in stdout
    result = json.loads(out.read_text())
    # the timings and token counts are named as a trial's: <stage>_s, <stage>_tokens
    assert result["scorer"] == "prefix" and result["zero_shot_20_tokens"] > 0
    assert result["ppl_s"] > 0 and result["zero_shot_20_s"] > 0 and result["fidelity"] == 20
    code, _, _ = run(capsys, "evaluate", "--model", "tiny-llama", "--tasks", "arc_easy,piqa", "--limit", "20",
                     "--ppl", "none", "--scorer", "hflm", "--device", "cpu", "--output", str(tmp_path / "hflm.json"))
    hflm = json.loads((tmp_path / "hflm.json").read_text())
    assert code == 0 and hflm["scorer"] == "hflm" and hflm["zero_shot_20_tokens"] > result["zero_shot_20_tokens"]
    assert hflm["tasks"] == result["tasks"]  # the same scores from lm-eval's own scorer
    assert set(result["tasks"]) == {"arc_easy", "piqa"} and result["ppl_window"] == 64
    assert all(result["tasks"][t]["n"] == 20 for t in result["tasks"])
    assert result["acc_mean"] == pytest.approx((result["acc_arc_easy"] + result["acc_piqa"]) / 2)


@pytest.mark.parametrize("extra, message", [
    (["--tasks", "boolq,nope"], "tasks: unknown task 'nope'"),
    (["--limit", "0"], "limit: Input should be greater than 0"),
    (["--ppl-window", "1024"], "ppl_window: 1024 is longer than the model's maximum context of 512 tokens"),
    (["--task-data", "/no/such/dir"], "task_data: '/no/such/dir' is neither"),
    (["--scorer", "fast"], "scorer: Input should be 'prefix' or 'hflm'"),
])
def test_evaluate_bad_input_is_one_line(extra, message, capsys, tmp_path):
    code, _, err = run(capsys, "evaluate", "--model", "tiny-llama", "--ppl", "world", "--device", "cpu", *extra,
                       "--output", str(tmp_path / "e.json"))
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_the_readme_points_at_nothing_a_user_of_the_repository_cannot_open():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert not re.search(r"\.\./shared|issue", readme, re.IGNORECASE)
    assert (Path(__file__).resolve().parent.parent / "docs" / "specification.md").is_file()


def test_prune_uniform_writes_a_stock_folder(capsys, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    code, _, err = run(
        capsys, *BASE, "--sparsity", "0.3", "--uniform", "--uniform-multiple", "32", "--output", str(out)
    )
    assert code == 0, err
    summary = json.loads((out / "pruning_summary.json").read_text())
    assert summary["config"]["uniform"] is True and summary["config"]["uniform_multiple"] == 32
    model = AutoModelForCausalLM.from_pretrained(out / "model")  # stock class, no remote code
    widths = {layer.mlp.gate_proj.out_features for layer in model.model.layers}
    assert len(widths) == 1 and widths.pop() % 32 == 0 and model.config.intermediate_size < 192


def prune_flags(parser) -> set[str]:
    (prune,) = (action.choices["prune"] for action in parser._subparsers._group_actions)
    return {flag for action in prune._actions for flag in action.option_strings}


def test_every_prune_setting_is_a_flag_and_a_new_one_becomes_one(monkeypatch):
    """Issue 63, build 1: prune's flags are derived from PruneConfig. Every field (the model aside, --model) is one,
    and a toy field added to the class appears as a flag (a yes/no one as --x / --no-x) with no other change."""
    from pydantic import Field, create_model

    import taylor_tune.cli as cli
    from taylor_tune.config import PruneConfig

    flags = prune_flags(cli.build_parser())
    assert {"--" + name.replace("_", "-") for name in PruneConfig.model_fields} <= flags
    assert {"--depth-criterion", "--depth-share", "--flap-compensation", "--no-flap-compensation"} <= flags
    toy = create_model("ToyConfig", __base__=PruneConfig, toy_knob=(int, Field(3, description="a toy knob")),
                       toy_switch=(bool, Field(False, description="a toy switch")))
    monkeypatch.setattr(cli, "PruneConfig", toy)
    assert {"--toy-knob", "--toy-switch", "--no-toy-switch"} <= prune_flags(cli.build_parser())


def test_a_field_marked_searchable_is_a_flag_a_search_dimension_and_a_report_column(monkeypatch):
    """Issue 63, build 1, one declaration per setting: a toy field marked `searchable` on a PruneConfig subclass,
    with no other change, is a prune flag, a dimension of the search space (its values validated as the field:
    gt=0), and a column of every trial's row (the consolidated table's), searched or not."""
    from pydantic import Field, ValidationError, create_model

    import taylor_tune.cli as cli
    from taylor_tune.config import PruneConfig, format_validation_error, searchable
    from taylor_tune.sweep.experiment import SearchSpace, search_space_class
    from taylor_tune.sweep.trial import trial_columns

    toy = create_model("ToyConfig", __base__=PruneConfig, toy_knob=(int, Field(
        3, gt=0, description="a toy knob", json_schema_extra=searchable())))
    monkeypatch.setattr(cli, "PruneConfig", toy)
    assert "--toy-knob" in prune_flags(cli.build_parser())
    space = search_space_class(toy)
    assert space.model_validate({"toy_knob": {"grid": [1, 2]}}).domains()["toy_knob"].values == (1, 2)
    with pytest.raises(ValidationError) as refused:
        space.model_validate({"toy_knob": {"grid": [0]}})
    assert format_validation_error(refused.value) == "toy_knob: Input should be greater than 0 (got 0)"
    assert trial_columns(toy(model="tiny-llama", toy_knob=5))["toy_knob"] == 5
    assert trial_columns(toy(model="tiny-llama"))["toy_knob"] == 3  # not searched: the default, still a column
    with pytest.raises(ValidationError):  # the shipped space is PruneConfig's own: no toy_knob there
        SearchSpace.model_validate({"toy_knob": {"grid": [1]}})


@pytest.mark.parametrize("flags, expected", [
    (["--method", "taylor", "--depth-share", "0.25", "--depth-criterion", "last"],
     {"depth_share": 0.25, "depth_criterion": "last"}),
    (["--method", "taylor", "--criterion", "flap", "--no-flap-compensation"],
     {"criterion": "flap", "flap_compensation": False}),
])
def test_the_settings_missing_from_prune_reach_the_pruning(capsys, tmp_path, flags, expected):
    """--depth-share and --depth-criterion (a mixed cut: whole layers go, the last ones) and --no-flap-compensation
    (FLAP without its bias: no output projection gains one) were documented and searchable but not prune flags."""
    out = tmp_path / "run"
    code, _, err = run(capsys, *BASE, *flags, "--sparsity", "0.3", "--output", str(out))
    assert code == 0, err
    summary = json.loads((out / "pruning_summary.json").read_text())
    assert {k: summary["config"][k] for k in expected} == expected
    model = load_model(str(out / "model"))
    if "depth_share" in expected:  # a mixed cut removed whole layers
        assert model.config.num_hidden_layers < load_model("tiny-llama-random").config.num_hidden_layers
    else:  # with compensation every layer's output projections gain a bias (checked by hand)
        assert all(layer.self_attn.o_proj.bias is None and layer.mlp.down_proj.bias is None
                   for layer in model.model.layers)


def test_every_recovery_setting_is_a_prune_flag_and_a_new_one_becomes_one(monkeypatch):
    """Issue 65, build 3: `prune` takes the recovery settings too, derived from RecoverySpec as --recovery-<name>
    (what only a sweep reports to Tune aside); a toy field added to the class appears with no other change."""
    from pydantic import Field, create_model

    import taylor_tune.cli as cli
    from taylor_tune.config import RecoverySpec

    flags = prune_flags(cli.build_parser())
    expected = {"--recovery-" + name.replace("_", "-") for name in RecoverySpec.model_fields
                if name not in cli.SWEEP_ONLY_RECOVERY}
    assert expected <= flags and "--recover" in flags and "--recovery-eval-every" not in flags
    toy = create_model("ToyRecovery", __base__=RecoverySpec, toy_knob=(int, Field(3, description="a toy knob")))
    monkeypatch.setattr(cli, "RecoverySpec", toy)
    assert "--recovery-toy-knob" in prune_flags(cli.build_parser())


@pytest.mark.slow  # prunes, then trains for a few steps
def test_prune_with_recovery_flags_saves_the_recovered_model(capsys, tmp_path):
    """`prune --recovery-steps 3 --recovery-warmup-steps 1 ...` saves what recovering the pruned model gives when done
    by hand (`prune`, then `recover_pruned` with the same settings): the same logits. (A warm-up longer than the steps
    is refused, issue 91.)"""
    from taylor_tune.config import PruneConfig, RecoverySpec
    from taylor_tune.pruning.prune import prune
    from taylor_tune.recovery.train import recover_pruned
    from taylor_tune.sources.data import resolve_text

    out = tmp_path / "run"
    code, stdout, err = run(capsys, *BASE, "--sparsity", "0.25", "--recovery-steps", "3", "--recovery-lr", "5e-3",
                            "--recovery-warmup-steps", "1", "--recovery-seq-len", "16",
                            "--recovery-micro-batch-size", "2",
                            "--recovery-data", "sample", "--recovery-lora-dropout", "0", "--output", str(out))
    assert code == 0, err
    assert "recovered 3 steps (ce): held-out loss" in stdout
    config = PruneConfig(model="tiny-llama-random", method="taylor", sparsity=0.25, seq_len=32, num_samples=16,
                         calibration="sample", seed=0)
    spec = RecoverySpec(steps=3, lr=5e-3, warmup_steps=1, seq_len=16, micro_batch_size=2, data="sample",
                        lora_dropout=0.0)
    pruned = prune(config)
    by_hand = recover_pruned(pruned.model, pruned.tokenizer, spec, model_name=config.model,
                             heldout_text=resolve_text("auto", config.model), seed=0).model
    saved, unrecovered = load_model(str(out / "model")), prune(config).model
    ids = torch.tensor([[5, 9, 40, 41, 72, 101, 32, 115]])
    with torch.no_grad():
        assert torch.allclose(saved(input_ids=ids).logits, by_hand(input_ids=ids).logits, rtol=0, atol=1e-5)
        assert not torch.allclose(saved(input_ids=ids).logits, unrecovered(input_ids=ids).logits,
                                  rtol=0, atol=1e-4)  # recovery changed the model


def test_a_bad_recovery_flag_is_one_line_naming_it(capsys, tmp_path):
    code, _, err = run(capsys, *BASE, "--recovery-lora-rank", "0", "--output", str(tmp_path / "run"))
    assert code == 2 and err.count("\n") == 1 and "recovery.lora_rank: Input should be greater than 0" in err, err
    assert not (tmp_path / "run").exists()
