"""What one trial writes and measures, against independent computations: its configuration columns, its per-layer
analysis (from the pruned model's own shapes), the unpruned model it times (loaded as the trial's own model, one
measurement per resolved dtype), and the machine a measurement is of."""

import json
import math
import time

import pytest
import torch

from taylor_tune import schema
from taylor_tune.config import Evaluation, PruneConfig, SpeedSpec
from taylor_tune.pruning import prune as pruning_stages
from taylor_tune.sources.models import load_model
from taylor_tune.sweep.stages import speed as speed_stages
from taylor_tune.sweep.trial import TrialConfig, completed_metrics, run_trial, trial_columns
from tests.helpers import record_loads

SPEED = SpeedSpec(prefill_batch=1, prefill_len=8, decode_batch=2, prompt_len=4, new_tokens=2, context=64, repeats=1,
                  warmup=0)


def a_trial(cache_dir: str | None, *, dtype: str = "float32", speed: SpeedSpec | None = None, **prune) -> TrialConfig:
    return TrialConfig(
        prune=PruneConfig(**{"model": "tiny-llama-random", "method": "taylor", "seq_len": 16, "num_samples": 4,
                             "calibration": "world", "device": "cpu", "dtype": dtype, **prune}),
        evaluation=Evaluation(tasks="piqa", task_data="world", ppl=None, batch_size=8, fidelities=[2], speed=speed),
        sample_counts=(4,), cache_dir=cache_dir,
    )


def test_a_trials_columns_are_the_tables_names_for_each_setting_it_ran_with():
    config = PruneConfig(model="tiny-qwen2", method="blockwise", seq_len=24, num_samples=6, seed=3, sparsity=0.3,
                         layerwise_max_ratio=0.7, blockwise_layer_start=1, blockwise_layer_end=2,
                         blockwise_attention="mlp_only", criterion="wanda_sp", calibration="sample", uniform=True,
                         depth_criterion="angular", depth_share=0.5)
    values = config.model_dump()
    # the consolidated table's five identifying columns (docs/specification.md §3), named as the table names them
    expected = {"model": "tiny-qwen2", "pruning_method": "blockwise", "taylor_seq_len": 24, "taylor_num_samples": 6,
                "seed": 3}
    expected |= {column: values[field] for column, field in schema.DIMENSIONS.items()}
    assert trial_columns(config) == expected
    assert set(expected) == set(schema.CONFIG_COLUMNS) | set(schema.DIMENSIONS)


def test_a_finished_trials_infinite_metrics_read_back_as_the_floats_it_reported(tmp_path):
    """A collapsed model's perplexity is inf and a ratio may be -inf: evaluation.json holds them as "inf" / "-inf"
    (JSON has neither: jsonio), and a resumed sweep reads the finished trial's metrics back as the floats the trial
    reported, compared with the metrics written (NaN, written as null, reads back as None, as Tune's own JSON does)."""
    import math

    from taylor_tune.jsonio import write_json

    trial = a_trial(str(tmp_path / "cache"))
    write_json(tmp_path / "config.json", trial.record())
    reported = {"stage": schema.zero_shot_stage(trial.evaluation.fidelities[-1]), "ppl": math.inf,
                "decode_speedup": -math.inf, "acc_mean": 0.25, "pruning_method": "taylor"}
    write_json(tmp_path / "evaluation.json", reported | {"grad_min": math.nan, "tasks": ["piqa"], "limit": 2})
    got = completed_metrics(tmp_path, trial)
    assert got == reported | {"grad_min": None}
    assert type(got["ppl"]) is float and type(got["decode_speedup"]) is float


