"""The worker's part of a network cut in two (:mod:`hetconv.cutsplit`): an ImagesStep whose
``cut_phase`` is FORWARD or BACKWARD.

FORWARD is a ring step's start (:meth:`~hetconv.worker.imagesplit.ImagesCalls._ring_step`):
the weights placed, or the version held checked; the first part (the request's spec) run on
the worker's images, batch norm's statistics summed over the ring mid-pass; but it answers
the part's output (``y``) and keeps the pass (its layers' saved state, the sums' rounds) for
the step's BACKWARD, which brings the gradient of that output (``dy``), back-propagates it
(batch norm's sums continuing the FORWARD's rounds), sums the part's gradient over the ring and
applies the update, answering as a ring step does (the sum where asked, the ring's values, rank
0's running statistics), without losses and hits. The weights are in doubt from the FORWARD
until the update: a step whose BACKWARD never comes leaves them so, and the master places them
again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from hetconv.batchnorm import BatchNorm2d
from hetconv.errors import InvalidCall, MissingForward
from hetconv.formats import FLOAT32
from hetconv.imagesplit import _Later, _leave_kernels, _take_rows, sync_batchnorm
from hetconv.proto import worker_pb2 as pb
from hetconv.ring import DONE, OWN, RING_ANSWER_VALUES
from hetconv.wire import WireTensor
from hetconv.worker.ring import RingFailed

#: The tensor FORWARD answers and BACKWARD brings.
Y, DY = "y", "dy"


@dataclass
class CutPass:
    """A FORWARD kept for its step's BACKWARD."""

    step: int
    first: int
    count: int
    reduce: object  # the step's batch norm sums (imagesplit._BatchNormSums)
    seconds: dict = field(default_factory=dict)
    failed: bool = False  # a sum of the FORWARD failed: no BACKWARD can follow
    later: object = None  # the kernel gradients backward leaves for its sums' waits


def forward(calls, request: pb.ConvRequest, kept, parameters, x, make_sums):
    """FORWARD on ``calls`` (an ImagesCalls) with the session's ``kept`` model: (the answer's
    tensors, the compute seconds). ``make_sums(seconds)`` gives the step's batch norm sums."""
    ctx, d = calls.context, request.images
    model, backend = kept.model, ctx.backend
    ctx.ring.begin(request.session, int(request.step))
    calls.place_or_check(request, kept, parameters)
    seconds = dict.fromkeys(("batchnorm", "ring", "update", "digest"), 0.0)
    reduce = make_sums(seconds)
    cut = CutPass(int(request.step), int(d.first), len(x), reduce, seconds)
    start = time.perf_counter()

    def work():
        model.train()
        _take_rows(model, cut.first, int(d.batch))
        sync_batchnorm(model, reduce, int(d.batch))
        # backward's kernel gradients computed while its batch norm sums wait (as a ring
        # step's are: hetconv.imagesplit._Later), the rest once its passes are done
        later = _Later() if any(isinstance(v, BatchNorm2d) for v in model.layers) else None
        if later is not None:
            reduce.meanwhile = later.drain
        _leave_kernels(model, later)
        cut.later = later
        with backend.scope():
            y = model.forward(backend.to_device(x), step=int(request.step))
            y = backend.to_host(y) if backend.on_device else y
            backend.synchronize()
        return np.ascontiguousarray(y, np.float32)

    kept.version = None  # in doubt until the BACKWARD's update
    kept.cut = cut
    outcome = DONE
    try:
        y = ctx.run(work)
    except RingFailed:  # a sum: no statistics of the whole batch, so no output to answer
        cut.failed = True
        _release(model, int(d.batch))
        y, outcome = np.zeros((0,), np.float32), OWN
    except BaseException:
        _release(model, int(d.batch))
        raise
    compute = time.perf_counter() - start
    return [(Y, y, FLOAT32), ("ring", _outcome_values(outcome, seconds), FLOAT32)], compute


def backward(calls, request: pb.ConvRequest, kept, dy):
    """BACKWARD on ``calls`` for the step ``kept`` holds: (the answer's tensors, the compute
    seconds)."""
    ctx, d = calls.context, request.images
    model, backend = kept.model, ctx.backend
    cut = getattr(kept, "cut", None)
    if cut is None or cut.step != int(request.step) or cut.failed:
        have = "none" if cut is None else f"step {cut.step}" + (" (failed)" if cut.failed else "")
        raise MissingForward(f"cut backward of step {request.step}: no forward of it kept "
                             f"(have {have})")  # fmt: skip
    if dy.shape[0] != cut.count:
        raise InvalidCall(f"dy holds {dy.shape[0]} images, the forward computed {cut.count}")
    kept.cut = None
    names = list(model.parameters())
    start = time.perf_counter()

    def work():
        with backend.scope():
            model.backward(backend.to_device(np.ascontiguousarray(dy, np.float32)))
            if cut.later is not None:
                cut.later.drain()
            backend.synchronize()
        return dict(model.gradients())

    try:
        grads = ctx.run(work)
    except RingFailed:
        grads = None
    finally:
        _release(model, int(d.batch))
    compute = time.perf_counter() - start
    if grads is None:
        outcome, grads, piece = OWN, {n: np.zeros(0, np.float32) for n in names}, np.zeros(0)
    else:
        outcome, grads, piece = calls._sum_and_update(request, kept, names, grads, None,
                                                      cut.seconds)  # fmt: skip
    tensors = [(name, grads[name], FLOAT32) for name in names]
    ring_values, buffers = calls._ring_values(request, model, outcome, cut.seconds)
    tensors += [("ring", ring_values, FLOAT32), ("buffers", buffers, FLOAT32),
                ("slice", np.asarray(piece, np.float32), FLOAT32)]  # fmt: skip
    return tensors, compute


def check_backward(request: pb.ConvRequest, tensors: list[WireTensor], output) -> int:
    """A cut network's BACKWARD carries ``dy`` alone: float32 (count, *output), within the
    batch, no weights placed; returns its bytes."""
    d = request.images
    if [t.name for t in tensors] != [DY] or d.ring.place:
        raise InvalidCall(f"a cut backward carries {DY} alone, got {[t.name for t in tensors]}")
    dy = tensors[0]
    count = dy.shape[0] if dy.shape else 0
    if tuple(dy.shape[1:]) != output or count < 1 or dy.format is not FLOAT32:
        raise InvalidCall(f"dy is {dy.format.label} {dy.shape}, expected float32 (count >= 1, "
                          f"{', '.join(map(str, output))})")  # fmt: skip
    if d.first + count > d.batch:
        raise InvalidCall(f"images {d.first} .. {d.first + count} are not within a batch of "
                          f"{d.batch}")  # fmt: skip
    return FLOAT32.nbytes(tuple(dy.shape))


def _release(model, batch: int) -> None:
    """The model's own layers again (no sums, no rows of a batch, kernel gradients at once)."""
    _take_rows(model, None, batch)
    sync_batchnorm(model, None, batch)
    _leave_kernels(model, None)


def _outcome_values(outcome: int, seconds: dict) -> np.ndarray:
    """A FORWARD's ring values: its outcome (DONE, or OWN where a sum failed) and where its
    time beyond compute went."""
    values = np.zeros(RING_ANSWER_VALUES, np.float32)
    values[0] = outcome
    values[5 : 5 + len(seconds)] = list(seconds.values())
    return values


__all__ = ["CutPass", "DY", "Y", "backward", "check_backward", "forward"]
