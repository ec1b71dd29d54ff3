"""Overlap of transfer and compute within a fused stage call (``ConvRequest.overlap_images``).

A stage forward that names ``overlap_images`` runs its stage on groups of that many images, in
order, on the device thread, and its answer streams each group's output as soon as it is
computed: the answer's header goes first (its ConvResult says ``timings_follow``), the bytes of
group g travel while group g + 1 computes, and a last ConvResult carries the call's timings.
The forward keeps one :class:`~hetconv.stages.StageRun` per group (:class:`GroupedRun`), and
the matching stage backward starts on a group as soon as that group's rows of ``dy`` have
arrived, while the rest of ``dy`` is still on the wire; the groups' kernel gradients are
summed in group order and their input-gradient rows put together.

Exactness: every layer of a stage is per image (a stage holding batch norm, whose statistics
are the whole batch's, is refused), so a group's output rows are those of the whole batch's
forward; the kernel gradients are sums over the groups, equal to the whole batch's to float32
round-off.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field

import numpy as np

from hetconv.errors import InvalidCall
from hetconv.formats import TensorFormat
from hetconv.proto import worker_pb2 as pb
from hetconv.stages import StageRun, StageSpec, stage_backward, stage_forward
from hetconv.wire import chunks
from hetconv.worker.context import WorkerContext


def image_groups(n: int, per_group: int) -> list[slice]:
    """``n`` images in consecutive groups of ``per_group`` (the last may hold fewer)."""
    if per_group < 1:
        raise ValueError(f"per_group must be >= 1, got {per_group}")
    return [slice(i, min(i + per_group, n)) for i in range(0, n, per_group)]


def check_overlap(request: pb.ConvRequest, spec: StageSpec, n: int) -> list[slice] | None:
    """The image groups a stage forward asks for (None: the whole batch at once).

    Raises:
        InvalidCall: overlap asked of a stage that holds batch norm.
    """
    if not request.overlap_images:
        return None
    if spec.batchnorms:
        raise InvalidCall(
            f"overlap_images {request.overlap_images} with a stage that holds "
            f"{spec.batchnorms} batch norm layers: their statistics are the whole batch's; "
            "send overlap_images 0"
        )
    return image_groups(n, request.overlap_images)


@dataclass
class GroupedRun:
    """A stage forward run group by group: one :class:`StageRun` per image group, standing in
    for the whole batch's run where a stage backward reads one (no batch norm: none)."""

    groups: list[slice]
    runs: list[StageRun]
    x: np.ndarray  # the whole input (each run's x is a view of its rows)
    w: np.ndarray

    @property
    def own(self) -> slice:
        return self.runs[0].own

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.groups[-1].stop, *self.runs[0].out_shape[1:])

    @property
    def layers(self) -> list:
        return [layer for run in self.runs for layer in run.layers]

    def batch_statistics(self) -> list:
        return []

    def batchnorm_grads(self) -> list:
        return []


