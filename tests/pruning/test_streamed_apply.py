"""Issue 92, must-show 1 (the pruned folder): a plan applied to a model held layer by layer
(`apply.save_pruned_streamed`, one decoder layer loaded at a time, one shard per layer) writes the folder that
`save_pruned(apply_plan(model, plan))` writes: the same tensors bit for bit under the same names, the same config.json
and manifest; the folder loads and gives the in-memory pruned model's logits exactly. For every family's tiny model,
width cuts of different sizes per layer (a pruned folder), uniform cuts (a stock folder: Phi-3's projections fused
again) and whole layers removed."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from taylor_tune.pruning.apply import apply_plan, save_pruned, save_pruned_streamed
from taylor_tune.pruning.groups import describe_layout
from taylor_tune.pruning.plan import PrunePlan
from taylor_tune.sources.models import load_model, load_model_config, stream_model
from taylor_tune.sources.streaming import Checkpoint, final_hidden, head_logits
from tests.helpers import ARCHS, FAST_ARCHS, tiny


def tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out |= load_file(file)
    return out


def _plan(layout, kind: str) -> PrunePlan:
    rng = np.random.default_rng(0)
    layers = layout.num_layers
    if kind == "ragged":  # a different cut in every layer
        attn = tuple(tuple(sorted(rng.choice(g, size=i % 2 + 1, replace=False).tolist()))
                     for i, g in enumerate(layout.attn_groups))
        mlp = tuple(tuple(sorted(rng.choice(c, size=8 * (i + 1), replace=False).tolist()))
                    for i, c in enumerate(layout.mlp_channels))
        return PrunePlan("test", attn, mlp)
    if kind == "uniform":
        return PrunePlan("test", ((1,),) * layers, (tuple(range(0, 32, 2)),) * layers)
    return PrunePlan("test", ((0,),) + ((),) * (layers - 1), ((),) * layers, layers_removed=(1, 2))


KINDS = ["ragged", "uniform", "depth"]
CASES = [pytest.param(a, k, marks=() if a in FAST_ARCHS and k == KINDS[i % 3] else pytest.mark.slow)
         for i, a in enumerate(ARCHS) for k in KINDS]


@pytest.mark.parametrize("arch, kind", CASES)
def test_the_streamed_pruned_folder_is_the_in_memory_ones(arch, kind, tmp_path):
    model = tiny(arch)
    model.save_pretrained(tmp_path / "source")
    layers = describe_layout(model).num_layers
    plan = _plan(describe_layout(model), kind)
    save_pruned(apply_plan(model, plan), tmp_path / "memory", source_model="src")
    stream = Checkpoint(tmp_path / "source", load_model_config(str(tmp_path / "source")), device="cpu",
                        dtype=torch.float32)
    save_pruned_streamed(stream, plan, tmp_path / "streamed", source_model="src")
    ours, theirs = tensors(tmp_path / "streamed"), tensors(tmp_path / "memory")
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
    for file in ("config.json", "pruned_layout.json"):
        assert json.loads((tmp_path / "streamed" / file).read_text()) == json.loads(
            (tmp_path / "memory" / file).read_text()), file
    assert len(list((tmp_path / "streamed").glob("*.safetensors"))) == layers + 1 - (
        2 if kind == "depth" else 0)  # the head's shard, then one per kept layer
    assert all(p.is_meta for layer in stream.model.model.layers for p in layer.parameters())  # each released
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        expected = load_model(str(tmp_path / "memory"))(input_ids=ids).logits
        assert torch.equal(load_model(str(tmp_path / "streamed"))(input_ids=ids).logits, expected)
        # and the pruned folder held layer by layer in turn (what a streamed trial evaluates)
        pruned = stream_model(str(tmp_path / "streamed"))
        hidden = next(final_hidden(pruned, [{"input_ids": ids}]))
        torch.testing.assert_close(head_logits(pruned.model, hidden), expected, rtol=1e-6, atol=1e-6)
