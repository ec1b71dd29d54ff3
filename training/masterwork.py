"""The master's other work (every layer that is not a convolution) in a step, as the
prediction counts it: alone, and beside the executor's nodes, which run some of it."""

from __future__ import annotations

from hetconv.model import ConvStage, HeadStage, Model
from hetconv.replica import REPLICATED
from hetconv.stages import FUSED


def layers_on_nodes(model: Model) -> set[str]:
    """Names of the layers ``model``'s executor runs on its nodes rather than on the master: a
    fused stage's chain (of a :class:`~hetconv.model.HeadStage` too) and a split head's fc."""
    names: set[str] = set()
    for block in model.blocks:
        stage = block.stage if isinstance(block, HeadStage) else block
        if not isinstance(stage, ConvStage):
            continue
        if model.executor.stage_mode(stage.name) == FUSED:
            names.update(layer.name for layer in stage.chain)
        if isinstance(block, HeadStage) and model.executor.head_split(stage.name):
            names.add(block.fc.name)
    return names


def replicated_chain(model: Model) -> set[str]:
    """Names of the layers after the convolution of a block the executor replicates
    (:mod:`hetconv.replica`): the master runs them inside the next layer's calls, beside the
    workers' copies, not between calls."""
    return {
        layer.name
        for block in model.blocks
        if isinstance(block, ConvStage) and model.executor.stage_mode(block.name) == REPLICATED
        for layer in block.chain
    }


def other_work(model: Model, batch: int) -> tuple[float, float, float]:
    """Seconds a step of ``batch`` images of the master's other work
    (:meth:`~hetconv.model.Model.other_seconds`, timed here once): (alone; beside the nodes,
    between the executor's calls; a replicated block's layers, inside them)."""
    seconds = model.other_seconds(batch)
    on_nodes, block = layers_on_nodes(model), replicated_chain(model)
    between = sum(t for name, t in seconds.items() if name not in on_nodes | block)
    inside = sum(t for name, t in seconds.items() if name in block)
    return sum(seconds.values()), between, inside


__all__ = ["layers_on_nodes", "other_work", "replicated_chain"]