def test_a_trials_layer_analysis_is_what_its_pruned_model_kept(tmp_path):
    """layer_analysis.json (the report's per-layer plots read it) against the pruned and unpruned models' own weights:
    each layer's share of parameters removed, the attention groups (k_proj rows / head size) and MLP channels
    (gate_proj rows) kept, and the gradient statistics the importance pass stored."""
    from safetensors.torch import load_file

    trial = a_trial(str(tmp_path / "sweep" / "importance_cache"), sparsity=0.3)
    trial = trial.model_copy(update={"sample_counts": (4, 8)})
    folder = tmp_path / "trials" / "t"  # its parents made
    metrics = run_trial(trial, folder)
    layers = json.loads((folder / "layer_analysis.json").read_text())
    assert metrics["importance_cache"] == "computed" and metrics["output_dir"] == str(folder)
    record = json.loads((folder / "config.json").read_text())
    # without recovery, the record an older sweep's finished trial holds: no recovery key (so it is found finished)
    assert TrialConfig.model_validate(record) == trial and "recovery" not in record
    assert completed_metrics(folder, trial) == metrics | {"stage": schema.zero_shot_stage(2)}  # as its last report
    assert list((tmp_path / "sweep" / "requests").iterdir())  # the sweep's zero-shot requests, for its next trials
    # the pruning's summary keeps every pruning stage's seconds, as the trial reported them
    timings = json.loads((folder / "pruning_summary.json").read_text())["timings_s"]
    stages = ("calibration_s", "load_s", "importance_s", "plan_s", "apply_s", "prune_s")
    assert {k: timings[k] for k in stages} == {k: metrics[k] for k in stages}
    # the pass stored every sample count of the search: a trial of 8 samples reads it
    more = trial.model_copy(update={"prune": trial.prune.model_copy(update={"num_samples": 8})})
    assert run_trial(more, tmp_path / "t8")["importance_cache"] == "hit"
    # without a sweep's cache, its data named `auto` (the tiny model's world), run again in the same folder: no cache
    # column, the same pruning and the same evaluation
    auto = Evaluation(tasks="piqa", task_data="auto", ppl="auto", ppl_max_windows=2, batch_size=8, fidelities=[2],
                      speed=None)
    alone = trial.model_copy(update={"cache_dir": None, "evaluation": auto})
    again = run_trial(alone, folder, output_dir="storage/t")
    assert "importance_cache" not in again and again["output_dir"] == "storage/t"
    assert TrialConfig.model_validate(json.loads((folder / "config.json").read_text())) == alone
    assert completed_metrics(folder, trial) is None  # the folder now holds another configuration's trial
    assert completed_metrics(folder, alone) == again | {"stage": schema.zero_shot_stage(2)}
    assert json.loads((folder / "layer_analysis.json").read_text()) == layers
    assert (again["acc_piqa"], again["acc_piqa_n"]) == (metrics["acc_piqa"], metrics["acc_piqa_n"])
    world = trial.model_copy(update={"cache_dir": None, "evaluation": auto.model_copy(
        update={"task_data": "world", "ppl": "world"})})
    assert run_trial(world, tmp_path / "world")["ppl"] == again["ppl"]
    assert {k: metrics[k] for k in schema.CONFIG_COLUMNS} == {
        "model": "tiny-llama-random", "pruning_method": "taylor", "taylor_seq_len": 16, "taylor_num_samples": 4,
        "seed": 0}

    # the trial's pruned model, rebuilt: pruning is deterministic for a config
    pruned = pruning_stages.prune(trial.prune).model
    original = load_model("tiny-llama-random")
    head = original.config.head_dim
    count = lambda layer: sum(p.numel() for p in layer.parameters())
    entry = next((tmp_path / "sweep" / "importance_cache").glob("*.safetensors"))
    stored = load_file(str(entry))
    assert len(layers) == original.config.num_hidden_layers
    for i, (row, before, after) in enumerate(zip(layers, original.model.layers, pruned.model.layers)):
        removed = 1 - count(after) / count(before)
        assert row["layer"] == i
        assert row["pruning_ratio"] == pytest.approx(removed, abs=1e-12)
        assert row["retention_ratio"] == pytest.approx(1 - removed, abs=1e-12)
        assert row["attention_groups_kept"] == after.self_attn.k_proj.out_features // head
        assert row["mlp_channels_kept"] == after.mlp.gate_proj.out_features
        assert row["grad_mean"] == pytest.approx(float(stored["n4.layer_grad_mean"][i]), rel=1e-6)
        assert row["grad_norm"] == pytest.approx(float(stored["n4.layer_grad_norm"][i]), rel=1e-6)
    assert 0 < sum(r["pruning_ratio"] for r in layers)  # something was cut
    assert "peak_gpu_memory_bytes" not in metrics  # a CPU trial claims no GPU memory


