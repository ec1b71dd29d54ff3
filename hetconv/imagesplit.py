"""The whole network split by images: what the master and its workers share of it.

Heterogeneous data parallelism run by hetconv over its own workers
(:mod:`hetconv.master.imagesplit`, ``hetconv train --split images``): each step's batch is cut
into contiguous ranges of images, one per node, and every node runs the whole model, the loss
included, on its range. Each node's gradient is that of the *sum* of its images' losses
divided by the whole batch, so the ranges' gradients, summed in node order, are the batch's
mean-loss gradient, what training on one machine computes, to float32 round-off (the logits'
gradient is the same bit for bit; only the sums over images inside each layer's weight
gradient are grouped differently). Dropout draws the whole batch's masks and each range takes
its rows (:func:`images_gradients`), so masks match too. Batch norm couples the images (its
statistics are the whole batch's): refused (:func:`refuse_batchnorm`), but where the nodes sum
their statistics mid-pass (:func:`sync_batchnorm`, the ring's workers: :mod:`hetconv.ring`).

Here: the ranges (:func:`image_ranges`), one range's forward, loss and backward on a model
(:func:`images_gradients`), the check of a network (:func:`refuse_batchnorm`) and the spec as
it travels (:func:`spec_json`).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .backends.arrays import array_module
from .balance import kernel_shares
from .batchnorm import BatchNorm2d
from .layers import Conv2d, Dropout
from .spec import spec_graph, walk_spec

#: ``--split``: each convolution's kernels split across the nodes (every other layer on the
#: master), the whole network split by images, or auto: whichever the cost model predicts
#: faster for the cluster measured at start (:mod:`hetconv.master.splitchoice`).
AUTO, KERNELS, IMAGES = "auto", "kernels", "images"
SPLIT_MODES = (AUTO, KERNELS, IMAGES)


def refuse_batchnorm(spec: Sequence[Mapping]) -> None:
    """Raise ValueError naming the first batch norm layer of ``spec``: its statistics are the
    whole batch's, which a split by images does not compute."""
    for entry, name in zip(spec, spec_graph(spec).names, strict=True):
        if entry["type"] == "batchnorm":
            raise ValueError(
                f"--split images cannot train a network with batch norm (layer {name!r}: "
                "its statistics are the whole batch's, which no node sees); use --split kernels"
            )


def parameter_shapes(
    spec: Sequence[Mapping], input_shape: Sequence[int]
) -> tuple[dict[str, tuple[int, ...]], int]:
    """Every parameter's shape by name, in the model's order (what an ImagesStep request
    carries), and the values of every layer's output per image (what one image's passes
    hold, about)."""
    shapes: dict[str, tuple[int, ...]] = {}
    values = 0
    for layer in walk_spec(spec, tuple(input_shape)):
        values += math.prod(layer.output_shape)
        if layer.conv is not None:
            shapes[f"{layer.name}.weight"] = layer.conv.weight_shape
            if layer.options["bias"]:
                shapes[f"{layer.name}.bias"] = (layer.conv.kernels,)
        elif layer.kind == "fc":
            out = layer.output_shape[0]
            shapes[f"{layer.name}.weight"] = (out, math.prod(layer.input_shape))
            shapes[f"{layer.name}.bias"] = (out,)
        elif layer.kind == "batchnorm":
            channels = layer.input_shape[0]
            shapes[f"{layer.name}.weight"] = shapes[f"{layer.name}.bias"] = (channels,)
    return shapes, values


def spec_json(spec: Sequence[Mapping]) -> str:
    """The spec as it travels in an ImagesStep request: compact JSON, keys sorted."""
    return json.dumps(list(spec), sort_keys=True, separators=(",", ":"))


def image_ranges(
    batch: int, seconds_per_image: Sequence[float], fixed_seconds: Sequence[float] | None = None
) -> list[tuple[int, int]]:
    """Contiguous (start, count) ranges tiling ``batch`` images, one per node in order, by the
    largest remainder as kernel shares are split (:func:`~hetconv.balance.kernel_shares`).

    Without ``fixed_seconds``, in proportion to each node's speed (``1 / seconds_per_image``;
    ``math.inf`` excludes a node: it gets none). With them (each node's seconds per step that
    do not depend on its images: the parameters and gradients on its link), so that every
    node finishes together: node i's ``fixed_i + seconds_per_image_i * count_i`` the same
    for every node that gets images (one whose fixed seconds alone exceed that gets none).
    """
    if fixed_seconds is not None and any(f > 0 for f in fixed_seconds):
        quotas = _finishing_together(batch, list(seconds_per_image), list(fixed_seconds))
        seconds_per_image = [1 / q if q > 0 else math.inf for q in quotas]
    counts = kernel_shares(batch, list(seconds_per_image))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int)
    return [(int(s), int(c)) for s, c in zip(starts, counts, strict=True)]


