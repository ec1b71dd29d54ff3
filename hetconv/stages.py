"""Fused worker stages: a convolution slice and the channel-local layers after it, run together.

A *stage* is one convolution plus the chain of channel-local layers that follows it in the
model's graph (ReLU, local response normalisation, max-pool, average pool, global average pool,
batch norm: the run of these after the convolution, each the only reader of the one before
and reading nothing else; in a sequential spec, the leading run after the convolution).
The values that describe a stage (:class:`StageOp`, :class:`StageSpec`,
:class:`BatchNormSlice`) are :mod:`hetconv.stageops`'s, re-exported here. Dropout ends a stage and
runs on the master, after the stage's output: its masks are drawn by the master's model. The
node that owns a slice of the convolution's kernels (output channels) also runs the chain on
them and answers the chain's output (the pooled maps); backward takes the gradient of that
output. The master and the worker both run it with the code here, which runs the very layers
of :mod:`hetconv.layers` on the slice: there is one implementation of each layer.

Channel halos. ReLU and max-pool act on each channel alone. LRN does not: its output channel
``c`` reads input channels ``c - before .. c + after`` (``before = size // 2``,
``after = (size - 1) // 2``). For node-local exactness the node computes extra kernels on each
side of its own slice, redundantly:

* forward alone needs ``before`` extra channels below and ``after`` above per LRN;
* backward of conv channel ``j`` needs the LRN input gradient at ``j``, which reads the LRN
  output gradient at ``j - after .. j + before`` and the scale (hence conv values) at those
  channels, which read conv values ``j - after - before .. j + before + after``.

So a node computes its owned slice ``[s, e)`` widened by ``W = sum(before + after)`` over the
chain's LRNs on both sides (``2 * (size // 2)`` for one LRN of odd size), clipped to the layer,
and backward sends it the chain-output gradient of ``[s - A, e + B)`` with ``A = sum(after)``,
``B = sum(before)`` (clipped). The widened edges that are not the layer's own edges hold wrong
values (their LRN windows are cut short), but no owned channel reads them: the derivation above
is exactly what keeps them out (``tests/test_fused.py`` checks it for every split). Each node
answers kernel gradients for its owned kernels only and its input-gradient part from them only,
so each kernel's gradient is computed, and each input-gradient part summed, exactly once.

Batch norm. Each channel is normalised by its own statistics over (N, H, W), all of which the
node has (it convolves the whole batch), so batch norm has no reach and a slice computes its
channels exactly as the whole layer does, halo channels included. A stage's batch norm takes a
:class:`BatchNormSlice` per op (weight and bias of the widened slice; in evaluation its running
statistics too). Training, the node answers the owned channels' batch mean and biased variance
(:meth:`StageRun.batch_statistics`), from which the master moves the layer's running
statistics with :meth:`~hetconv.layers.BatchNorm2d.track`, the very update the layer's own
forward makes, and backward the owned channels' weight and bias gradients
(:meth:`StageRun.batchnorm_grads`).

.. note:: The statistics travel as float32 (:func:`batch_statistics_rows`; the layer sums them
   in float64), and the master rounds its own pieces' alike, so the running statistics differ
   from local training's by float32 rounding of the statistics (relative 1e-7) and whatever
   the slice's convolution rounds differently, never by who computed which channels.

On a device. :func:`stage_forward` and :func:`stage_backward` run the whole stage where the
backend computes: the call's arrays go to the device once (:meth:`~hetconv.backends.Backend
.to_device`), the convolution and every layer run on the device arrays in the backend's array
module (cupy on the cuda backend; the layers take it from their input), and the answers come
back once (:meth:`~hetconv.backends.Backend.to_host`); what the forward keeps for the backward
stays on the device. On a host backend both are the identity: the numpy path is unchanged.

Exchanging halos between neighbouring workers instead would save the redundant kernels but
move ``size - 1`` full-size channels each way per phase between workers, with a round trip in
the middle of each phase's stage (and workers that know each other).
``python benchmarks/wire_bytes.py --halo --batch 16`` counts both for the reference networks
with 4 workers: redundant, conv1 costs 7-70 % more of its (cheap, 3-channel) kernels and 60 kB
per worker on the master's link, conv2 2-7 % more kernels and 49-364 kB; exchanged, 1049 kB
(conv1) and 262 kB (conv2) per worker between workers, plus the round trips. Per step the
redundant halo moves fewer bytes (at most 424 kB per worker against 1311 kB), next to
megabytes of maps, and needs no worker-to-worker links: it is what is built here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .backends import Backend, PaddingSpec
from .backends.arrays import array_module, to_host
from .backends.base import KernelGradientSum
from .layers import BatchNorm2d, Layer, chunked, saved_arrays
from .proto import worker_pb2 as pb
from .stageops import (
    AUTO,
    CHANNEL_LOCAL,
    FUSED,
    POOL_KINDS,
    STAGE_MODES,
    UNFUSED,
    BatchNormSlice,
    StageOp,
    StageSpec,
    stage_of,
)

_TO_PROTO = {
    "relu": pb.RELU,
    "lrn": pb.LRN,
    "maxpool": pb.MAXPOOL,
    "avgpool": pb.AVGPOOL,
    "gap": pb.GLOBAL_AVGPOOL,
    "batchnorm": pb.BATCHNORM,
}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}


def ops_to_proto(spec: StageSpec) -> list[pb.StageOp]:
    """The stage's layers as the wire carries them (``StageDescription.ops``)."""
    out = []
    for op in spec.ops:
        message = pb.StageOp(layer=_TO_PROTO[op.kind])
        if op.kind == "lrn":
            message.size, message.alpha, message.beta, message.k = op.size, op.alpha, op.beta, op.k
        elif op.kind in POOL_KINDS:
            message.kernel, message.stride = op.kernel, op.stride
        elif op.kind == "batchnorm":
            message.eps, message.momentum = op.eps, op.momentum
        out.append(message)
    return out


