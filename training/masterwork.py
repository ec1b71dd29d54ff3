"""The master's other work (every layer that is not a convolution) in a step, as the
prediction counts it: alone, and beside the executor's nodes, which run some of it."""

from __future__ import annotations

from hetconv.model import ConvStage, HeadStage, Model
from hetconv.replica import REPLICATED
from hetconv.stages import FUSED


def stage_chains(model: Model) -> dict[str, list[str]]:
    """Convolution name -> the layers after it that the master does not run between the
    executor's calls: a fused stage's (the last stage's too, a
    :class:`~hetconv.model.HeadStage`, and its fc where the head is split), which every node
    runs on its own kernels' channels inside the calls, and a replicated block's
    (:mod:`hetconv.replica`), which the master runs inside the next layer's calls beside the
    workers' copies."""
    chains: dict[str, list[str]] = {}
    for block in model.blocks:
        stage = block.stage if isinstance(block, HeadStage) else block
        if not isinstance(stage, ConvStage):
            continue
        names = []
        if model.executor.stage_mode(stage.name) in (FUSED, REPLICATED):
            names = [layer.name for layer in stage.chain]
        if isinstance(block, HeadStage) and model.executor.head_split(stage.name):
            names.append(block.fc.name)
        if names:
            chains[stage.name] = names
    return chains


def other_work(model: Model, batch: int) -> tuple[float, float, dict[str, float]]:
    """Seconds a step of ``batch`` images of the master's other work
    (:meth:`~hetconv.model.Model.other_seconds`, timed here once): (alone; between the
    executor's calls; convolution name -> its :func:`stage_chains` layers, inside them)."""
    seconds, named = model.other_seconds(batch), stage_chains(model)
    chains = {conv: sum(seconds[name] for name in names) for conv, names in named.items()}
    inside = {name for names in named.values() for name in names}
    between = sum(t for name, t in seconds.items() if name not in inside)
    return sum(seconds.values()), between, chains


__all__ = ["other_work", "stage_chains"]