def _finishing_together(batch: int, per_image: list[float], fixed: list[float]) -> list[float]:
    """Each node's (fractional) images so that ``fixed + per_image * images`` is one time T
    for every node with images: T found by bisection (the images at T rise with T)."""
    if len(fixed) != len(per_image) or any(not f >= 0 for f in fixed):
        raise ValueError(f"fixed seconds {fixed} must be {len(per_image)} values >= 0")

    def images_at(t: float) -> list[float]:
        return [max(0.0, (t - f) / s) if math.isfinite(s) else 0.0
                for f, s in zip(fixed, per_image, strict=True)]  # fmt: skip

    finite = [s for s in per_image if math.isfinite(s)]
    if not finite:
        raise ValueError("every node is excluded (infinite seconds per image)")
    low, high = 0.0, max(fixed) + batch * max(finite)
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if sum(images_at(middle)) < batch else (low, middle)
    return images_at(high)


class _RowsDropout(Dropout):
    """A :class:`~hetconv.layers.Dropout` on rows ``first .. first + count`` of a batch of
    ``batch`` images: it draws the whole batch's mask and takes those rows, as one machine
    training the whole batch draws them."""

    rows: tuple[int, int] | None = None  # (first, batch); None: a whole batch

    def forward(self, x):
        if self.rows is None or not self.training or self.p == 0.0:
            return super().forward(x)
        first, batch = self.rows
        step = self.step if self.step is not None else self._forwards
        self._forwards += 1
        rng = np.random.default_rng((*self.seed, step))
        keep = rng.random((batch, *x.shape[1:]), dtype=np.float32) >= np.float32(self.p)
        return self._masked(x, keep[first : first + x.shape[0]])


class _SyncBatchNorm(BatchNorm2d):
    """A :class:`~hetconv.batchnorm.BatchNorm2d` on rows of a batch of ``batch`` images whose
    statistics are the whole batch's: ``reduce`` sums a float64 vector over every node's rows
    (every node gets the same sum, bit for bit). Forward sums each channel's values and their
    squares at once (float64: the variance as the mean of the squares less the squared mean,
    within float64's round-off of one machine's two passes for any channel whose mean is
    within thousands of its standard deviations); backward the two per-channel sums its input
    gradient needs. Each node's parameter gradients stay its own rows' (the nodes' are summed
    later, as every parameter's); the running statistics move by the whole batch's, the same
    on every node. Without ``reduce``, or in evaluation, a plain batch norm."""

    reduce: Callable[[np.ndarray], np.ndarray] | None = None
    batch = 0

    def forward(self, x):
        if self.reduce is None or not self.training:
            return super().forward(x)
        gamma, beta = self.params["weight"], self.params["bias"]
        total, xp, c = self.batch * x.shape[2] * x.shape[3], array_module(x), x.shape[1]
        sums = xp.concatenate([x.sum(axis=(0, 2, 3), dtype=np.float64),
                               xp.square(x, dtype=np.float64).sum(axis=(0, 2, 3))])  # fmt: skip
        summed = self.reduce(sums)  # one sum: the values and squares
        whole, squares = summed[:c], summed[c:]
        mean = whole / total
        var = xp.maximum(squares / total - mean * mean, 0.0)
        centred = x - mean.astype(np.float32).reshape(1, -1, 1, 1)
        inv_std = (1.0 / xp.sqrt(var + self.eps)).astype(np.float32)
        x_hat = centred * self._per_channel(inv_std)
        self.track(mean, var, total)
        self.buffers["num_batches_tracked"] += 1
        self.batch_stats = (mean, var)
        self._x_hat, self._inv_std, self._total = x_hat, inv_std, total
        return x_hat * self._per_channel(gamma) + self._per_channel(beta)

    def backward(self, dy):
        if self.reduce is None or self._x_hat is None:
            return super().backward(dy)
        x_hat, inv_std, total = self._x_hat, self._inv_std, self._total
        d_beta = dy.sum(axis=(0, 2, 3), dtype=np.float64)
        d_gamma = (dy * x_hat).sum(axis=(0, 2, 3), dtype=np.float64)
        self.grads = {"weight": d_gamma.astype(np.float32), "bias": d_beta.astype(np.float32)}
        summed = self.reduce(array_module(dy).concatenate([d_beta, d_gamma]))
        whole_beta, whole_gamma = summed[: len(d_beta)], summed[len(d_beta) :]
        dx = dy - self._per_channel((whole_beta / total).astype(np.float32))
        dx -= x_hat * self._per_channel((whole_gamma / total).astype(np.float32))
        dx *= self._per_channel((self.params["weight"] * inv_std).astype(np.float32))
        return dx