def spec_from_proto(ops: Sequence[pb.StageOp]) -> StageSpec:
    """The :class:`StageSpec` a request describes.

    Raises:
        ValueError: no layers, an unknown layer, or an option out of range (naming which).
    """
    if not ops:
        raise ValueError("the stage has no layers (a stage call needs at least one)")
    out = []
    for i, message in enumerate(ops):
        kind = _FROM_PROTO.get(message.layer)
        if kind is None:
            raise ValueError(
                f"stage layer {i} has kind {message.layer}; expected "
                f"{', '.join(pb.StageLayer.Name(v) for v in _FROM_PROTO)}"
            )
        try:
            if kind == "lrn":
                op = StageOp(
                    kind, size=message.size, alpha=message.alpha, beta=message.beta, k=message.k
                )
            elif kind in POOL_KINDS:
                op = StageOp(kind, kernel=message.kernel, stride=message.stride)
            elif kind == "batchnorm":
                op = StageOp(kind, eps=message.eps, momentum=message.momentum)
            else:
                op = StageOp(kind)
        except ValueError as e:
            raise ValueError(f"stage layer {i}: {e}") from None
        out.append(op)
    return StageSpec(tuple(out))


def batchnorm_rows(batchnorms: int, training: bool) -> int:
    """Rows of the ``bn`` tensor of a stage call: weight and bias per batch norm, and in
    evaluation its running mean and variance too."""
    return batchnorms * (2 if training else 4)


def pack_batchnorm(slices: Sequence[BatchNormSlice], channels: int) -> np.ndarray:
    """The ``bn`` tensor of a stage call: float32 (:func:`batchnorm_rows`, channels)."""
    rows = []
    for bn in slices:
        rows += [bn.weight, bn.bias]
        if not bn.training:
            rows += [bn.running_mean, bn.running_var]
    if not rows:
        return np.zeros((0, channels), np.float32)
    return np.stack(rows).astype(np.float32, copy=False)


