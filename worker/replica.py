"""The worker's replicated first block (:mod:`hetconv.replica`): ReplicaForward, and the input
and gradient it gives the stage calls that name it.

ReplicaForward brings the step's images, the block's convolution kernels and biases (all of
them, float32) and its channel-local layers; the worker runs the block, keeps its output (the
next layer's input) and what the block's backward needs under (session, block) for that step,
and answers nothing. A StageForward or ResidentStageForward that names the block
(``replica_layer``) takes that output as its input instead of bytes on the link; the matching
backward computes its input-gradient part as usual, runs it back through the block and answers
the block's kernel and bias gradient parts (``rw``, ``rb``) instead, which the master sums over
the nodes (exact: the block's backward is linear in the incoming gradient).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from hetconv.backends import conv_shape
from hetconv.calls import REPLICA_FORWARD
from hetconv.errors import InvalidCall, RequestTooLarge
from hetconv.proto import worker_pb2 as pb
from hetconv.stages import StageRun, kept_bytes, spec_from_proto, stage_backward, stage_forward
from hetconv.worker.context import WorkerContext
from hetconv.worker.requests import request_padding


@dataclass
class _Block:
    step: int
    run: StageRun
    y: np.ndarray  # the block's output: the next layer's input (on the device, unless split)

    @property
    def held_bytes(self) -> int:
        """For the worker's memory budget: images, kernels, output and every saved array."""
        return kept_bytes(self.run) + self.y.nbytes


class ReplicaCalls:
    """ReplicaForward's core, and the two hooks the stage calls use, on a
    :class:`~hetconv.worker.context.WorkerContext`."""

    def __init__(self, context: WorkerContext):
        self.context = context

    @staticmethod
    def _key(layer: str) -> tuple[str, int]:
        return (f"replica {layer}", 0)

    def forward(self, messages: Iterator):
        ctx = self.context
        request, (x, w, b), receive = ctx.receive(messages, REPLICA_FORWARD)
        padding = request_padding(request)
        if x.ndim != 4 or w.ndim != 4:
            raise InvalidCall(f"x {x.shape} and w {w.shape} must both have 4 dimensions")
        if b.shape != (w.shape[0],):
            raise InvalidCall(f"b has shape {b.shape}, expected ({w.shape[0]},)")
        try:
            conv = conv_shape(x.shape, w.shape, padding)
            spec = spec_from_proto(request.stage.ops)
            spec.output_hw(conv.out_hw)
        except ValueError as e:
            raise InvalidCall(str(e)) from None
        if spec.batchnorms:
            raise InvalidCall(
                f"the block holds {spec.batchnorms} batch norm layers: a replicated block "
                "does not run batch norm (its statistics and parameters stay with the master)"
            )
        split = request.HasField("split")
        if split and not request.split.peers:
            raise InvalidCall("the split names no peers")
        d = request.stage
        if d.own_start != 0 or d.own_count != conv.k:
            raise InvalidCall(
                f"a replicated block computes all its {conv.k} kernels; the stage names "
                f"{d.own_count} from {d.own_start}"
            )
        if not (np.isfinite(x).all() and np.isfinite(w).all() and np.isfinite(b).all()):
            raise InvalidCall("x, w or b holds NaN or Inf")
        kept = 6 * 4 * conv.n * conv.k * conv.out_hw[0] * conv.out_hw[1]
        if kept > ctx.config.max_request_bytes:
            raise RequestTooLarge(
                f"the block would hold {kept} bytes: beyond this worker's limit of "
                f"{ctx.config.max_request_bytes} bytes per request"
            )
        start = time.perf_counter()

        def work():
            # the output stays where the stage calls that name the block compute; a split
            # block's goes to its peers from the host
            y, run = stage_forward(
                ctx.backend, x, w, b, padding, spec, slice(0, conv.k), on_device=not split
            )
            ctx.backend.synchronize()
            return y, run

        key = self._key(request.layer)

        def stale(other, state) -> bool:
            return other == key

        with ctx.split.computing(request):  # a FetchPart of its output waits, not idle
            y, run = ctx.run(work)
            compute = time.perf_counter() - start
            block = _Block(request.step, run, y)  # contiguous (stage_forward's answer)
            ctx.keep(request, key, block, replaces=stale)
            if split:  # this worker's images only: their output goes to the other peers
                ctx.split.forward(request, x, run, block.y)
        return [], compute, receive

    def _block(self, request: pb.ConvRequest, what: str) -> _Block:
        def missing(have: str) -> str:
            return (
                f"{what} of layer {request.layer!r} names the replicated block "
                f"{request.replica_layer!r}, which this session has no output of at step "
                f"{request.step} (have {have}); send ReplicaForward first"
            )

        return self.context.kept_for_step(request, self._key(request.replica_layer), missing)

    def input_for(self, request: pb.ConvRequest, x: np.ndarray) -> np.ndarray:
        """The layer's input: ``x`` as sent, or the named block's output (``x`` then empty)."""
        if not request.replica_layer:
            return x
        if x.size:
            raise InvalidCall(
                f"the request names the replicated block {request.replica_layer!r} but also "
                f"sends x {x.shape}: send an empty x"
            )
        block = self._block(request, "the stage forward")
        if self.context.split.is_split(request):  # every peer's part, once all have come
            return self.context.split.input_for(request)
        return block.y

    def gradients(self, request: pb.ConvRequest, dx: np.ndarray):
        """(rw, rb): the input-gradient part ``dx`` (on the host or the backend's device) back
        through the named block."""
        block = self._block(request, "the stage backward")
        ctx = self.context

        def back(run: StageRun, g: np.ndarray):
            def work():
                out = stage_backward(ctx.backend, run, g, slice(0, run.out_shape[1]), False)
                ctx.backend.synchronize()
                return out

            _, rw, rb = ctx.run(work)
            return rw, rb

        if ctx.split.is_split(request):  # the peers' rows of this worker's images too
            return ctx.split.gradients(request, ctx.backend.to_host(dx), back)
        if dx.shape != block.y.shape:
            raise InvalidCall(f"input gradient {dx.shape} does not match the block's output")
        return back(block.run, dx)


__all__ = ["ReplicaCalls"]
