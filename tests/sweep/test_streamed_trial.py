"""Issue 92: a trial with `streaming: on` holds its model one decoder layer at a time through every stage it runs
(the gradient pass, the pruned folder written layer by layer and read back so, perplexity and the zero-shot pass) and
reports what the in-memory trial reports: the same plan, the same accuracies, perplexity to 1e-5. `auto` streams only
where the memory estimate says the model does not fit; what cannot be streamed is refused in one line."""

import json

import pytest

from taylor_tune.config import Evaluation, PruneConfig, SpeedSpec
from taylor_tune.errors import ConfigError
from taylor_tune.sweep.stages.pruning import trial_streams
from taylor_tune.sweep.trial import TrialConfig, run_trial


def a_trial(streaming: str, **evaluation) -> TrialConfig:
    return TrialConfig(
        prune=PruneConfig(model="tiny-llama", method="taylor", seq_len=32, num_samples=8, calibration="world",
                          device="cpu", dtype="float32", micro_batch_size=3, sparsity=0.5, streaming=streaming),
        evaluation=Evaluation(**{"tasks": "all", "task_data": "world", "ppl": "world", "ppl_window": 64,
                                 "ppl_max_windows": 6, "batch_size": 4, "fidelities": [12], "speed": None,
                                 **evaluation}),
        sample_counts=(8,))


