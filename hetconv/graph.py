"""Layers as a graph: the layer contract, which layer reads which, and the passes over it.

A model's layers are kept in their spec's order, which is a topological order: each layer
reads the outputs of earlier layers (its ``inputs``, by default the one before it; the first
layer reads the network's input), and the last layer's output is the network's output. The
gradient of a tensor that feeds several layers is the sum of what each of them gives back,
added in a fixed order (the later consumer's first), so that a step's results are the same
every time.

:class:`LayerGraph` says who reads whom and finds the chains along which layers may run as one
step (a layer followed by its only consumer, which reads nothing else): a convolution's fused
stage and a run of image-local layers in chunks. :func:`graph_forward` and
:func:`graph_backward` run the steps (layers, or such chains run as one) in order.

The layers that join branches are here too: :class:`Add` (the elementwise sum of its inputs)
and :class:`Concat` (its inputs along channels), each reading two tensors or more; both
compute in the array module of their inputs (numpy, or cupy on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .backends.arrays import array_module

#: What a layer's ``inputs`` index means when it reads the network's input.
NETWORK_INPUT = -1


class Layer:
    """Base class: a named step of the network with optional parameters.

    A layer reads ``arity`` tensors (one for most types): ``forward`` takes them
    in its ``inputs`` order and returns its output; ``backward`` takes the output's gradient
    and returns the input's (None where nothing needs it), or for a layer of several inputs
    a tuple of one gradient per input.
    """

    #: How many tensors the layer reads.
    arity = 1

    def __init__(self, name: str):
        self.name = name
        self.params: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}
        self.buffers: dict[str, np.ndarray] = {}
        self.training = True
        self.input_shape: tuple[int, ...] | None = None  # per sample, set by the model
        self.input_shapes: tuple[tuple[int, ...], ...] = ()  # each input's, set by the model

    def forward(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def backward(self, dy: np.ndarray) -> np.ndarray | None:
        raise NotImplementedError

    def grads_ready(self) -> None:
        """Called where :attr:`grads` are set after :meth:`backward` returned (a kernel
        gradient left for later: :mod:`hetconv.imagesplit`); a hook may set its own."""

    def output_shape(self, input_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Per-sample output shape (no batch axis) for a per-sample input shape."""
        return input_shape

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


