"""The worker's fused stage calls: StageForward and StageBackward (:mod:`hetconv.stages`).

StageForward brings the layer's input, the owned kernels widened by the stage's halo, the
stage's layers and its batch norms' weights and biases (in evaluation their running statistics
too); the worker runs the convolution and the layers on the widened slice, answers the owned
kernels' output (and in training their batch norms' batch statistics) and keeps what backward
needs (the layers' saved state) under (session, layer, kernel offset of the widened slice) for
the same step. StageBackward brings the gradient of the stage output for the owned and halo
channels and answers the owned kernels' dw, db, batch norm weight and bias gradients and their
input-gradient part. Requests are validated before any work; a bad one is refused with
INVALID_ARGUMENT naming what was wrong, and the worker goes on serving.

What StageForward keeps is held beside the plain Forward cache (same session bound: the least
recently used session goes).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from hetconv.backends import conv_shape
from hetconv.calls import STAGE_BACKWARD, STAGE_FORWARD, StageShape
from hetconv.errors import InvalidCall, RequestTooLarge
from hetconv.formats import FLOAT32, answer_format
from hetconv.proto import worker_pb2 as pb
from hetconv.stages import (
    StageRun,
    batch_statistics_rows,
    batchnorm_grad_rows,
    kept_bytes,
    spec_from_proto,
    stage_backward,
    stage_forward,
    unpack_batchnorm,
)
from hetconv.worker.context import WorkerContext, answer
from hetconv.worker.overlap import (
    GroupedRun,
    GroupedStart,
    Streamed,
    check_overlap,
    forward_groups,
    grad_range,
)
from hetconv.worker.requests import request_padding


@dataclass
class _Kept:
    step: int
    run: StageRun

    @property
    def held_bytes(self) -> int:
        """What it holds, for the worker's memory budget: the input and widened kernels, and
        every array the stage's layers saved for their backward."""
        return kept_bytes(self.run)