def unpack_batchnorm(bn: np.ndarray, batchnorms: int, training: bool) -> list[BatchNormSlice]:
    """The :class:`BatchNormSlice` of each of the stage's ``batchnorms`` from ``bn``.

    Raises:
        ValueError: ``bn`` has not the rows that implies, naming both.
    """
    rows = batchnorm_rows(batchnorms, training)
    if bn.ndim != 2 or bn.shape[0] != rows:
        mode = "training" if training else "evaluation"
        raise ValueError(
            f"bn has shape {bn.shape}, expected ({rows}, channels): {batchnorms} batch norm "
            f"layers in {mode}"
        )
    per = 2 if training else 4
    out = []
    for i in range(batchnorms):
        r = bn[i * per : (i + 1) * per]
        running = (None, None) if training else (r[2], r[3])
        out.append(BatchNormSlice(r[0], r[1], training, *running))
    return out


def batch_statistics_rows(run: StageRun) -> np.ndarray:
    """The ``stats`` answer of a stage forward: float32 (2 per training batch norm, owned),
    each one's batch mean and biased variance of the owned channels."""
    rows = [a for mean, var, _ in run.batch_statistics() for a in (mean, var)]
    return _rows(rows, run.own.stop - run.own.start)


def _rows(rows: list, own: int) -> np.ndarray:
    """``rows`` (numpy or device arrays of ``own`` values) stacked as float32, on the host."""
    if not rows:
        return np.zeros((0, own), np.float32)
    xp = array_module(rows[0])
    if xp is np:
        return np.stack(rows).astype(np.float32)
    with rows[0].device:  # any thread: the device the rows are on
        return to_host(xp.stack(rows).astype(np.float32))


def batchnorm_grad_rows(run: StageRun) -> np.ndarray:
    """The ``dbn`` answer of a stage backward: float32 (2 per batch norm, owned), each one's
    weight and bias gradients of the owned channels."""
    rows = [a for pair in run.batchnorm_grads() for a in pair]
    return _rows(rows, run.own.stop - run.own.start)


