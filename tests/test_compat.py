"""The private names of pinned dependencies that taylor_tune/compat/ fences: present now, and a loud error if not."""

import pytest

from taylor_tune.compat import CompatError
from taylor_tune.models import load_model, load_tokenizer
from taylor_tune.scorer import make_lm


def test_the_pinned_versions_have_every_fenced_name():
    from taylor_tune.compat import lm_eval, ray

    lm_eval.check(make_lm(load_model("tiny-llama"), load_tokenizer("tiny-llama"), 4, "hflm"))
    ray.check()


@pytest.mark.parametrize("target, name", [
    ("lm_eval.models.huggingface.HFLM", "_loglikelihood_tokens"),
    ("lm_eval.tasks.TaskManager", "_entry"),
    ("lm_eval.tasks._yaml_loader", "load_yaml"),
])
def test_a_missing_lm_eval_name_fails_loudly(monkeypatch, target, name):
    from taylor_tune.compat import lm_eval

    monkeypatch.delattr(f"{target}.{name}")
    with pytest.raises(CompatError, match=rf"lm-eval: .*{name}.* no longer exist.*tested with lm-eval 0\.4\.13"):
        lm_eval.check()


def test_a_missing_hflm_attribute_fails_loudly():
    from taylor_tune.compat import lm_eval

    lm = make_lm(load_model("tiny-llama"), load_tokenizer("tiny-llama"), 4, "prefix")
    del lm.softmax_dtype
    with pytest.raises(CompatError, match=r"HFLM\(\)\.softmax_dtype"):
        lm_eval.check(lm)


def test_a_missing_ray_name_fails_loudly(monkeypatch):
    import inspect

    from taylor_tune.compat import ray

    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: real(obj).replace("self._fs =", "self._filesystem ="))
    with pytest.raises(CompatError, match=r"ray: ExperimentAnalysis\._fs no longer exist.*tested with ray 2\.60"):
        ray.check()
    with pytest.raises(CompatError, match="_experiment_json_fs_path"):
        ray.check(object())
