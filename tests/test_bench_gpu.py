"""bench/bench_gpu.py's CPU mode: the GPU benchmark's whole path (a shape built from its config and saved, a trial as
a sweep runs it, the evaluation with both scorers, the speed of depth, width and mixed cuts) on a tiny shape, and its
numbers consistent with each other."""

import functools
import importlib.util
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parent.parent


@functools.cache
def load_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)), max_size=12))
def test_device_busy_time_is_the_union_of_kernel_intervals(spans):
    """The profile's busy time against a count of the microsecond ticks that any interval covers."""
    intervals = [(start, start + length) for start, length in spans]
    covered = {tick for start, end in intervals for tick in range(start, end)}
    assert load_bench().busy_seconds(intervals) == pytest.approx(len(covered) / 1e6, abs=1e-12)


def test_kernel_names_sort_into_kinds():
    kind = load_bench().kernel_kind
    assert kind("nvjet_sm90_tst_256x152_64x4_1x2_h_bz_coopA_TNT") == "matmul"
    assert kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "attention"
    assert kind("void at::native::vectorized_elementwise_kernel<8, silu_kernel>") == "other"
    # Inductor's fused elementwise kernel that feeds an attention: elementwise; FlexAttention's template: attention
    assert kind("triton_poi_fused__scaled_dot_product_cudnn_attention__unsafe_view_add_cat_2") == "other"
    assert kind("triton_tem_fused_0") == "attention"


def stages_of(trial: dict) -> float:
    return next(v for k, v in trial["stages_s"].items() if k.startswith("zero_shot_"))


@pytest.mark.slow
@pytest.mark.real
def test_the_gpu_benchmark_runs_its_small_mode_on_cpu(assets, tmp_path):
    out, bench = tmp_path / "gpu.json", str(REPO / "bench" / "bench_gpu.py")
    # the tokenizers as a bare GPU machine gets them: an archive of their files, unpacked there
    subprocess.run([sys.executable, bench, "--pack-tokenizers", str(tmp_path / "tok.tgz")], check=True, cwd=REPO)
    with tarfile.open(tmp_path / "tok.tgz") as archive:
        archive.extractall(tmp_path / "tok", filter="data")
    proc = subprocess.run([sys.executable, bench, "--small", "--tokenizers", str(tmp_path / "tok"), "--families", "0.2",
                           "--profile", "2", "--peaks", "8x32", "--recovery", "2x32", "--recovery-steps", "1,3",
                           "--trial-layouts", "free,align64", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    (shape,) = data["shapes"].values()
    assert data["machine"]["device"] == "cpu" and shape["params"] > 0
    prefix, hflm = shape["evaluation"]["prefix"], shape["evaluation"]["hflm"]
    assert prefix["items"] == hflm["items"] == 7 * 3  # the seven real tasks at the small mode's 3 items
    assert prefix["acc_mean"] == pytest.approx(hflm["acc_mean"], abs=1e-9)  # the same answers
    assert 0 < prefix["tokens"] < hflm["tokens"]  # each context forwarded once
    for e in (prefix, hflm):
        assert e["tokens_per_s"] == pytest.approx(e["tokens"] / e["seconds"])
        assert e["tflops"] == pytest.approx(2 * shape["params"] * e["tokens"] / e["seconds"] / 1e12)
    assert prefix["requests_built"] == 7 and 0 < prefix["requests_s"] < prefix["seconds"]  # the first pass builds
    trial, aligned = shape["trials"]  # issue 83: the same trial in the layout aligned to 64, its prefill ratio kept
    assert (trial["layout"], aligned["layout"]) == ("free", "align64")
    assert aligned["prefill_speedup"] > 0 and abs(aligned["pruning_ratio"] - 0.2) < 0.1
    assert trial["requests_built"] == 0 and trial["requests_s"] < stages_of(trial)  # and the trial reads them
    stages = trial["stages_s"]
    assert {"load", "importance", "prune", "speed", "ppl", "zero_shot_3"} <= set(stages)
    assert sum(stages.values()) <= trial["wall_s"] and trial["acc_mean"] is not None and trial["ppl"] > 1
    assert "| tiny-llama-shape |" in proc.stdout  # the Markdown tables
    rows = shape["families"]
    assert [r["family"] for r in rows] == ["unpruned", "depth", "width", "width", "mixed", "mixed", "unpruned (again)"]
    for r in rows[1:-1]:  # every shape near the target, each speedup with its standard error, recomputed
        assert abs(r["pruning_ratio"] - 0.2) < 0.05
        for speedup, rate in (("prefill_speedup", "prefill_tokens_per_s"), ("decode_speedup", "decode_tokens_per_s"),
                              ("decode_batch_speedup", "decode_batch_tokens_per_s")):
            assert r[speedup] == pytest.approx(r["speed"][rate] / rows[0]["speed"][rate])
            assert r[f"{speedup}_se"] is not None and r[f"{speedup}_se"] >= 0
    depth, free, uniform, quarter, half = rows[1:-1]
    assert depth["layers_removed"] > half["layers_removed"] > quarter["layers_removed"] > 0 == free["layers_removed"]
    assert not free["uniform"] and uniform["uniform"]
    assert "decode speedup b2" in proc.stdout
    prof = shape["profiles"]["prefix"]  # the profiler's accounting, consistent with itself on a CPU (no device kernels)
    assert prof["items"] == 7 * 2 and 0 < prof["tokens_unpadded"] <= prof["tokens_forwarded"] and prof["forwards"] >= 1
    assert prof["device_busy_s"] == 0 and prof["host_prepare_s"] + prof["host_forward_s"] < prof["profiled_seconds"]
    assert "where the prefix pass's time goes" in proc.stdout
    (peak,) = data["peaks"]
    assert peak["params"] == shape["params"] and (peak["samples"], peak["seq_len"]) == (8, 32) and peak["seconds"] > 0
    (recovery,) = data["recovery"]  # kd's step time from two runs' difference, the student cut 20%
    short, long = recovery["runs"]
    assert (short["steps"], long["steps"]) == (1, 3) and abs(recovery["pruning_ratio"] - 0.2) < 0.05
    assert recovery["step_s"] == pytest.approx((long["seconds"] - short["seconds"]) / 2)
    assert all(r["train_loss_first"] > 0 for r in (short, long))  # the student differs from its teacher: kd > 0
    assert "| tiny-llama-shape | kd, 2 x 32 |" in proc.stdout
