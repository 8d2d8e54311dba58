"""bench/bench_gpu.py's CPU mode: the GPU benchmark's whole path (a shape built from its config and saved, a trial as
a sweep runs it, the evaluation with both scorers, the speed of depth, width and mixed cuts) on a tiny shape, and its
numbers consistent with each other."""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


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
                           "--json", str(out)],
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
    (trial,) = shape["trials"]
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
