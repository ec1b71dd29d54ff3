"""The master's non-convolutional time of any network, measured on the spot.

The simulator needs, besides the convolutions it models, the master's other work of a step
("comp": ReLU, LRN, pooling, batch norm, the fully connected layers, the loss and the SGD
update). For the presets and the shipped networks it is a table measured on this project's
machine (:data:`~.scenario.DEFAULT_COMP_MS_PER_IMAGE`, a scenario's ``[comp]``), the way a
user measures it: ``hetconv train --local --trace``, ``comp_seconds`` over the batch. For a
network without a figure (a ``.json`` spec, an ``.onnx`` graph) :func:`measure_comp` does the
same here and now: a few local training steps on random images, each step's wall time less
its convolutions' (what :class:`~hetconv.conv.LocalConv` times), per image.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Images per measured step: the batch the presets' figures were measured at.
MEASURE_BATCH = 16
#: Steps timed after one untimed warm-up step (allocations, caches); the fastest counts, as
#: other work on the machine only ever adds time.
MEASURE_STEPS = 3


@dataclass(frozen=True)
class CompMeasurement:
    """What :func:`measure_comp` measured of one network on this machine."""

    network: str
    per_image_s: float  # the fastest step's non-convolutional seconds / batch
    conv_per_image_s: float  # the same step's convolution seconds / batch (for scaling)
    batch: int
    steps: int
    input_shape: tuple[int, int, int]

    def describe(self) -> str:
        return (
            f"measured here just now: the fastest of {self.steps} local steps at batch "
            f"{self.batch} on {'x'.join(map(str, self.input_shape))} random images, "
            f"{1e3 * self.per_image_s:.2f} ms/image"
        )


def measure_comp(
    network: str,
    batch: int = MEASURE_BATCH,
    steps: int = MEASURE_STEPS,
    input_shape: tuple[int, int, int] | None = None,
) -> CompMeasurement:
    """Time ``steps`` local training steps of ``network`` (as ``--model`` names it) at
    ``batch`` random images of ``input_shape`` (C, H, W; default: a graph's own, else CIFAR's
    3x32x32) after one warm-up step; the non-convolutional seconds per image of the fastest
    step.

    Raises:
        ValueError: a network :func:`~hetconv.onnx_import.load_network` refuses, or shapes
            that do not fit it.
    """
    stamp = _stamp(network)
    shape = tuple(input_shape) if input_shape is not None else None
    return _measure(network, stamp, batch, steps, shape)


def _stamp(network: str) -> float | None:
    """A file's modification time (a changed spec is measured again); None for a preset."""
    try:
        return Path(network).stat().st_mtime
    except OSError:
        return None


@functools.lru_cache(maxsize=64)
def _measure(
    network: str, stamp: float | None, batch: int, steps: int, shape: tuple | None
) -> CompMeasurement:
    from hetconv.conv import LocalConv
    from hetconv.layers import softmax_cross_entropy
    from hetconv.model import Model
    from hetconv.onnx_import import load_network
    from hetconv.optim import SGD
    from hetconv.spec import CIFAR_INPUT

    named = load_network(network)
    shape = tuple(shape or named.input_shape or CIFAR_INPUT)
    executor = LocalConv()
    model = Model(named.spec, input_shape=shape, seed=0, executor=executor)
    classes = int(np.prod(model.output_shape))
    optimizer = SGD(model.parameters())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *shape), dtype=np.float32)
    labels = rng.integers(0, classes, batch)
    comp, conv = [], []
    for step in range(steps + 1):
        executor.begin_step(step)
        start = time.perf_counter()
        _, grad, _ = softmax_cross_entropy(model.forward(x, step=step), labels)
        model.backward(grad)
        optimizer.step(model.gradients())
        seconds = time.perf_counter() - start
        conv_s = executor.end_step()["conv_seconds"]
        if step:  # the first is a warm-up
            comp.append(max(seconds - conv_s, 0.0))
            conv.append(conv_s)
    fastest = min(range(steps), key=lambda i: comp[i] + conv[i])
    return CompMeasurement(
        network, comp[fastest] / batch, conv[fastest] / batch, batch, steps, shape
    )


def with_measured_comp(scenario, networks: Sequence[str], log=None, input_shape=None):
    """``scenario`` with a ``[comp]`` figure measured here (:func:`measure_comp`) for each of
    ``networks`` it has none for (neither its own ``[comp]`` nor the table measured for the
    presets), unchanged where it has them all; ``log`` (a text stream) is told what is being
    measured, which takes a few seconds per network. With ``input_shape`` (C, H, W) every
    network is measured at it: the figures at hand are for the networks' own shapes."""
    from .scenario import DEFAULT_COMP_MS_PER_IMAGE, CompFigure

    missing = [
        n for n in dict.fromkeys(networks) if input_shape is not None
        or (n not in scenario.comp and n not in DEFAULT_COMP_MS_PER_IMAGE)
    ]  # fmt: skip
    if not missing:
        return scenario
    comp = dict(scenario.comp)
    for network in missing:
        if log is not None:
            print(f"measuring {network}'s non-convolutional time here ...", file=log, flush=True)
        got = measure_comp(network, input_shape=input_shape)
        comp[network] = CompFigure(per_image_s=got.per_image_s, how=got.describe())
    return dataclasses.replace(scenario, comp=comp)


__all__ = [
    "MEASURE_BATCH",
    "MEASURE_STEPS",
    "CompMeasurement",
    "measure_comp",
    "with_measured_comp",
]