@dataclass
class Streamed:
    """An answer whose bytes are sent as they are computed.

    ``tensors``: every answer tensor's (name, shape, format), in order; ``parts``: (tensor
    index, array) pairs whose bytes, in order, are those of the tensors (the first tensor's
    image groups, then the rest), each produced when it is ready; ``compute_s`` is known once
    they are exhausted.
    """

    tensors: list[tuple[str, tuple[int, ...], TensorFormat]]
    parts: Iterator[tuple[int, np.ndarray]]  # (tensor index, rows of it)
    started: float
    receive_s: float
    compute_s: float = field(default=0.0)

    @property
    def nbytes(self) -> int:
        return sum(fmt.nbytes(shape) for _, shape, fmt in self.tensors)

    def head(self) -> pb.ConvMessage:
        headers = [fmt.header(name, shape) for name, shape, fmt in self.tensors]
        return pb.ConvMessage(result=pb.ConvResult(tensors=headers, timings_follow=True))

    def segments(self) -> Iterator[memoryview]:
        """Each part's wire bytes, as it is produced; then the timings are known."""
        for index, part in self.parts:
            name, _, fmt = self.tensors[index]
            yield from fmt.encode(part, name)
        self.compute_s = time.perf_counter() - self.started

    def trailer(self) -> pb.ConvMessage:
        return pb.ConvMessage(
            result=pb.ConvResult(compute_seconds=self.compute_s, receive_seconds=self.receive_s)
        )

    def messages(self) -> Iterator:
        """The whole answer stream: header, data chunks as computed, timings."""
        yield self.head()
        yield from chunks(self.segments())
        yield self.trailer()

    def collect(self) -> tuple[list[tuple[str, np.ndarray, TensorFormat]], float, float]:
        """The answer at once (a unary call): (tensors, compute, receive)."""
        got: list[list[np.ndarray]] = [[] for _ in self.tensors]
        for index, part in self.parts:
            got[index].append(part)
        self.compute_s = time.perf_counter() - self.started
        arrays = [
            np.concatenate(p) if len(p) > 1 else p[0] if p else np.zeros(shape, np.float32)
            for p, (_, shape, _) in zip(got, self.tensors, strict=True)
        ]
        answer = [(n, a, f) for a, (n, _, f) in zip(arrays, self.tensors, strict=True)]
        return answer, self.compute_s, self.receive_s


def forward_groups(
    device,
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray,
    padding,
    spec: StageSpec,
    own: slice,
    groups: Sequence[slice],
    keep: Callable[[GroupedRun], None],
) -> Iterator[np.ndarray]:
    """Every group's stage output (``x``'s rows of each group through the stage of the widened
    slice ``w``, ``b``; the ``own`` kernels' output), in order, as each is computed: all are
    queued on the device thread now, so group g + 1 computes while group g travels (``device``:
    a :class:`~hetconv.worker.context.WorkerContext`, or anything with its ``backend`` and
    ``submit``). ``keep`` gets the :class:`GroupedRun` once the last group is done, before its
    output is handed on. The groups share one kernel memo
    (:meth:`~hetconv.backends.Backend.kernel_memo`): ``w`` is rearranged for the device once,
    not once per group."""
    backend = device.backend
    memo = backend.kernel_memo()
    w, b = backend.to_device(w), backend.to_device(b)  # once for every group

    def work(g: slice):
        with memo:
            out = stage_forward(backend, x[g], w, b, padding, spec, own)
        backend.synchronize()
        return out

    pending = [device.submit(lambda g=g: work(g)) for g in groups]
    return _outputs(pending, lambda runs: keep(GroupedRun(list(groups), runs, x, w)))


def _outputs(pending: list[futures.Future], keep) -> Iterator[np.ndarray]:
    runs: list[StageRun] = []
    try:
        for i, job in enumerate(pending):
            y, run = job.result()
            runs.append(run)
            if i == len(pending) - 1:
                keep(runs)
            yield y
    finally:
        for job in pending:
            job.cancel()  # a call that ended early: what has not started never does


def grad_range(run, dy_shape: Sequence[int], grad_start: int) -> slice:
    """The channels of the forward's widened slice that a stage backward's ``dy`` covers.

    Raises:
        InvalidCall: ``dy`` is not (N, channels, Ho', Wo') of the forward, or its channels do
            not cover the owned ones within those computed.
    """
    n, computed, *out_hw = run.out_shape
    if len(dy_shape) != 4 or dy_shape[0] != n or list(dy_shape[2:]) != out_hw:
        raise InvalidCall(
            f"dy has shape {tuple(dy_shape)}, expected ({n}, channels, {out_hw[0]}, {out_hw[1]})"
        )
    grad = slice(grad_start, grad_start + dy_shape[1])
    if not (grad.start <= run.own.start and run.own.stop <= grad.stop <= computed):
        raise InvalidCall(
            f"dy covers channels {grad.start}..{grad.stop - 1} of the {computed} computed; "
            f"it must cover the owned {run.own.start}..{run.own.stop - 1} and stay within"
        )
    return grad