class _Later:
    """The kernel gradients a pass with batch norm sums leaves for later (:class:`_KernelsLater`):
    computed while a sum travels (:meth:`drain`, called by the sum once its own part is out,
    before it waits for the others'), the rest at the end of backward. A convolution's kernel
    gradient is what backward computes that no later layer of backward needs, so it fills the
    wait (on the scaled testbed, resnet20 at batch 64 on 4 workers, the sums' waits were 0.115
    s of a worker's 0.199 s pass). The same operations on the same arrays: the same values."""

    def __init__(self):
        self.items: list[tuple[Conv2d, Callable[[], None]]] = []

    def add(self, layer: Conv2d, finish: Callable[[], None]) -> None:
        self.items.append((layer, finish))

    def drain(self) -> None:
        while self.items:
            layer, finish = self.items.pop(0)
            finish()
            layer.grads_ready()


class _KernelsLater(Conv2d):
    """A :class:`~hetconv.layers.Conv2d` whose backward gives its input gradient and leaves
    its kernel gradient to ``later`` (a :class:`_Later`; None: at once, as a Conv2d)."""

    later: _Later | None = None

    def backward(self, dy):
        if self.later is None:
            return super().backward(dy)
        dx, finish = self.backward_later(dy)
        self.later.add(self, finish)
        return dx


def _leave_kernels(model, later: _Later | None) -> None:
    """Every convolution of ``model`` leaves its kernel gradient to ``later`` (None: computes it
    at once)."""
    for layer in model.layers:
        if isinstance(layer, Conv2d):
            if type(layer) is Conv2d:
                layer.__class__ = _KernelsLater  # the same object: the model's steps hold it
            layer.later = later


def sync_batchnorm(model, reduce: Callable[[np.ndarray], np.ndarray] | None, batch: int) -> None:
    """Every batch norm layer of ``model`` takes the statistics of a batch of ``batch`` images
    through ``reduce`` (:class:`_SyncBatchNorm`; None: its own rows')."""
    for layer in model.layers:
        if isinstance(layer, BatchNorm2d):
            if type(layer) is BatchNorm2d:
                layer.__class__ = _SyncBatchNorm  # the same object: the model's steps hold it
            layer.reduce, layer.batch = reduce, batch


def _take_rows(model, first: int | None, batch: int) -> None:
    """Every dropout layer of ``model`` draws the masks of rows ``first ..`` of ``batch``
    (``first`` None: of its own batch)."""
    for layer in model.layers:
        if isinstance(layer, Dropout):
            if type(layer) is Dropout:
                layer.__class__ = _RowsDropout  # the same object: the model's steps hold it
            layer.rows = None if first is None else (first, batch)


