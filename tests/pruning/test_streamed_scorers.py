"""Issue 92, must-show 1 (the forward-only scorers): the activation statistics (wanda_sp, flap), the layer similarity
(depth's block influence and angular distance) and the weight magnitudes of a model held layer by layer
(`sources.streaming.Checkpoint`, weights read from its folder) equal the loaded model's, for every family's tiny
model: the statistics at every snapshot and the scores they give to 1e-6 relative, the similarity's cosines and
last-token states likewise."""

import numpy as np
import pytest
import torch

from taylor_tune.pruning.activations import activation_scores, activation_stats
from taylor_tune.pruning.groups import describe_layout
from taylor_tune.pruning.importance import magnitude_scores
from taylor_tune.pruning.similarity import layer_similarity
from taylor_tune.sources.models import load_model_config
from taylor_tune.sources.streaming import Checkpoint
from tests.helpers import ARCHS, FAST_ARCHS, calibration_ids, tiny

FAMILIES = [pytest.param(a, marks=() if a in FAST_ARCHS else pytest.mark.slow) for a in ARCHS]


def close(a, b) -> None:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6 * float(np.abs(a).max()))


def scores_close(ours, theirs) -> None:
    for x, y in zip((*theirs.attn, *theirs.mlp), (*ours.attn, *ours.mlp), strict=True):
        close(x, y)


@pytest.fixture
def held(tmp_path, request):
    model = tiny(request.param)
    model.save_pretrained(tmp_path / "model")
    stream = Checkpoint(tmp_path / "model", load_model_config(str(tmp_path / "model")), device="cpu",
                        dtype=torch.float32)
    return model, stream


@pytest.mark.parametrize("held", FAMILIES, indirect=True)
def test_streamed_activation_statistics_and_scores_equal_the_loaded_models(held):
    model, stream = held
    ids = calibration_ids(10, 24) % model.config.vocab_size
    layout = describe_layout(model)
    theirs = activation_stats(model, ids, 4, snapshots=[3, 7, 10])
    ours = activation_stats(stream, ids, 4, snapshots=[3, 7, 10])
    assert sorted(ours) == [3, 7, 10]
    for n in (3, 7, 10):
        for a, b in zip((*theirs[n].attn, *theirs[n].mlp), (*ours[n].attn, *ours[n].mlp), strict=True):
            assert a.tokens == b.tokens == n * 24
            close(a.mean, b.mean)
            close(a.m2, b.m2)
        for criterion in ("wanda_sp", "flap"):
            scores_close(activation_scores(stream, layout, ours[n], criterion),
                         activation_scores(model, layout, theirs[n], criterion))
    assert not np.allclose(ours[3].mlp[0].m2, ours[10].mlp[0].m2)  # each snapshot taken at its own count


@pytest.mark.parametrize("held", FAMILIES, indirect=True)
def test_streamed_layer_similarity_and_magnitudes_equal_the_loaded_models(held):
    model, stream = held
    ids = calibration_ids(7, 24) % model.config.vocab_size
    theirs, ours = layer_similarity(model, ids, 3), layer_similarity(stream, ids, 3)
    close(theirs.cosine, ours.cosine)
    close(theirs.last_token, ours.last_token)
    layout = describe_layout(model)
    for p in (1, 2):
        scores_close(magnitude_scores(stream, layout, p), magnitude_scores(model, layout, p))
    assert all(q.is_meta for layer in stream.model.model.layers for q in layer.parameters())  # each released