def test_a_streamed_trial_reports_what_the_in_memory_trial_reports(tmp_path, monkeypatch):
    monkeypatch.setenv("TAYLOR_TUNE_SCRATCH", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    ours = run_trial(a_trial("on"), tmp_path / "on")
    theirs = run_trial(a_trial("off"), tmp_path / "off")
    assert ours["streamed"] is True and theirs["streamed"] is False
    removed = [json.loads((tmp_path / side / "pruning_summary.json").read_text())["removed_groups"]
               for side in ("on", "off")]
    assert removed[0] == removed[1]  # the same plan
    assert ours["params_count"] == theirs["params_count"]
    accuracies = [name for name in theirs if name.startswith(("acc_", "acc_norm_")) and name.endswith(
        tuple(f"_{task}" for task in ("boolq", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge",
                                      "openbookqa")))]
    assert len(accuracies) >= 7 and 0 < theirs["acc_mean"] < 1  # every task, and the cut leaves something to lose
    for name in accuracies:
        assert ours[name] == theirs[name], name
    assert ours["ppl"] == pytest.approx(theirs["ppl"], rel=1e-5)
    assert not any((tmp_path / "scratch").iterdir())  # the streamed pruned model is not kept
    assert sorted(p.name for p in (tmp_path / "on").iterdir()) == sorted(p.name for p in (tmp_path / "off").iterdir())


def test_auto_streams_only_a_model_that_does_not_fit(monkeypatch):
    from taylor_tune.sweep.stages import pruning as stage

    assert trial_streams(a_trial("auto")) is False  # a tiny model fits any machine
    monkeypatch.setattr(stage, "memory_bytes", lambda: 2**20)  # a machine of 1 MiB: it does not
    assert trial_streams(a_trial("auto")) is True
    assert trial_streams(a_trial("off")) is False


def test_what_holds_the_whole_model_is_refused_with_streaming():
    speed = SpeedSpec(prefill_batch=1, prefill_len=8, decode_batch=2, prompt_len=4, new_tokens=2, context=64,
                      repeats=1, warmup=0)
    with pytest.raises(ConfigError, match="evaluation.speed"):
        trial_streams(a_trial("on", speed=speed))
    with pytest.raises(ValueError, match="streaming: FLAP's compensation"):
        PruneConfig(model="tiny-llama", method="taylor", criterion="flap", streaming="on")


@pytest.mark.parametrize("prune", [
    {"method": "magnitude"}, {"method": "random"}, {"method": "depth", "sparsity": 0.3},
    {"method": "layerwise", "criterion": "taylor_sum"},
    {"method": "depth", "depth_criterion": "taylor", "sparsity": 0.3},
    {"method": "depth", "depth_criterion": "angular", "sparsity": 0.3}, {"method": "taylor", "criterion": "wanda_sp"},
    {"method": "taylor", "criterion": "flap", "flap_compensation": False},
    {"method": "layerwise", "depth_share": 0.5, "sparsity": 0.4},
    {"method": "blockwise", "sparsity": 0.3, "blockwise_layer_start": 1, "blockwise_layer_end": 4},
    {"method": "taylor", "uniform": True},
    {"method": "depth", "depth_criterion": "measured_loss", "sparsity": 0.3}],
    ids=lambda p: "-".join(map(str, p.values())))
def test_every_streamed_method_prunes_and_scores_as_in_memory(tmp_path, prune):
    """Each scorer that streams (weights, activations, similarity, none) and each plan measured on the calibration
    loss (blockwise's attention rule, the uniform layout's attention count, depth's greedy removal: each candidate
    one streamed read of the model, masked layer by layer) through a whole trial: the same plan and accuracies as
    the in-memory trial."""
    def trial(streaming):
        base = a_trial(streaming)
        return base.model_copy(update={"prune": base.prune.model_copy(update=prune)})

    ours, theirs = run_trial(trial("on"), tmp_path / "on"), run_trial(trial("off"), tmp_path / "off")
    removed = [json.loads((tmp_path / side / "pruning_summary.json").read_text())
               for side in ("on", "off")]
    assert (removed[0]["removed_groups"], removed[0]["layers_removed"]) == (removed[1]["removed_groups"],
                                                                            removed[1]["layers_removed"])
    assert ours["acc_mean"] == theirs["acc_mean"] and ours["ppl"] == pytest.approx(theirs["ppl"], rel=1e-5)


def test_a_sweep_over_streaming_on_and_off_gives_one_plan_and_one_set_of_metrics(tmp_path, ray_head):
    """Must-show 5, through Ray: `streaming: {grid: [on, off]}` on the trained tiny Llama (a folder of safetensors),
    each trial its own gradient pass (the importance cache keys a streamed pass apart), the same plan, accuracies
    and perplexity to 1e-5 in both."""
    from tests.sweep_helpers import SMALL, finished, run_sweep_to_end, write_experiment

    experiment = write_experiment(
        tmp_path, "streams",
        search_space={"streaming": {"grid": ["on", "off"]}, "taylor_seq_len": {"grid": [32]},
                      "taylor_num_samples": {"grid": [8]}, "pruning_method": {"grid": ["taylor"]}},
        prune={**SMALL["prune"], "sparsity": 0.5, "micro_batch_size": 3},
        evaluation={**SMALL["evaluation"], "tasks": ["piqa", "hellaswag", "arc_easy"], "ppl": "world",
                    "ppl_window": 64, "ppl_max_windows": 6, "speed": None},
    )
    proc = run_sweep_to_end(experiment, cluster=ray_head)
    assert "2 finished, 0 errored" in proc.stdout, proc.stdout[-2000:]
    trials, folders = {}, {}
    for folder in finished(tmp_path / "sweeps" / "streams").values():
        metrics = json.loads((folder / "evaluation.json").read_text())
        summary = json.loads((folder / "pruning_summary.json").read_text())
        trials[metrics["streaming"]] = (metrics, summary["removed_groups"])
        folders[metrics["streaming"]] = folder
        assert metrics["streamed"] is (metrics["streaming"] == "on")
    (on, plan_on), (off, plan_off) = trials["on"], trials["off"]
    assert plan_on == plan_off and on["importance_cache"] == off["importance_cache"] == "computed"
    for name in ("acc_piqa", "acc_hellaswag", "acc_arc_easy", "acc_mean", "params_count"):
        assert on[name] == off[name], name
    assert on["ppl"] == pytest.approx(off["ppl"], rel=1e-5)
    for name in ("config.json", "pruning_summary.json", "layer_analysis.json", "evaluation.json"):
        assert (folders["on"] / name).is_file() and (folders["off"] / name).is_file(), name


def test_where_the_host_cannot_hold_the_kept_activations_they_go_to_the_scratch_folder(tmp_path, monkeypatch):
    """A machine too small for what the gradient pass keeps between layers: the trial keeps it in its scratch folder
    (`streamed_kept_on_disk`), files written and read there, the same plan and metrics; the folder removed after."""
    from taylor_tune.sources import streaming
    from taylor_tune.sweep.stages import pruning as stage

    monkeypatch.setenv("TAYLOR_TUNE_SCRATCH", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    monkeypatch.setattr(stage, "memory_bytes", lambda: 2**16)  # 64 KiB: any activation is too much
    written = []
    monkeypatch.setattr(streaming, "save_file", lambda tensors, path: written.append(path) or real(tensors, path))
    real = __import__("safetensors.torch", fromlist=["save_file"]).save_file
    ours = run_trial(a_trial("on"), tmp_path / "on")
    theirs = run_trial(a_trial("off"), tmp_path / "off")
    assert ours["streamed_kept_on_disk"] is True and written and all("kept" in str(p) for p in written)
    assert ours["acc_mean"] == theirs["acc_mean"] and ours["ppl"] == pytest.approx(theirs["ppl"], rel=1e-5)
    assert not any((tmp_path / "scratch").iterdir())


def _streamed_experiment(tmp_path, **resources):
    from taylor_tune.sweep.experiment import load_experiment
    from tests.sweep_helpers import SMALL, write_experiment

    return load_experiment(write_experiment(
        tmp_path, "streamed", search_space={"taylor_seq_len": {"grid": [32]}, "taylor_num_samples": {"grid": [8]},
                                            "pruning_method": {"grid": ["taylor"]}},
        prune={**SMALL["prune"], "streaming": "on"}, evaluation={**SMALL["evaluation"], "speed": None},
        resources={"cpu": 1, "gpu": 0, **resources}))


def test_the_preflight_holds_a_streamed_point_to_its_own_peaks_naming_the_place_short(tmp_path, monkeypatch):
    """A streamed point is checked against the streamed peaks where their parts live: refused in one line naming
    the device (a reservation smaller than one layer's pass) or the scratch disk (no room for the pruned model);
    taken where both have room. What holds the whole model is refused with streaming: on."""
    import shutil
    from collections import namedtuple

    from taylor_tune.sweep import preflight

    preflight.check_memory(_streamed_experiment(tmp_path, memory=1))  # fits: nothing raised
    with pytest.raises(ConfigError, match=r"streamed: the streamed importance pass needs at least 0\.\d GiB on the "
                                          r"device, more than the 0.001 GiB of resources.memory"):
        preflight.check_memory(_streamed_experiment(tmp_path, memory=0.001))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30, 1000))
    with pytest.raises(ConfigError, match=r"streamed: its pruned model and what the streamed importance pass keeps "
                                          r"need at least 0\.\d+ GiB on the scratch disk, more than the 0.0 GiB free"):
        preflight.check_memory(_streamed_experiment(tmp_path, memory=1))
    speed = _streamed_experiment(tmp_path).model_copy(update={"evaluation": Evaluation(tasks="piqa")})
    with pytest.raises(ConfigError, match="streaming: on holds tiny-llama one layer at a time, which evaluation.speed"):
        preflight.check_streaming(speed)
    with pytest.raises(ConfigError, match="streaming: on, but model: 'tiny-llama-random' is built in memory"):
        preflight.check_streaming(_streamed_experiment(tmp_path).model_copy(update={"models": ["tiny-llama-random"]}))