def test_a_trial_recorded_before_ppl_fidelities_existed_is_found_finished_and_one_with_passes_reads_back(tmp_path):
    """One perplexity pass over every window (the default) is left out of config.json, so that a finished trial of a
    sweep from before `ppl_fidelities` (whose record lacks it) is found finished on resume; passes are recorded and
    read back."""
    from taylor_tune.jsonio import write_json

    trial = a_trial(str(tmp_path / "cache"))
    old = {**trial.record(), "evaluation": {k: v for k, v in trial.record()["evaluation"].items()
                                            if k != "ppl_fidelities"}}
    assert old == trial.record()
    write_json(tmp_path / "config.json", old)
    final = {"stage": schema.zero_shot_stage(trial.evaluation.fidelities[-1]), "acc_mean": 0.5}
    write_json(tmp_path / "evaluation.json", final | {"tasks": ["piqa"], "limit": 2})
    assert completed_metrics(tmp_path, trial) == final
    passes = trial.model_copy(update={"evaluation": trial.evaluation.model_copy(update={"ppl_fidelities": (4, None)})})
    assert passes.record()["evaluation"]["ppl_fidelities"] == [4, None]
    assert TrialConfig.from_record(passes.record()) == passes and completed_metrics(tmp_path, passes) is None


def test_the_unpruned_model_timed_is_the_trials_own_and_a_same_shape_trial_reads_the_pair(tmp_path, monkeypatch):
    """The unpruned model a trial's speedups are timed against: loaded exactly as the trial loads the model it prunes
    (device, dtype, remote code, seed), in that dtype (its weight bytes), and timed in the trial's own window after
    waiting its turn at the node's timing lock; a trial whose pruned layer shapes, dtype and machine an earlier trial
    timed reads that pair (auto on a CPU is float32 on the CPU) and loads nothing more than the model it prunes."""
    loads = record_loads(monkeypatch, speed_stages, pruning_stages)
    cache = str(tmp_path / "sweep" / "importance_cache")
    runs = []
    # uniform cuts: the same layer shapes in every dtype, so only the dtype tells their measurements apart
    for i, (dtype, device) in enumerate([("auto", "cpu"), ("bfloat16", "cpu"), ("float32", "auto")]):
        loads.clear()
        start, began = time.perf_counter(), time.time()
        trial = a_trial(cache, dtype=dtype, speed=SPEED, device=device, uniform=True, sparsity=0.3)
        metrics = run_trial(trial, tmp_path / str(i))
        runs.append((metrics, (time.perf_counter() - start, began, time.time()), list(loads)))

    for metrics, (wall, began, ended), seen in runs[:2]:  # measured
        timed_load, pruned_load = sorted(seen, key=lambda load: load[0] != speed_stages.__name__)
        assert timed_load[0] == speed_stages.__name__ and timed_load[1:] == pruned_load[1:]
        # both models timed inside the trial's own window, after waiting their turn at the node's timing lock
        assert began <= metrics["speed_timed_from"] <= metrics["speed_timed_to"] <= ended
        assert 0 <= metrics["speed_wait_s"] < wall and metrics["speed_reused"] is False
        assert 0 < metrics["speed_s"] < wall and "peak_gpu_memory_bytes" not in metrics  # a CPU trial
    assert runs[0][0]["params_count"] == runs[1][0]["params_count"] == runs[2][0]["params_count"]
    third, _, seen = runs[2]  # auto: this CPU, as the first trial's
    assert [name for name, _, _ in seen] == [pruning_stages.__name__]  # read: only the model to prune was loaded
    assert third["speed_reused"] is True and "speed_timed_from" not in third and "speed_wait_s" not in third
    speed = [k for k in runs[0][0] if "speedup" in k or "tokens_per_s" in k or k.startswith("unpruned_")]
    assert {k: third[k] for k in speed} == {k: runs[0][0][k] for k in speed}

    def held(dtype: torch.dtype) -> int:  # every tensor the model holds (the rotary frequencies too), in bytes
        model = load_model("tiny-llama-random", dtype=dtype)
        return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])

    fp32, bf16 = held(torch.float32), held(torch.bfloat16)
    assert bf16 < fp32 and [m["unpruned_weight_bytes"] for m, _, _ in runs] == [fp32, bf16, fp32]
    assert len(list((tmp_path / "sweep" / "paired_speed").glob("*.json"))) == 2


