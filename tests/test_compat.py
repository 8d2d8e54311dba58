"""The private names of pinned dependencies that taylor_tune/compat/ fences: present now, and a loud error if not."""

import json

import pytest

from taylor_tune.compat import CompatError
from taylor_tune.evaluation.scorer import make_lm
from taylor_tune.sources.models import load_model, load_tokenizer


def test_the_pinned_versions_have_every_fenced_name():
    from taylor_tune.compat import lm_eval, pyarrow, ray, transformers

    lm_eval.check(make_lm(load_model("tiny-llama"), load_tokenizer("tiny-llama"), 4, "hflm"))
    pyarrow.check()
    ray.check()
    transformers.check()
    with transformers.no_init_weights():  # the context manager the GGUF conversion builds models in
        pass


@pytest.mark.parametrize("target, name", [
    ("lm_eval.models.huggingface.HFLM", "_loglikelihood_tokens"),
    ("lm_eval.tasks._yaml_loader", "load_yaml"),
    ("lm_eval.evaluator", "add_env_info"),
])
def test_a_missing_lm_eval_name_fails_loudly(monkeypatch, target, name):
    from taylor_tune.compat import lm_eval

    monkeypatch.delattr(f"{target}.{name}")
    with pytest.raises(CompatError, match=rf"lm-eval: .*{name}.* no longer exist.*tested with lm-eval 0\.4\.13"):
        lm_eval.check()


def test_an_s3_filesystem_is_made_again_from_its_options_and_a_changed_reduction_fails_loudly():
    from pyarrow import fs

    from taylor_tune.compat.pyarrow import s3_options

    made = dict(endpoint_override="http://127.0.0.1:9", region="eu-west-3", scheme="http", access_key="k",
                secret_key="s")
    options = s3_options(fs.S3FileSystem(**made))
    assert {k: options[k] for k in made} == made  # what the anonymous client is made with (storage.location)

    class Moved:  # an upgrade that reduces a filesystem to something else
        def __reduce__(self):
            return (object, ("http://127.0.0.1:9",))

    with pytest.raises(CompatError, match=r"pyarrow: S3FileSystem.__reduce__\(\)'s options no longer exist.*26"):
        s3_options(Moved())


def test_a_missing_hflm_attribute_fails_loudly():
    from taylor_tune.compat import lm_eval

    lm = make_lm(load_model("tiny-llama"), load_tokenizer("tiny-llama"), 4, "prefix")
    del lm.softmax_dtype
    with pytest.raises(CompatError, match=r"HFLM\(\)\.softmax_dtype"):
        lm_eval.check(lm)


def test_the_saved_state_is_read_as_json_and_a_changed_layout_fails_loudly(tmp_path):
    from pyarrow import fs

    from taylor_tune.compat import tune_state as ray

    state = {"trial_id": "a_00000", "status": "TERMINATED", "config": {"model": "m"},
             "storage": {"_type": "CLOUDPICKLE_FALLBACK", "value": "00"}}  # stays an opaque dict: never unpickled
    saved = {"trial_data": [[json.dumps(state), json.dumps({"last_result": {"acc_mean": 0.5}})]]}
    (tmp_path / "experiment_state-2026-01-01_00-00-00.json").write_text(json.dumps({"trial_data": []}))
    (tmp_path / "experiment_state-2026-01-02_00-00-00.json").write_text(json.dumps(saved))  # the newest run's
    trials, saved_at = ray.saved_trials(fs.LocalFileSystem(), str(tmp_path))
    assert trials == [{"trial_id": "a_00000", "status": "TERMINATED", "config": {"model": "m"},
                       "last_result": {"acc_mean": 0.5}}]
    assert saved_at is not None
    del state["status"]
    (tmp_path / "experiment_state-2026-01-03_00-00-00.json").write_text(
        json.dumps({"trial_data": [[json.dumps(state), "{}"]]}))
    with pytest.raises(CompatError, match=r"ray: trial state status no longer exist.*tested with ray 2\.60"):
        ray.saved_trials(fs.LocalFileSystem(), str(tmp_path))


def test_a_missing_trial_storage_fails_loudly():
    from types import SimpleNamespace

    from taylor_tune.compat import ray

    storage = SimpleNamespace(trial_working_directory="/w", trial_fs_path="/s", storage_filesystem=None)
    assert ray.trial_storage(SimpleNamespace(get_storage=lambda: storage)) is storage
    with pytest.raises(CompatError, match=r"ray: TuneContext\.get_storage no longer exist"):
        ray.trial_storage(SimpleNamespace())
    with pytest.raises(CompatError, match=r"StorageContext\.trial_fs_path"):
        ray.trial_storage(SimpleNamespace(get_storage=lambda: SimpleNamespace(trial_working_directory="/w")))


def test_a_missing_transformers_name_fails_loudly(monkeypatch):
    import sys
    import types

    from taylor_tune.compat import transformers as fence

    monkeypatch.setitem(sys.modules, "transformers.initialization", types.ModuleType("transformers.initialization"))
    with pytest.raises(CompatError, match=r"transformers: transformers\.initialization\.no_init_weights no longer"):
        fence.no_init_weights()


def test_models_built_in_several_threads_at_once_are_built_one_at_a_time_and_keep_their_tied_heads(
        tmp_path, monkeypatch):
    """transformers' `from_pretrained` swaps `PreTrainedModel.tie_weights` for a no-op on the class while it builds
    (`no_tie_weights`); two threads inside it at once can leave the no-op there for good (the CI failure of
    2026-11-28: a real model loaded later in that process kept its head on the meta device). The window is widened
    here (a pause inside the context): four threads loading a tied model never overlap in it, the class keeps its
    own `tie_weights`, and every head, and a later load's, is the embedding itself."""
    import importlib
    import threading
    import time
    from contextlib import contextmanager

    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

    folder = tmp_path / "tied"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
                     ).save_pretrained(folder)
    initialization = importlib.import_module("transformers.initialization")
    original, plain = PreTrainedModel.tie_weights, initialization.no_tie_weights
    inside, most, count = [0], [0], threading.Lock()

    @contextmanager
    def slow_no_tie_weights():
        with plain():
            with count:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.05)
            yield
            with count:
                inside[0] -= 1

    monkeypatch.setattr(initialization, "no_tie_weights", slow_no_tie_weights)
    models = []
    threads = [threading.Thread(target=lambda: models.append(load_model(str(folder)))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    monkeypatch.undo()
    later = load_model(str(folder))
    assert most[0] == 1 and len(models) == 4
    assert PreTrainedModel.tie_weights is original
    assert all(m.lm_head.weight is m.model.embed_tokens.weight for m in [*models, later])
