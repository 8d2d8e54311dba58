"""The scoring forward with each decoder layer compiled (`torch.compile`): its elementwise work fused.

Eager transformers runs a decoder layer's norms, rotary embedding, activation and residual adds as one kernel per
operation; on a GPU those kernels are a third of the scoring's device time (BENCHMARKS, "On the GPU, second lease").
Compiled, they fuse into a few kernels around the same matrix products and attention.

One compiled function serves every layer (regional compilation): the layers share their forward's code and are
passed in as arguments, so the graph is traced and compiled once per model class, not per layer. Its shapes are
dynamic, the parameters' included, so that every batch shape of the prefix scorer and every layer width of a pruned
model (the free layout's ragged widths) reuse that one graph instead of compiling again. Inductor keeps its compiled
kernels on disk: a later trial's process traces the graph again (seconds) but does not compile it again.

The layers are compiled only for the duration of `compiled_layers`: their forward is shadowed by an instance
attribute and given back afterwards, so pruning, speed measurement and recovery see the eager model. A compilation
that fails (no compiler for the device, an operation Dynamo cannot trace) falls back to the eager layer with a
warning, not an error: the scores are the same either way.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Compiled:
    """What one `compiled_layers` block compiled: `graphs` traced by Dynamo in it (0: every layer's graph was
    already compiled in this process; 1: one shared graph, as designed; more: recompilations)."""

    layers: int
    graphs: int = 0


def _known(config, **settings) -> dict:
    """The settings `config` has: a torch without one compiles more graphs (Compiled.graphs says), not wrong ones."""
    return {name: value for name, value in settings.items() if hasattr(config, name)}


def decoder_layers(model) -> list:
    """The model's decoder layers (Llama, Qwen2 and Mistral keep them at model.model.layers)."""
    return list(model.model.layers)


@contextmanager
def compiled_layers(model) -> Iterator[Compiled]:
    """Inside, each decoder layer of `model` runs compiled (see the module's docstring)."""
    from torch._dynamo import config
    from torch._dynamo.utils import counters
    from torch.fx.experimental import _config as shapes

    layers = decoder_layers(model)
    functions: dict[type, object] = {}
    for layer in layers:
        compiled = functions.setdefault(type(layer), torch.compile(type(layer).forward, dynamic=True))
        layer.forward = functools.partial(compiled, layer)  # shadows the class's forward for this instance only
    before = counters["stats"]["unique_graphs"]
    out = Compiled(len(layers))
    try:
        # parameters' shapes symbolic too, and two sizes that happen to be equal (a layer's width and the hidden
        # size) not tied: one graph for layers of different widths; an error falls back to eager
        with (config.patch(**_known(config, force_parameter_static_shapes=False, suppress_errors=True,
                                    force_nn_module_property_static_shapes=False)),
              shapes.patch(**_known(shapes, use_duck_shape=False))):
            yield out
    finally:
        for layer in layers:
            del layer.forward
        out.graphs = counters["stats"]["unique_graphs"] - before