@pytest.mark.parametrize("disturbed", [1, speed_stages.WINDOWS])
def test_a_window_whose_speedup_is_implausible_is_timed_again_and_refused_when_every_one_is(tmp_path, monkeypatch,
                                                                                              caplog, disturbed):
    """A trial's own pair whose decode speedup comes out 1,000 times off (what a preemption in runs of milliseconds
    gives; a fixed value, so the planted fault does not depend on the real speedup) is timed again in the same lock
    (each window's inputs drawn from the trial's seed, the retry logged with the window's error); the trial reports
    the first plausible window, stored for a same-shape trial under the key of what it measured (model, dtype,
    machine, speed settings, layer shapes), or, where every window is off, fails naming the speedup and the settings
    that lengthen the runs."""
    from taylor_tune.evaluation.speed import checked_paired
    from taylor_tune.jsonio import digest, read_entry

    windows, seeds, measure = [], [], speed_stages.measure_paired

    def measured(*args, **kwargs):
        pair = measure(*args, **kwargs)
        windows.append(pair)
        seeds.append(kwargs.get("seed"))
        return pair | {"decode_speedup": 1e-3} if len(windows) <= disturbed else pair

    monkeypatch.setattr(speed_stages, "measure_paired", measured)
    trial = a_trial(str(tmp_path / "sweep" / "importance_cache"), speed=SPEED, uniform=True, sparsity=0.3, seed=2)
    if disturbed == speed_stages.WINDOWS:
        with pytest.raises(ValueError, match=r"decode_speedup .* in each of 3 windows: the timed runs are too short "
                                             r"for the machine's other work; raise evaluation.speed repeats or "
                                             r"new_tokens$"):
            run_trial(trial, tmp_path / "trial")
        assert len(windows) == 3 and not list((tmp_path / "sweep" / "paired_speed").glob("*.json"))
        return
    with caplog.at_level("WARNING", logger=speed_stages.log.name):
        metrics = run_trial(trial, tmp_path / "trial")
    assert len(windows) == 2 and metrics["decode_speedup"] == windows[1]["decode_speedup"] and seeds == [2, 2]
    with pytest.raises(ValueError) as refused:
        checked_paired(windows[0] | {"decode_speedup": 1e-3})
    assert [r.getMessage() for r in caplog.records if r.name == speed_stages.log.name] == [
        f"{refused.value}; timing the pair again (window 2 of 3)"]
    assert metrics["speed_timed_from"] <= metrics["speed_timed_to"]
    pruned = pruning_stages.prune(trial.prune).model
    fields = {"model": "tiny-llama-random", "dtype": "torch.float32",
              "device": speed_stages.machine(torch.device("cpu")), "speed": SPEED.model_dump(),
              "layers": pruning_stages.layer_shapes(pruned)}
    (stored,) = (tmp_path / "sweep" / "paired_speed").glob("*.json")
    assert stored.name == f"{digest(fields)[:24]}.json"
    assert read_entry(stored.read_text(), json.loads(json.dumps(fields)), "measured") == json.loads(
        json.dumps(windows[1]))
    again = run_trial(trial, tmp_path / "again")  # the same shapes: the stored (plausible) pair is read
    assert len(windows) == 2 and again["speed_reused"] and again["decode_speedup"] == metrics["decode_speedup"]