@dataclass(frozen=True)
class LayerGraph:
    """Who reads whom, by position in the spec.

    Attributes:
        names: each layer's name, in the spec's order.
        inputs: per layer, the positions of the layers it reads, in order
            (:data:`NETWORK_INPUT` for the network's input). Each is below the layer's own.
    """

    names: tuple[str, ...]
    inputs: tuple[tuple[int, ...], ...]

    @property
    def consumers(self) -> tuple[tuple[int, ...], ...]:
        """Per layer, the positions of the layers that read its output, in order."""
        out: list[list[int]] = [[] for _ in self.names]
        for j, sources in enumerate(self.inputs):
            for i in sources:
                if i != NETWORK_INPUT and j not in out[i]:
                    out[i].append(j)
        return tuple(tuple(c) for c in out)

    def follower(self, i: int) -> int | None:
        """The layer that continues a chain after layer ``i``: its only consumer, when that
        reads layer ``i`` alone; None otherwise (several consumers, none, or one that reads
        other tensors too)."""
        consumers = self.consumers[i]
        if len(consumers) != 1 or self.inputs[consumers[0]] != (i,):
            return None
        return consumers[0]

    def chain(self, start: int, accept: Callable[[int], bool]) -> list[int]:
        """The layers after ``start`` that form a chain with it (each the :meth:`follower` of
        the one before) while ``accept`` takes them, in order."""
        out, i = [], start
        while (j := self.follower(i)) is not None and accept(j):
            out.append(j)
            i = j
        return out

    def step_inputs(self, groups: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """For steps that each run a chain of layers (``groups``: positions, in chain order,
        every layer in exactly one, the steps in a topological order), what each step reads:
        the steps whose last layer its first layer reads (:data:`NETWORK_INPUT` for the
        network's input)."""
        step_of = {group[-1]: s for s, group in enumerate(groups)}
        return [
            tuple(i if i == NETWORK_INPUT else step_of[i] for i in self.inputs[group[0]])
            for group in groups
        ]


def _last_uses(inputs: Sequence[tuple[int, ...]]) -> dict[int, int]:
    """Step -> the last step that reads its output."""
    last: dict[int, int] = {}
    for s, sources in enumerate(inputs):
        for i in sources:
            last[i] = s
    return last


def graph_forward(steps: Sequence, inputs: Sequence[tuple[int, ...]], x: np.ndarray):
    """The last step's output, running ``steps`` in order, each on the outputs of the steps
    ``inputs`` names (:data:`NETWORK_INPUT`: ``x``). A step's output is let go once its last
    reader has run, as a sequential pass lets go of each output."""
    last = _last_uses(inputs)
    values: dict[int, np.ndarray] = {NETWORK_INPUT: x}
    y = x
    for s, (step, sources) in enumerate(zip(steps, inputs, strict=True)):
        y = step.forward(*(values[i] for i in sources))
        for i in sources:
            if last.get(i) == s:
                values.pop(i, None)
        values[s] = y
    return y


def graph_backward(
    steps: Sequence,
    inputs: Sequence[tuple[int, ...]],
    grad: np.ndarray | None,
    pending: Callable[[object], bool] = lambda step: False,
) -> np.ndarray | None:
    """Back-propagate ``grad``, the last step's output gradient, through ``steps`` in reverse
    order; returns the network input's gradient (None where no step gives one).

    A step whose output got no gradient (its readers gave back None) is skipped unless
    ``pending(step)`` says its backward still has to run. Where a tensor feeds several steps
    their gradients are summed, the later step's first.
    """
    grads: dict[int, np.ndarray | None] = {len(steps) - 1: grad}
    for s in reversed(range(len(steps))):
        step, dy = steps[s], grads.pop(s, None)
        if dy is None and not pending(step):
            continue
        out = step.backward(dy)
        parts = out if step.arity > 1 else (out,)
        for i, g in zip(inputs[s], parts, strict=True):
            if g is None:
                continue
            grads[i] = g if grads.get(i) is None else grads[i] + g
    return grads.get(NETWORK_INPUT)


class Add(Layer):
    """The elementwise sum of ``arity`` inputs of one shape (a residual connection), summed
    in their order; its backward gives each input the output's gradient."""

    def __init__(self, name: str, arity: int = 2):
        super().__init__(name)
        self.arity = int(arity)

    def forward(self, *xs: np.ndarray) -> np.ndarray:
        shapes = [x.shape for x in xs]
        if len(xs) != self.arity or len(set(shapes)) != 1:
            raise ValueError(
                f"{self.name}: add takes {self.arity} inputs of one shape, got {shapes}"
            )
        y = xs[0] + xs[1]
        for x in xs[2:]:
            y += x
        return y

    def backward(self, dy: np.ndarray) -> tuple[np.ndarray, ...]:
        return (dy,) * self.arity


class Concat(Layer):
    """``arity`` inputs (N, C_i, H, W) joined along channels, in their order; its backward
    gives each input its channels of the output's gradient."""

    def __init__(self, name: str, arity: int = 2):
        super().__init__(name)
        self.arity = int(arity)
        self._channels: list[int] = []

    def forward(self, *xs: np.ndarray) -> np.ndarray:
        shapes = [x.shape for x in xs]
        rest = [(s[0], *s[2:]) for s in shapes]
        if len(xs) != self.arity or any(len(s) != 4 for s in shapes) or len(set(rest)) != 1:
            raise ValueError(
                f"{self.name}: concat takes {self.arity} inputs (N, C, H, W) of one N, H and W, "
                f"got {shapes}"
            )
        self._channels = [s[1] for s in shapes]
        return array_module(xs[0]).concatenate(xs, axis=1)

    def backward(self, dy: np.ndarray) -> tuple[np.ndarray, ...]:
        ends = np.cumsum([0, *self._channels]).tolist()
        xp = array_module(dy)
        return tuple(
            xp.ascontiguousarray(dy[:, a:b]) for a, b in zip(ends[:-1], ends[1:], strict=True)
        )


__all__ = [
    "NETWORK_INPUT",
    "Add",
    "Concat",
    "Layer",
    "LayerGraph",
    "graph_backward",
    "graph_forward",
]
