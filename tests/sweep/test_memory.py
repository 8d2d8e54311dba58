"""The trial's peak-memory estimate (`sweep.memory`) against what the stages allocate, and its refusal before Ray."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from taylor_tune.config import Evaluation, PruneConfig, RecoverySpec
from taylor_tune.errors import ConfigError
from taylor_tune.sweep import memory
from taylor_tune.sweep.experiment import load_experiment
from taylor_tune.sweep.preflight import check_memory
from tests.sweep_helpers import write_experiment

ROOT = Path(__file__).resolve().parents[2]
# (dtype, hidden, intermediate, layers, vocab, batch, seq_len): a vocabulary-bound shape, a layer-bound one in 16 bits
# (a float32 shape with a 4x MLP, 512 wide, held too when written). The 16-bit shape is small: on a CPU without AVX-512
# torch multiplies bfloat16 matrices in a slow fallback; a larger one ran past the limit (BENCHMARKS, ninth session).
SHAPES = {"vocab-bound": ("float32", 128, 512, 2, 32000, 8, 256),
          "layer-bound-bf16": ("bfloat16", 512, 512, 4, 1000, 4, 256)}
STAGES = ("importance", "calibration_forward", "speed", "recovery", "recovery_kd")


def estimate(stage: str, dtype: str, hidden, intermediate, layers, vocab, batch, seq_len, params, layer_params) -> int:
    """The module's estimate of what `stage` adds over the weights already resident (a kd teacher's too)."""
    shape = memory.Shape(params, layer_params, hidden, intermediate, layers, vocab, (hidden // 128) * 64, hidden)
    size = 4 if dtype == "float32" else 2
    if stage == "importance":
        peak = memory.importance(shape, batch, seq_len, size)
    elif stage == "calibration_forward":
        peak = memory.calibration_forward(shape, batch, seq_len, size)
    elif stage == "speed":
        peak = memory.speed(shape, batch, seq_len, size)
    else:
        loss = "kd" if stage == "recovery_kd" else "ce"
        peak = memory.recovery(shape, RecoverySpec(micro_batch_size=batch, seq_len=seq_len, loss=loss), size)
    return peak.total - peak.parts["weights"]


@pytest.fixture(scope="module")
def measured() -> dict:
    """Every stage on every shape (`memory_probe --each`): each run in a process of its own, forked from one that has
    imported the libraries, as a fresh process would have them."""
    runs = [(stage, shape) for shape in SHAPES for stage in STAGES]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "tests.sweep.memory_probe", "--each",
                          json.dumps([[stage, *SHAPES[shape]] for stage, shape in runs])],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == len(runs), out.stdout
    return {run: json.loads(line) for run, line in zip(runs, lines)}


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stage", STAGES)
def test_the_estimate_is_a_lower_bound_within_the_measured_peak(stage, shape, measured):
    """Each stage run for real on a random LLaMA-shaped model in a process of its own, after a first run on a few
    tokens (`memory_probe`): the peak it adds to the resident memory is at least the estimate (a refusal is never
    wrong) and at most 2.5 times it (the estimate is not vacuous; the ratios measured are in BENCHMARKS)."""
    dtype, *sizes = SHAPES[shape]
    got = measured[stage, shape]
    predicted = estimate(stage, dtype, *sizes, got["params"], got["layer_params"])
    assert predicted <= got["added"] <= 2.5 * predicted, (predicted, got)


SHAPE = memory.Shape(params=1000, layer_params=800, hidden=64, intermediate=192, layers=4, vocab=259, kv_width=32,
                     q_width=64)


def test_each_projections_widths_are_those_of_the_model_of_every_family(arch):
    """What the LoRA estimate sizes, against the modules themselves (an explicit head_dim makes q_proj other than
    hidden x hidden)."""
    from taylor_tune.pruning.groups import count_parameters
    from tests.helpers import tiny

    model = tiny(arch)
    shape = memory.Shape.of(model.config, count_parameters(model), 0)
    layer = model.model.layers[0]
    modules = {**{n: getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
               **{n: getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")}}
    assert shape.projections() == {n: (m.in_features, m.out_features) for n, m in modules.items()}


def stages(**settings) -> list[str]:
    prune = PruneConfig(model="tiny-llama", **settings.pop("prune", {}))
    from taylor_tune.pruning.prune import draws_calibration, uses_gradients

    evaluation, recovery = Evaluation(**settings.pop("evaluation", {})), settings.pop("recovery", None)
    peaks = memory.trial_peaks(SHAPE, prune, evaluation, recovery, 4, draws_calibration=draws_calibration(prune),
                               uses_gradients=uses_gradients(prune))
    return [peak.stage for peak in peaks]


def test_a_trial_is_estimated_at_the_stages_its_settings_run():
    """The importance pass where gradients are taken, a calibration forward where calibration is drawn at all, no
    perplexity or speed where they are off, recovery where it is asked for."""
    assert stages() == ["importance pass", "calibration forward", "perplexity", "speed measurement"]
    assert stages(prune={"method": "taylor", "criterion": "wanda_sp"}) == [
        "calibration forward", "perplexity", "speed measurement"]
    assert stages(prune={"method": "random"}, evaluation={"ppl": None, "speed": None}) == []
    assert stages(prune={"method": "magnitude", "criterion": "l2"}, evaluation={"speed": None},
                  recovery=RecoverySpec()) == ["perplexity", "recovery"]


def test_micro_batches_hold_at_most_the_rows_drawn():
    small = memory.trial_peaks(SHAPE, PruneConfig(model="tiny-llama", micro_batch_size=10**6, num_samples=8),
                               Evaluation(ppl=None, speed=None), None, 4, draws_calibration=True, uses_gradients=True)
    assert small[0].parts["activations"] == memory.backward_pass(SHAPE, 8 * 64, 4)


def test_a_kd_recovery_holds_the_teacher_beside_the_pruned_student():
    ce = memory.recovery(SHAPE, RecoverySpec(loss="ce"), 2, kept=0.75)
    kd = memory.recovery(SHAPE, RecoverySpec(loss="kd"), 2, kept=0.75)
    assert ce.parts["weights"] == 1500 and kd.parts["weights"] == 3500
    assert kd.parts["logits"] > ce.parts["logits"] and kd.parts["activations"] == ce.parts["activations"]


def big_batches(tmp_path, memory_gib: float, **recovery) -> Path:
    return write_experiment(tmp_path, "mem", resources={"cpu": 1, "gpu": 0, "memory": memory_gib},
                            search_space={"taylor_seq_len": {"grid": [256]}, "taylor_num_samples": {"grid": [64]},
                                          "pruning_method": {"grid": ["taylor"]}},
                            prune={"sparsity": 0.2, "calibration": "world", "device": "cpu", "dtype": "float32",
                                   "micro_batch_size": 64}, **recovery)


def test_a_point_whose_peak_exceeds_the_trials_memory_is_refused_naming_its_settings(tmp_path):
    """64 x 256 calibration tokens through tiny-llama's backward pass: refused under 0.25 GiB per trial, naming the
    stage and the settings that size it; accepted under 1 GiB."""
    with pytest.raises(ConfigError) as refused:
        check_memory(load_experiment(big_batches(tmp_path, 0.25)))
    assert str(refused.value).startswith("memory: taylor on tiny-llama: the importance pass needs at least 0.")
    assert str(refused.value).endswith("more than the 0.25 GiB of resources.memory; lower micro_batch_size (or "
                                       "num_samples) 64 x seq_len 256")
    check_memory(load_experiment(big_batches(tmp_path, 1)))


def test_without_a_reservation_a_cpu_trial_is_bounded_by_the_machine(tmp_path, monkeypatch):
    from taylor_tune.sweep import preflight

    monkeypatch.setattr(preflight, "memory_bytes", lambda: 2**28)
    experiment = load_experiment(write_experiment(tmp_path, "m", resources={"cpu": 1, "gpu": 0}))
    assert preflight.trial_memory(experiment) == (2**28, 4, "this machine's 0.2 GiB")
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert preflight.trial_memory(experiment) is None  # a cluster's nodes are not this machine


@pytest.mark.slow
def test_a_reservation_no_node_of_the_cluster_offers_is_refused_once_ray_has_started(tmp_path, ray_head):
    """Below the machine's memory but above what its Ray node offers (the memory less the object store): refused in
    one line when Ray reports the cluster's nodes (the run's head, as under `ray job submit`), exit 2, no trial
    started. A reservation that fits is passed to Ray as the trial's `memory` resource, which Ray accepts: the sweep
    finishes."""
    from taylor_tune.sweep.preflight import memory_bytes
    from tests.sweep_helpers import SMALL, finished, run_sweep

    experiment = write_experiment(tmp_path, "too_much", resources={"cpu": 1, "gpu": 0,
                                                                   "memory": round(memory_bytes() / 2**30 - 0.5, 1)})
    proc = run_sweep(experiment, cluster=ray_head)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "resources.memory:" in proc.stderr and "the largest node offers Ray" in proc.stderr
    assert "Traceback" not in proc.stderr and not finished(tmp_path / "sweeps" / "too_much")

    space = {**SMALL["search_space"], "taylor_seq_len": {"grid": [16]}, "pruning_method": {"grid": ["taylor"]}}
    experiment = write_experiment(tmp_path, "fits", resources={"cpu": 1, "gpu": 0, "memory": 1}, search_space=space)
    proc = run_sweep(experiment, cluster=ray_head)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(finished(tmp_path / "sweeps" / "fits")) == 1


def test_the_kept_share_is_a_lower_bound_of_what_an_aligned_plan_keeps():
    """Issue 83, build 4: aligned widths (`align`, `servable`) round each layer to the nearest multiple, down as well
    as up, so a model can keep less than 1 - sparsity; the estimate's share is below what every plan here keeps (its
    layout's own count), and 1 - sparsity alone is not (some plan keeps less)."""
    import numpy as np

    from taylor_tune.pruning.plan import GroupScores
    from taylor_tune.pruning.prune import make_plan, meta_layout
    from taylor_tune.sources.models import load_model_config

    layout = meta_layout("tiny-llama-random")
    shape = memory.Shape.of(load_model_config("tiny-llama-random"), layout.total_params, sum(layout.layer_params))
    below_target = 0
    for sparsity in np.linspace(0.05, 0.4, 15):
        for seed in range(4):
            rng = np.random.default_rng(seed)
            scores = GroupScores(attn=tuple(rng.random(g) for g in layout.attn_groups),
                                 mlp=tuple(rng.random(c) * rng.uniform(0.1, 3.0) for c in layout.mlp_channels))
            config = PruneConfig(model="tiny-llama-random", method="layerwise", sparsity=float(sparsity), align=64,
                                 layerwise_max_ratio=0.9)
            plan = make_plan(config, scores, layout, loss=lambda candidate: 0.0)
            kept = 1 - plan.params_removed(layout) / layout.total_params
            assert kept >= memory.kept_share(shape, config), (sparsity, seed)
            below_target += kept < 1 - sparsity
    assert below_target
    assert memory.kept_share(shape, PruneConfig(model="tiny-llama-random", sparsity=0.3)) == pytest.approx(0.7)