def test_a_measurement_is_of_the_gpu_it_ran_on_or_of_this_host(monkeypatch):
    """Speed entries are keyed by what they measured: a CUDA device's own name (each index asked by itself), or the
    CPU of this host. The CUDA query is replaced (this machine has no GPU); tests/test_gpu.py runs it for real."""
    import socket

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"GPU {torch.device(device).index}")
    assert speed_stages.machine(torch.device("cuda:1")) == "GPU 1"
    assert speed_stages.machine(torch.device("cuda", 0)) == "GPU 0"
    assert speed_stages.machine(torch.device("cpu")) == f"cpu@{socket.gethostname()}"


@pytest.mark.slow
def test_only_the_last_fidelity_of_a_recovered_trial_reads_as_finished_at_every_point_it_could_be_killed(tmp_path):
    """Issue 62, must-show 3: a resumed sweep skips a trial whose folder `completed_metrics` judges finished. Killed
    after any report but the last (the cheap zero-shot pass, each recovery rung, the recovered model's held-out loss,
    the evaluation before recovery at the final limit), its folder must read as unfinished; after the last, as the
    metrics it reported. Checked at each report of a real trial with two fidelities, recovery rungs and
    evaluate_before."""
    from taylor_tune.config import RecoverySpec

    base = a_trial(str(tmp_path / "sweep" / "importance_cache"))
    trial = base.model_copy(update={
        "evaluation": base.evaluation.model_copy(update={"fidelities": (2, 3)}),
        "recovery": RecoverySpec(steps=4, eval_every=2, micro_batch_size=2, seq_len=16, heldout_windows=2,
                                 data="world", evaluate_before=True),
    })
    folder, verdicts = tmp_path / "t", []

    def report(metrics):  # what a kill right after this report would leave in the folder
        verdicts.append((metrics.get("stage"), completed_metrics(folder, trial)))

    final = run_trial(trial, folder, report=report)
    stages = [stage for stage, _ in verdicts]
    assert stages[-1] == schema.zero_shot_stage(3) and schema.zero_shot_stage(2) in stages
    assert sum(schema.is_recovery_stage(s) for s in stages) >= 2  # the rungs and the recovered point
    assert all(done is None for _, done in verdicts[:-1]), verdicts
    assert verdicts[-1][1] == final | {"stage": schema.zero_shot_stage(3)}


@pytest.mark.slow  # a pruning, a paired timing and a zero-shot pass
def test_on_a_gpu_the_trials_peak_is_taken_before_the_unpruned_model_joins_and_counted_anew_after(tmp_path,
                                                                                                 monkeypatch):
    """The speed stage loads the unpruned model beside the pruned one for its window only: on CUDA the trial's peak
    so far is kept before the load and the device's peak counter is reset after the window, so the last report's
    peak_gpu_memory_bytes is the larger of the two spans without the pair's window. The CUDA calls are replaced
    (this machine has no GPU); tests/test_gpu.py runs the trial on CUDA."""
    from taylor_tune.sweep.stages.evaluation import evaluator, zero_shot_pass
    from taylor_tune.sweep.stages.run import TrialRun

    calls, peaks = [], iter([700, 300])  # the pruning's peak; then the evaluation's, after the window
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: calls.append("peak") or next(peaks))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    trial = a_trial(None, speed=SPEED)
    run = TrialRun(trial, tmp_path, {}, pruning=pruning_stages.prune(trial.prune), on_gpu=True)
    measured = speed_stages.measure(run)
    assert calls == ["peak", "empty", "reset"] and run.peak_gpu_bytes == 700
    assert measured["speed_reused"] is False and measured["speed_pairs"] == 1
    run.evaluator = evaluator(run)
    assert zero_shot_pass(0)(run)["peak_gpu_memory_bytes"] == 700  # the larger span: the pruning's