class GroupedStart:
    """The receiving half of a stage backward: on its first bytes of ``dy`` it looks up the
    forward's run (``kept_for(request)``); when that forward ran in image groups, each group's
    backward starts as soon as its rows are in (:meth:`progress`, the receive loop's hook)."""

    def __init__(self, context: WorkerContext, kept_for: Callable[[pb.ConvRequest], object]):
        self.context, self.kept_for = context, kept_for
        self.started: float | None = None  # when the first group was queued
        self._looked = False
        self._backward: GroupedBackward | None = None

    def progress(self, request: pb.ConvRequest, receiver) -> None:
        if not self._looked:
            self._looked = True
            run = self.kept_for(request)
            if not isinstance(run, GroupedRun):
                return
            grad = grad_range(run, receiver.arrays[0].shape, request.stage.grad_start)
            need = request.need_input_grad or bool(request.replica_layer)
            submit, backend = self.context.submit, self.context.backend
            self._backward = GroupedBackward(submit, backend, run, grad, need)
            self.started = time.perf_counter()
        if self._backward is not None:
            self._backward.progress(receiver)

    def result(self, on_device: bool = False) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        assert self._backward is not None
        return self._backward.result(on_device)


class GroupedBackward:
    """A stage backward over a :class:`GroupedRun`, each group started on the device thread
    as soon as its rows of ``dy`` have arrived (:meth:`progress`, from the receive loop).

    The groups add their kernel gradients to one sum (:meth:`~hetconv.backends.Backend
    .kernel_gradient_sum`, in group order: the device thread runs them in turn) and share one
    kernel memo, so the kernels are rearranged for the input gradient once and the kernel
    gradient is rearranged once, not once per group."""

    def __init__(
        self,
        submit: Callable[[Callable[[], object]], futures.Future],
        backend,
        run: GroupedRun,
        grad: slice,
        need_input_grad: bool,
    ):
        self.submit, self.backend, self.run = submit, backend, run
        self.grad, self.need = grad, need_input_grad
        self.jobs: list[futures.Future] = []
        self.memo = backend.kernel_memo()
        self.kernel_sum = backend.kernel_gradient_sum()

    def progress(self, receiver) -> None:
        """Start every group whose rows of ``dy`` (the receiver's first tensor) are all in."""
        groups, dy = self.run.groups, receiver.arrays[0]
        received_rows = receiver.rows_in(0)
        while len(self.jobs) < len(groups) and groups[len(self.jobs)].stop <= received_rows:
            g = groups[len(self.jobs)]
            receiver.decode_rows(0, g)
            run = self.run.runs[len(self.jobs)]

            def work(run=run, rows=dy[g]):
                with self.memo:
                    out = stage_backward(
                        self.backend, run, rows, self.grad, self.need, self.kernel_sum
                    )
                self.backend.synchronize()
                return out

            self.jobs.append(self.submit(work))

    def result(self, on_device: bool = False) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """(input-gradient part or None, dw, db) of the whole batch: kernel gradients summed
        in group order (left on the backend's device with ``on_device``: a resident slice's
        update runs there)."""
        if len(self.jobs) != len(self.run.groups):
            raise InvalidCall(
                f"dy ended after {len(self.jobs)} of {len(self.run.groups)} image groups"
            )
        outs = [job.result() for job in self.jobs]
        dw, db = self.kernel_sum.result()
        if not on_device:
            dw, db = self.backend.to_host(dw), self.backend.to_host(db)
        dx = np.concatenate([o[0] for o in outs]) if self.need else None
        return dx, dw, db


__all__ = [
    "GroupedBackward",
    "GroupedRun",
    "GroupedStart",
    "grad_range",
    "Streamed",
    "check_overlap",
    "forward_groups",
    "image_groups",
]