def test_a_mixtures_tokens_are_sized_by_their_routed_experts_and_an_experts_point_is_bounded(tmp_path):
    """Issue 93: a token of a mixture computes with its top-k experts, so the estimate's MLP width is k x an
    expert's (Mixtral's `intermediate_size`, Qwen3-MoE's `moe_intermediate_size`, or its dense layers' where wider);
    the experts method's Taylor pass is bounded as the dense one is."""
    from taylor_tune.sources.models import load_model_config

    mixtral, qwen = load_model_config("tiny-mixtral"), load_model_config("tiny-qwen3moe")
    assert memory.Shape.of(mixtral, 1, 1).intermediate == 2 * mixtral.intermediate_size
    assert memory.Shape.of(qwen, 1, 1).intermediate == max(qwen.intermediate_size, 2 * qwen.moe_intermediate_size)
    experiment = write_experiment(
        tmp_path, "moe", models=["tiny-mixtral"], resources={"cpu": 1, "gpu": 0, "memory": 0.25},
        search_space={"taylor_seq_len": {"grid": [256]}, "taylor_num_samples": {"grid": [64]},
                      "pruning_method": {"grid": ["experts"]}, "expert_criterion": {"grid": ["taylor"]}},
        prune={"calibration": "world", "device": "cpu", "dtype": "float32", "micro_batch_size": 64})
    with pytest.raises(ConfigError) as refused:
        check_memory(load_experiment(experiment))
    assert str(refused.value).startswith("memory: experts on tiny-mixtral: the importance pass needs at least 0.")