def test_perplexity_passes_score_the_models_seeded_windows_once_each_and_end_at_the_whole_texts(tmp_path,
                                                                                                monkeypatch):
    """ppl_fidelities [2, 4, null]: three passes, each reported with its index; the first scores the first 2 windows
    of the model's seeded order (racing.Blocks, as a race's blocks), each later one only the windows it adds; the
    last reports the perplexity of every window, as one pass over the text does, and leaves every window's NLL."""
    from taylor_tune.evaluation.evaluate import Evaluator
    from taylor_tune.storage.folder import read_ppl_windows
    from taylor_tune.sweep.racing import Blocks, race_seed

    scored, perplexity = [], Evaluator.perplexity
    monkeypatch.setattr(Evaluator, "perplexity", lambda self, select=None: scored.append(select) or perplexity(
        self, select))

    def trial(**evaluation) -> TrialConfig:
        return TrialConfig(
            prune=PruneConfig(model="tiny-llama-random", method="taylor", seq_len=16, num_samples=4,
                              calibration="world", device="cpu", sparsity=0.3),
            evaluation=Evaluation(tasks="piqa", task_data="world", ppl="world", ppl_window=32, ppl_max_windows=12,
                                  batch_size=8, fidelities=[2], speed=None, **evaluation),
            sample_counts=(4,), cache_dir=None)

    reports = []
    passes = run_trial(trial(ppl_fidelities=[2, 4, None]), tmp_path / "passes", report=reports.append)
    ppl = [r for r in reports if r["stage"].startswith("ppl")]
    assert [(r["stage"], r["ppl_pass"], r["ppl_windows"]) for r in ppl] == [("ppl_2", 0, 2), ("ppl_4", 1, 4),
                                                                            ("ppl", 2, 12)]
    order = Blocks.plan({"ppl": 12}, (2, 4, 5), race_seed(0, "tiny-llama-random")).order["ppl"]
    assert scored[0] == list(order[:2]) and scored[1] == list(order[2:4])
    assert sorted(scored[2]) == sorted(order[4:])  # the rest, once each
    windows = read_ppl_windows(str(tmp_path / "passes"))
    assert list(windows.index) == list(order[:4]) + scored[2] and windows["tokens"].eq(31).all()

    scored.clear()
    once = run_trial(trial(), tmp_path / "once")
    assert scored == [None] and once["ppl_pass"] == 0
    assert passes["ppl"] == pytest.approx(once["ppl"], rel=1e-6)
    assert ppl[0]["ppl"] == pytest.approx(math.exp(windows["nll"].iloc[:2].sum() / 62), rel=1e-12)


@pytest.mark.parametrize("record", [[1, 2], "a trial", {"prune": {"model": "tiny-llama"}}],
                         ids=["a list", "a string", "no evaluation"])
def test_a_config_json_that_is_no_trials_record_is_an_export_error_naming_it(tmp_path, record):
    """A trial's config.json is read as JSON and validated field by field: any other JSON value, or a record without
    its evaluation, is a one-line ExportError naming the file, never a lookup's traceback."""
    from taylor_tune.export.choose import ExportError
    from taylor_tune.export.rebuild import trial_config

    (tmp_path / "config.json").write_text(json.dumps(record))
    with pytest.raises(ExportError, match="config.json: not a trial configuration this version reads"):
        trial_config(tmp_path)