class StageCalls:
    """The two stage handlers' cores, on a :class:`~hetconv.worker.context.WorkerContext`
    (its request checks, device thread, limits and kept states)."""

    def __init__(self, context: WorkerContext):
        self.context = context

    def _check_forward(self, request: pb.ConvRequest, x, w, b, bn):
        padding = request_padding(request)
        if x.ndim != 4 or w.ndim != 4:
            raise InvalidCall(f"x {x.shape} and w {w.shape} must both have 4 dimensions")
        if b.shape != (w.shape[0],):
            raise InvalidCall(f"b has shape {b.shape}, expected ({w.shape[0]},)")
        try:
            conv = conv_shape(x.shape, w.shape, padding)
            spec = spec_from_proto(request.stage.ops)
            out_hw = spec.output_hw(conv.out_hw)
            training = not request.stage.batchnorm_eval
            batchnorm = unpack_batchnorm(bn, spec.batchnorms, training)
            for i, one in enumerate(batchnorm):
                one.check(i, conv.k)
        except ValueError as e:
            raise InvalidCall(str(e)) from None
        d = request.stage
        if d.own_count < 1 or d.own_start + d.own_count > conv.k:
            raise InvalidCall(
                f"stage owns {d.own_count} kernels from {d.own_start}, but the request sends "
                f"{conv.k} kernels (at least one owned, all within those sent)"
            )
        # What the request implies must fit the worker's limit too: the stage's intermediates
        # are a few times the feature maps of the widened slice.
        fmt = answer_format(request.answer_dtype)
        shape = StageShape(conv, d.own_count, d.own_count, out_hw)
        kept = 6 * 4 * conv.n * conv.k * conv.out_hw[0] * conv.out_hw[1]
        need = STAGE_FORWARD.answer_bytes(shape, fmt=fmt) + kept
        limit = self.context.config.max_request_bytes
        if need > limit:
            raise RequestTooLarge(
                f"the stage would hold {need} bytes: beyond this worker's limit of "
                f"{limit} bytes per request"
            )
        return padding, spec, slice(d.own_start, d.own_start + d.own_count), batchnorm

    def forward(self, messages: Iterator):
        ctx = self.context
        request, (x, w, b, bn), receive = ctx.receive(messages, STAGE_FORWARD)
        x = ctx.replicas.input_for(request, x)
        padding, spec, own, batchnorm = self._check_forward(request, x, w, b, bn)
        groups = check_overlap(request, spec, x.shape[0])
        start = time.perf_counter()
        fmt = answer_format(request.answer_dtype)
        if groups is not None:  # each group's output goes as soon as it is computed

            def keep(run: GroupedRun) -> None:
                self._keep(request, _Kept(request.step, run))

            outputs = forward_groups(ctx, x, w, b, padding, spec, own, groups, keep)
            y_name, stats_name = STAGE_FORWARD.answer_names()
            owned = own.stop - own.start
            out_hw = spec.output_hw(conv_shape(x.shape, w.shape, padding).out_hw)
            y_shape = (x.shape[0], owned, *out_hw)
            parts = itertools.chain(
                ((0, y) for y in outputs), [(1, np.zeros((0, owned), np.float32))]
            )
            tensors = [(y_name, y_shape, fmt), (stats_name, (0, owned), FLOAT32)]
            return Streamed(tensors, parts, start, receive)

        def work():
            out = stage_forward(ctx.backend, x, w, b, padding, spec, own, batchnorm)
            ctx.backend.synchronize()
            return out

        y, run = ctx.run(work)  # the device thread: one scratch, trimmed
        compute = time.perf_counter() - start
        self._keep(request, _Kept(request.step, run))
        stats = batch_statistics_rows(run)
        formats = STAGE_FORWARD.answer_formats(fmt=fmt)
        return answer(formats, (y, stats)), compute, receive

    def backward(self, messages: Iterator):
        ctx = self.context
        grouped = GroupedStart(ctx, self._kept_for)
        request, (dy,), receive = ctx.receive(messages, STAGE_BACKWARD, grouped.progress)
        run = self._kept_for(request)
        grad = grad_range(run, dy.shape, request.stage.grad_start)
        start = grouped.started or time.perf_counter()
        replica = bool(request.replica_layer)
        need = request.need_input_grad or replica

        first = ctx.split.rows_first(request) if replica else ()
        host = ctx.backend.to_host

        def work():
            dx, dw, db = stage_backward(
                ctx.backend, run, dy, grad, need, rows_first=first, on_device=True
            )
            # the block's backward takes the input gradient where it is
            out = (dx if replica else host(dx), host(dw), host(db))
            ctx.backend.synchronize()
            return out

        dx, dw, db = grouped.result() if grouped.started else ctx.run(work)
        formats = STAGE_BACKWARD.answer_formats(
            request.need_input_grad, answer_format(request.answer_dtype), replica
        )
        arrays = [dw, db, batchnorm_grad_rows(run)]
        if replica:  # the input gradient goes on through the block; its gradients travel
            arrays += ctx.replicas.gradients(request, dx)
        elif request.need_input_grad:
            arrays.append(dx)
        return answer(formats, arrays), time.perf_counter() - start, receive

    # -- what forward keeps ------------------------------------------------------------------

    @staticmethod
    def _key(request: pb.ConvRequest) -> tuple[str, int]:
        return (f"stage {request.layer}", request.kernel_offset)

    def _keep(self, request: pb.ConvRequest, kept: _Kept) -> None:
        """Keep ``kept`` in the worker's memory budget (as the plain Forward's inputs are): what
        this session keeps of the layer's stage from other steps goes."""
        key = self._key(request)

        def stale(other: tuple[str, int], state) -> bool:
            return other[0] == key[0] and state.step != kept.step

        self.context.keep(request, key, kept, replaces=stale)

    def _kept_for(self, request: pb.ConvRequest) -> StageRun:
        def missing(have: str) -> str:
            return (
                f"no stage forward of layer {request.layer!r} from kernel "
                f"{request.kernel_offset} at step {request.step} for this session (have "
                f"{have}); send StageForward first"
            )

        return self.context.kept_for_step(request, self._key(request), missing).run


__all__ = ["StageCalls"]
