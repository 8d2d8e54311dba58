"""Issue 92, must-show 2: a model held layer by layer (`sources.streaming.Checkpoint`, its weights read from the
folder's safetensors one layer at a time) is evaluated as the loaded model is: the same log-likelihood for every
request of the seven tasks (to 1e-5) with the same greedy flags and accuracies, and the same perplexity windows,
each window's NLL to 1e-5 relative. The streamed pass goes layer-major over every batch of a call."""

import pytest
import torch
from lm_eval import simple_evaluate

from taylor_tune.evaluation.perplexity import perplexity
from taylor_tune.evaluation.scorer import StreamedPrefixLM, make_lm
from taylor_tune.evaluation.zero_shot import TASK_YAML, task_source
from taylor_tune.sources.data import load_ppl_text
from taylor_tune.sources.models import load_model, load_tokenizer, stream_model


def _requests(lm, limit: int) -> tuple[dict, dict]:
    sources = [task_source(task, "world") for task in TASK_YAML]
    result = simple_evaluate(model=lm, tasks=[s for s, _ in sources], task_manager=sources[0][1], limit=limit,
                             bootstrap_iters=0, log_samples=True, verbosity="ERROR")
    answers = {task: [r[0] for sample in samples for r in sample["resps"]]
               for task, samples in result["samples"].items()}
    return answers, {task: raw.get("acc,none") for task, raw in result["results"].items()}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """tiny-qwen2 (the world's trained model, q/k/v biases) written as a folder of two safetensors shards."""
    out = tmp_path_factory.mktemp("stream") / "tiny-qwen2"
    load_model("tiny-qwen2").save_pretrained(out, max_shard_size="300KB")
    load_tokenizer("tiny-qwen2").save_pretrained(out)
    assert len(list(out.glob("*.safetensors"))) > 1
    return out


def test_zero_shot_of_a_streamed_model_equals_the_loaded_models(folder):
    tokenizer = load_tokenizer(str(folder))
    theirs, their_acc = _requests(make_lm(load_model(str(folder)), tokenizer, 3, "prefix"), limit=8)
    lm = make_lm(stream_model(str(folder)), tokenizer, 3, "prefix")
    assert isinstance(lm, StreamedPrefixLM)
    lm.chunk_tokens = 400  # a few batches a layer-major pass: many passes, each reading every layer again
    ours, our_acc = _requests(lm, limit=8)
    assert sum(len(v) for v in theirs.values()) > 100
    for task in theirs:
        assert len(ours[task]) == len(theirs[task]) > 0, task
        for (ll, greedy), (ref, ref_greedy) in zip(ours[task], theirs[task], strict=True):
            assert abs(ll - ref) <= 1e-5, (task, ll, ref)
            assert greedy == ref_greedy, task
    assert our_acc == their_acc


def test_perplexity_of_a_streamed_model_equals_the_loaded_models(folder):
    tokenizer, text = load_tokenizer(str(folder)), load_ppl_text("world")
    theirs = perplexity(load_model(str(folder)), tokenizer, text, window=64, batch_size=3, max_windows=8)
    ours = perplexity(stream_model(str(folder)), tokenizer, text, window=64, batch_size=3, max_windows=8)
    assert ours["window_ids"] == theirs["window_ids"] and ours["ppl_tokens"] == theirs["ppl_tokens"]
    torch.testing.assert_close(torch.tensor(ours["window_nll"]), torch.tensor(theirs["window_nll"]), rtol=1e-5, atol=0)
    assert ours["ppl"] == pytest.approx(theirs["ppl"], rel=1e-5)


def test_a_streamed_model_is_scored_by_the_prefix_scorer_only(folder):
    with pytest.raises(ValueError, match="prefix scorer"):
        make_lm(stream_model(str(folder)), load_tokenizer(str(folder)), 3, "hflm")