@dataclass
class StageRun:
    """One node's forward of a stage, kept for its backward.

    ``x``, ``w``: the input and the widened kernel slice; ``own``: the owned kernels' range
    within the widened slice; ``layers``: the chain's layer objects with their saved state.
    """

    x: np.ndarray
    w: np.ndarray
    padding: PaddingSpec
    own: slice
    layers: list[Layer]
    out_shape: tuple[int, ...]

    @property
    def _batchnorms(self) -> list[BatchNorm2d]:
        return [layer for layer in self.layers if isinstance(layer, BatchNorm2d)]

    def batch_statistics(self) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """Per training batch norm of the stage, in order: float64 (own,) batch mean and
        biased variance of the owned channels and the count they are over (N * H * W), what
        the master moves that layer's running statistics by
        (:meth:`~hetconv.layers.BatchNorm2d.track`). Evaluation batch norms have none."""
        out = []
        for layer in self._batchnorms:
            if layer.training:
                mean, var = layer.batch_stats
                count = layer._x_hat.shape[0] * layer._x_hat.shape[2] * layer._x_hat.shape[3]
                out.append((mean[self.own], var[self.own], count))
        return out

    def batchnorm_grads(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """After :func:`stage_backward`: per batch norm, float32 (own,) weight and bias
        gradients of the owned channels."""
        out = []
        for layer in self._batchnorms:
            if not layer.grads:
                raise ValueError(f"{layer.name}: no gradients yet; run stage_backward first")
            xp = array_module(layer.grads["weight"])
            out.append(
                (
                    xp.ascontiguousarray(layer.grads["weight"][self.own]),
                    xp.ascontiguousarray(layer.grads["bias"][self.own]),
                )
            )
        return out


def kept_bytes(run) -> int:
    """Bytes a stage forward keeps for its backward: its input, its widened kernels and every
    array its layers saved (``run``: a :class:`StageRun`, or anything with ``x``, ``w`` and
    ``layers``, as a run made group by group)."""
    arrays = [run.x, run.w] + [a for layer in run.layers for a in saved_arrays(layer)]
    return sum(a.nbytes for a in arrays)


def check_slices(kernels: int, own: slice, grad: slice | None = None) -> None:
    """Raise ValueError unless ``own`` (and ``grad``) are non-empty ranges within ``kernels``
    channels and ``grad`` covers ``own``."""
    if not 0 <= own.start < own.stop <= kernels:
        raise ValueError(
            f"owned kernels {own.start}..{own.stop - 1} are not within the {kernels} computed"
        )
    if grad is not None and not (0 <= grad.start <= own.start and own.stop <= grad.stop <= kernels):
        raise ValueError(
            f"gradient channels {grad.start}..{grad.stop - 1} must cover the owned kernels "
            f"{own.start}..{own.stop - 1} within the {kernels} computed"
        )


def stage_forward(
    backend: Backend,
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray,
    padding: PaddingSpec,
    spec: StageSpec,
    own: slice,
    batchnorm: Sequence[BatchNormSlice] = (),
    on_device: bool = False,
) -> tuple[np.ndarray, StageRun]:
    """The chain's output on the owned kernels.

    Args:
        x: float32 (N, C, H, W) input (numpy, or already on the backend's device).
        w, b: float32 (k, C, kh, kw) and (k,): the widened kernel slice
            (:meth:`StageSpec.widened`).
        own: the owned kernels within ``w`` (offsets into its first axis).
        batchnorm: one :class:`BatchNormSlice` per batch norm op of ``spec``, in order.
        on_device: answer the output on the backend's device (where the caller computes on
            with it) instead of copying it to the host.

    Returns:
        float32 (N, own kernels, Ho', Wo') chain output, and what backward needs (with the
        training batch norms' statistics, :meth:`StageRun.batch_statistics`), kept on the
        backend's device.

    Raises:
        ValueError: bad slices, or batch norm parameters missing or of the wrong shape.
    """
    check_slices(w.shape[0], own)
    if len(batchnorm) != spec.batchnorms:
        raise ValueError(
            f"the stage has {spec.batchnorms} batch norm layers but {len(batchnorm)} "
            "batch norm parameter sets came"
        )
    for i, bn in enumerate(batchnorm):
        bn.check(i, w.shape[0])
    with backend.scope():
        x, w = backend.to_device(x), backend.to_device(w)
        a = backend.conv_forward(x, w, backend.to_device(b), padding)
        layers = chunked(spec.build("stage", w.shape[0]))
        given = iter(batchnorm)
        for layer in layers:
            if isinstance(layer, BatchNorm2d):
                _place_batchnorm(layer, next(given), backend)
            a = layer.forward(a)
        run = StageRun(x, w, padding, own, layers, a.shape)
        y = array_module(a).ascontiguousarray(a[:, own])
        return (y if on_device else backend.to_host(y)), run


def _place_batchnorm(layer: BatchNorm2d, bn: BatchNormSlice, backend: Backend) -> None:
    """A stage's batch norm ``layer`` given the slice's weight and bias (in evaluation its
    running statistics too), on the backend's device."""
    layer.params = {"weight": backend.to_device(bn.weight), "bias": backend.to_device(bn.bias)}
    layer.training = bn.training
    buffers = layer.buffers
    if not backend.on_device:
        if not bn.training:
            # copies: the layer's buffers are its own, never the caller's arrays
            buffers["running_mean"][...] = bn.running_mean
            buffers["running_var"][...] = bn.running_var
        return
    if bn.training:  # what the forward moves and nobody reads: made there, not sent
        buffers["running_mean"] = backend.xp.zeros(layer.channels, np.float32)
        buffers["running_var"] = backend.xp.ones(layer.channels, np.float32)
    else:  # fresh device copies: the layer's own
        buffers["running_mean"] = backend.to_device(np.array(bn.running_mean))
        buffers["running_var"] = backend.to_device(np.array(bn.running_var))


def stage_backward(
    backend: Backend,
    run: StageRun,
    dy: np.ndarray,
    grad: slice,
    need_input_grad: bool,
    kernel_sum: KernelGradientSum | None = None,
    rows_first: Sequence[tuple[slice, Callable]] = (),
    on_device: bool = False,
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """(input-gradient part or None, dw, db) of the owned kernels.

    Args:
        run: the forward's :class:`StageRun`.
        dy: float32 (N, len(grad), Ho', Wo'): the chain-output gradient of channels ``grad``
            of the widened slice (:meth:`StageSpec.grad_range`, made relative); numpy, or on
            the backend's device.
        kernel_sum: where ``run`` is one image group of a batch, the batch's sum of kernel
            gradients (:meth:`Backend.kernel_gradient_sum`): this group's are added to it and
            dw and db come back None.
        rows_first: (images, done) pairs: with ``need_input_grad``, the input gradient of
            those images is computed first, before the kernel gradients, and ``done(images,
            rows)`` called with each (on the host) as it is (a split block sends them to their
            peers: :mod:`hetconv.split`). The input gradient is per image, so the rows are the
            same.
        on_device: answer on the backend's device instead of copying the answers to the host.
    """
    check_slices(run.out_shape[1], run.own, grad)
    expected = (run.out_shape[0], grad.stop - grad.start, *run.out_shape[2:])
    if dy.shape != expected:
        raise ValueError(f"stage gradient has shape {dy.shape}, expected {expected}")
    with backend.scope():
        xp = array_module(run.w)
        g = xp.zeros(run.out_shape, np.float32)
        g[:, grad] = backend.to_device(dy)
        for layer in reversed(run.layers):
            g = layer.backward(g)
        g_own = xp.ascontiguousarray(g[:, run.own])
        w_own = xp.ascontiguousarray(run.w[run.own])
        dx = None
        if need_input_grad and rows_first:
            dx = xp.empty(run.x.shape, np.float32)
            left = np.ones(run.x.shape[0], bool)
            for images, done in rows_first:
                dx[images] = backend.conv_grad_input(
                    g_own[images], w_own, run.x.shape[2:], run.padding
                )
                left[images] = False
                done(images, backend.to_host(dx[images]))
        dw = db = None
        if kernel_sum is not None:
            kernel_sum.add(run.x, g_own, w_own.shape[2:], run.padding)
        else:
            dw, db = backend.conv_grad_kernels(run.x, g_own, w_own.shape[2:], run.padding)
        if need_input_grad and dx is None:
            dx = backend.conv_grad_input(g_own, w_own, run.x.shape[2:], run.padding)
        elif need_input_grad and left.any():  # the rest, in runs of images
            for rest in _runs(left):
                dx[rest] = backend.conv_grad_input(g_own[rest], w_own, run.x.shape[2:], run.padding)
        if on_device:
            return dx, dw, db
        return tuple(None if a is None else backend.to_host(a) for a in (dx, dw, db))


def _runs(mask: np.ndarray) -> list[slice]:
    """The runs of True in ``mask``, as slices."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [slice(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


__all__ = [
    "AUTO",
    "BatchNormSlice",
    "CHANNEL_LOCAL",
    "FUSED",
    "STAGE_MODES",
    "UNFUSED",
    "StageOp",
    "StageRun",
    "StageSpec",
    "batch_statistics_rows",
    "batchnorm_grad_rows",
    "batchnorm_rows",
    "check_slices",
    "kept_bytes",
    "pack_batchnorm",
    "unpack_batchnorm",
    "ops_to_proto",
    "spec_from_proto",
    "stage_backward",
    "stage_forward",
    "stage_of",
]