def images_gradients(
    model,
    x: np.ndarray,
    labels: np.ndarray,
    first: int,
    batch: int,
    step: int,
    reduce=None,
    copy: bool = True,
    kernels_later: bool = True,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """One node's part of a step split by images: ``model`` (a :class:`~hetconv.model.Model`
    in training mode) on images ``x`` (n, C, H, W) float32, rows ``first .. first + n`` of a
    batch of ``batch``, with int ``labels`` (n,).

    Returns:
        (every parameter's gradient of the sum of these images' softmax cross-entropy losses
        divided by ``batch``, by name, fresh float32 arrays; float32 (n,) each image's loss;
        bool (n,) whether its top logit is its label). The logits' gradient is computed by
        the operations :func:`~hetconv.layers.softmax_cross_entropy` uses on the whole batch,
        row by row: the same values. ``reduce``: how batch norm layers take the whole batch's
        statistics (:func:`sync_batchnorm`; None: from these images alone); with it, and
        batch norm layers in the model, each convolution's kernel gradient is left for
        later (``kernels_later``, :class:`_Later`),
        computed while a sum waits where ``reduce`` has a ``meanwhile`` to set (called once
        its part is out), the rest at the end of backward. ``copy`` False:
        the gradients as the model holds them (float32, valid until its next backward), not
        fresh copies. On a device (the model placed there: :meth:`~hetconv.model.Model.place`;
        ``x`` and ``labels`` device arrays, ``reduce`` taking and giving them) every array
        answered is the device's, computed by the same operations.
    """
    n = x.shape[0]
    if labels.shape != (n,):
        raise ValueError(f"labels have shape {labels.shape}, expected ({n},)")
    if not 0 <= first <= first + n <= batch:
        raise ValueError(f"images {first} .. {first + n} are not within a batch of {batch}")
    _take_rows(model, first, batch)
    # With the sums: each convolution's kernel gradient computed while a sum waits (none to
    # wait for without batch norm: each one is computed first, for the bucket ring).
    sums = reduce is not None and any(isinstance(v, BatchNorm2d) for v in model.layers)
    later = _Later() if sums and kernels_later else None
    if later is not None and hasattr(reduce, "meanwhile"):
        reduce.meanwhile = later.drain
    sync_batchnorm(model, reduce, batch)
    _leave_kernels(model, later)
    try:
        return _range_pass(model, x, labels, batch, step, later, copy)
    finally:  # the model's own again: a later pass (the master trained alone) sums nothing
        _take_rows(model, None, batch)
        sync_batchnorm(model, None, batch)
        _leave_kernels(model, None)


def _range_pass(model, x, labels, batch: int, step: int, later, copy: bool):
    """:func:`images_gradients`' forward, loss and backward, the model set up for them."""
    n, xp = x.shape[0], array_module(x)
    logits = model.forward(x, step=step)
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = xp.exp(shifted)
    total = exp.sum(axis=1, keepdims=True)
    rows = xp.arange(n)
    losses = -(shifted - xp.log(total))[rows, labels]
    grad = exp / total
    grad[rows, labels] -= 1.0
    grad /= np.float32(batch)
    model.backward(grad.astype(np.float32, copy=False))
    if later is not None:
        later.drain()
    take = xp.array if copy else xp.asarray
    grads = {name: take(g, np.float32) for name, g in model.gradients().items()}
    return grads, losses.astype(np.float32), logits.argmax(axis=1) == labels


@contextlib.contextmanager
def backward_hooks(model, overlap):
    """While held, each layer of ``model`` with parameters tells ``overlap`` (anything with
    ``ready(index, gradient)``, the parameter's index in ``model.parameters()``: a worker's
    :class:`~hetconv.worker.ring.BucketRing`, the master's part put bucket by bucket; None:
    nothing) its gradients as its backward returns them; a layer whose backward gives none is
    given at the end by whoever holds the gradients. A convolution whose kernel gradient is not
    left for later tells them before it computes its input gradient
    (:meth:`~hetconv.layers.Conv2d.backward_kernels_first`): its bucket's ring then runs
    while the input gradient and the layers before compute (on the scaled testbed the
    gradient's ring after backward was 0.45-1.1 s of paper-150-800's 3.0 s step at batch 64,
    its 12 MB conv2 kernel the last gradient backward gave but one)."""
    if overlap is None:
        yield
        return
    index = {name: i for i, name in enumerate(model.parameters())}
    hooked = [layer for layer in model.layers if layer.params]
    for layer in hooked:

        def ready(_layer=layer):
            for key in _layer.params:
                if key in _layer.grads:
                    overlap.ready(index[f"{_layer.name}.{key}"], _layer.grads[key])

        def backward(*args, _layer=layer, _ready=ready, **kwargs):
            if isinstance(_layer, Conv2d) and getattr(_layer, "later", None) is None:
                return _layer.backward_kernels_first(*args, _ready, **kwargs)
            out = type(_layer).backward(_layer, *args, **kwargs)  # its class may change
            _ready()  # none where its kernel gradient is left for later (told then)
            return out

        layer.backward, layer.grads_ready = backward, ready
    try:
        yield
    finally:
        for layer in hooked:
            del layer.backward, layer.grads_ready  # the class's own again


def batch_loss(losses: Sequence[np.ndarray], batch: int) -> float:
    """The batch's mean loss from its ranges' per-image losses, in order (float32, as
    :func:`~hetconv.layers.softmax_cross_entropy` takes the mean)."""
    joined = np.concatenate(list(losses)) if losses else np.zeros(0, np.float32)
    if joined.shape != (batch,):
        raise ValueError(f"{joined.shape[0]} losses for a batch of {batch}")
    return float(joined.mean())


def seconds_per_image(images: int, seconds: float) -> float:
    """A node's measured seconds per image (``math.inf`` when it computed none)."""
    return seconds / images if images > 0 and seconds > 0 else math.inf


__all__ = [
    "AUTO",
    "IMAGES",
    "KERNELS",
    "SPLIT_MODES",
    "backward_hooks",
    "batch_loss",
    "image_ranges",
    "images_gradients",
    "parameter_shapes",
    "refuse_batchnorm",
    "seconds_per_image",
    "spec_json",
    "sync_batchnorm",
]
