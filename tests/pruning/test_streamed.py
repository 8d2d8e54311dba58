"""Issue 92, build 1 (its first step): the gradient pass taken layer-major (`pruning.streamed`) gives today's
importance to float rounding: every group score, every layer's gradient mean and norm, at every snapshot, for every
family's tiny model (the fast tier meets four, `make test` all nine), micro-batches that do not divide the
snapshots included. Its head alone gives the model's own loss, whatever the family does after its last layer."""

import numpy as np
import pytest
import torch

from taylor_tune.pruning.groups import describe_layout
from taylor_tune.pruning.importance import compute_importance
from taylor_tune.pruning.streamed import compute_importance_streamed, head_loss, spans
from taylor_tune.sources.models import load_model_config
from taylor_tune.sources.streaming import Checkpoint
from tests.helpers import ARCHS, FAST_ARCHS, calibration_ids, tiny


def same_importance(ours: dict, streamed: dict, counts) -> None:
    """Every group score and layer statistic of each snapshot equal to 1e-6 relative (a score near zero: to 1e-6 of
    its layer's largest)."""
    for n in counts:
        a, b = ours[n], streamed[n]
        for x, y in zip((*a.scores.attn, *a.scores.mlp), (*b.scores.attn, *b.scores.mlp), strict=True):
            np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6 * float(np.abs(x).max()))
        np.testing.assert_allclose(b.grad_mean, a.grad_mean, rtol=1e-6)
        np.testing.assert_allclose(b.grad_norm, a.grad_norm, rtol=1e-6)


FAMILIES = [pytest.param(a, marks=() if a in FAST_ARCHS else pytest.mark.slow) for a in ARCHS]


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_head_gives_the_models_own_loss(arch):
    model = tiny(arch)
    ids = calibration_ids(3, 24) % model.config.vocab_size
    with torch.no_grad():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        own = model(input_ids=ids, labels=ids, use_cache=False).loss
        # the base model's output is normed already: take the last layer's output, as the streamed pass does
        last = {}
        handle = model.model.layers[-1].register_forward_hook(lambda m, a, out: last.update(h=out[0] if isinstance(
            out, tuple) else out))
        model.model(input_ids=ids, use_cache=False)
        handle.remove()
    assert hidden.shape == last["h"].shape
    torch.testing.assert_close(head_loss(model, last["h"], ids), own, rtol=1e-6, atol=0)


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_layer_major_pass_gives_the_in_memory_importance(arch):
    model = tiny(arch)
    ids = calibration_ids(10, 24) % model.config.vocab_size
    layout = describe_layout(model)
    snapshots = [3, 7, 10]  # micro-batches of 4: spans (0,3) (3,7) (7,10) as the in-memory pass splits them
    ours = compute_importance(model, layout, ids, micro_batch_size=4, snapshots=snapshots)
    streamed = compute_importance_streamed(model, layout, ids, micro_batch_size=4, snapshots=snapshots)
    assert sorted(streamed) == snapshots
    same_importance(ours, streamed, snapshots)
    first, last = streamed[3].scores.mlp[0], streamed[10].scores.mlp[0]
    assert not np.allclose(first, last)  # the snapshots differ: each is taken at its own count
    assert all(p.requires_grad for p in model.parameters()) and not model.training  # restored as loaded


def test_the_spans_are_the_in_memory_passes_micro_batches():
    assert spans(10, [3, 7, 10], 4) == [(0, 3), (3, 7), (7, 10)]
    assert spans(9, [9], 4) == [(0, 4), (4, 8), (8, 9)]
    assert spans(8, [2, 8], 3) == [(0, 2), (2, 5), (5, 8)]


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_pass_over_a_checkpoint_read_layer_by_layer_gives_the_in_memory_importance(arch, tmp_path):
    model = tiny(arch)
    model.save_pretrained(tmp_path / "model")
    ids = calibration_ids(9, 24) % model.config.vocab_size
    layout = describe_layout(model)
    stream = Checkpoint(tmp_path / "model", load_model_config(str(tmp_path / "model")), device="cpu",
                        dtype=torch.float32)
    assert all(p.is_meta for layer in stream.model.model.layers for p in layer.parameters())  # nothing loaded yet
    ours = compute_importance(model, layout, ids, micro_batch_size=4, snapshots=[5, 9])
    streamed = compute_importance_streamed(stream, layout, ids, micro_batch_size=4, snapshots=[5, 9],
                                           scratch=tmp_path / "scratch")
    same_importance(ours, streamed, (5, 9))
    assert all(p.is_meta for layer in stream.model.model.layers for p in layer.parameters())  # each one released
    assert not any((tmp_path / "scratch").iterdir())  # the pass took back all it kept


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-0.5b"])
def test_a_real_model_streamed_from_its_folder_gives_the_in_memory_importance(name):
    from taylor_tune.sources.models import load_model, stream_model

    model = load_model(name, dtype=torch.float32)
    layout = describe_layout(model)
    ids = calibration_ids(6, 32) % model.config.vocab_size
    ours = compute_importance(model, layout, ids, micro_batch_size=4, snapshots=[2, 6])
    del model
    streamed = compute_importance_streamed(stream_model(name), layout, ids, micro_batch_size=4, snapshots=[2, 6])
    same_importance(ours, streamed, (2, 6))
