"""Fused stages over the nodes (:class:`FusedKernelSplit`): each node runs its kernel slice's
convolution and the channel-local layers after it (ReLU, LRN, max-pool, batch norm), widened by
the stage's halo; the master gathers the owned channels of the stage's output, and backward
sends each node the gradient of its owned and halo channels (:mod:`.dispatch` runs the
phases)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hetconv.backends import Backend
from hetconv.layers import BatchNorm2d
from hetconv.replica import ReplicaBlock
from hetconv.stages import (
    BatchNormSlice,
    StageRun,
    StageSpec,
    batch_statistics_rows,
    batchnorm_grad_rows,
    stage_backward,
    stage_forward,
)

from .client import CallStats, WorkerError
from .dispatch import (
    BACKWARD,
    FORWARD,
    CallContext,
    KernelSplit,
    PhaseJob,
    Piece,
    WorkerRequest,
    _non_finite,
    finite,
    lost_backward,
    lost_forward,
    split_of,
)
from .replica import BlockGradients, input_bytes, replica_input_grad
from .spotcheck import (
    Sample,
    stage_backward_sample,
    stage_forward_sample,
)


def _batchnorm_slices(batchnorm: Sequence[BatchNorm2d], wide: slice) -> list[BatchNormSlice]:
    return [BatchNormSlice.of(layer, wide) for layer in batchnorm]


def _check_rows(piece: Piece, what: str, got: np.ndarray, rows: int) -> None:
    """A worker's batch norm answer must have ``rows`` rows of the piece's kernels."""
    expected = (rows, piece.size)
    if got.shape != expected:
        raise WorkerError(
            piece.node.name, f"{what}: batch norm answer has shape {got.shape}, expected {expected}"
        )
    if not finite(got):
        raise _non_finite(piece, what)


def track_statistics(
    batchnorm: Sequence[BatchNorm2d], counts: Sequence[int], part: slice, stats: np.ndarray
) -> None:
    """Move the running statistics of ``part`` of each of ``batchnorm`` (over ``counts`` values
    per channel) by a worker's rows of batch mean and variance, ``stats`` (two per layer)."""
    for i, (layer, count) in enumerate(zip(batchnorm, counts, strict=True)):
        mean, var = stats[2 * i].astype(np.float64), stats[2 * i + 1].astype(np.float64)
        layer.track(mean, var, count, part)


class _StageForward:
    """A fused stage's forward (:mod:`hetconv.stages`): each node computes its kernels widened
    by the stage's halo, runs the stage's layers and answers its owned kernels' output, written
    into their channel slice of the stage output.

    ``batchnorm``: the model's :class:`~hetconv.layers.BatchNorm2d` layers of the stage, in
    order. Each node gets their weight and bias of its widened slice (and in evaluation their
    running statistics); training, each piece's batch statistics move the layers' running
    statistics of its channels as they are taken (:meth:`~hetconv.layers.BatchNorm2d.track`;
    ``num_batches_tracked`` is the model's to count, once per step). Statistics the master
    computes itself are rounded to float32 as the workers' travel, so the result does not
    depend on who computed which piece."""

    phase = FORWARD

    def __init__(
        self, ctx: CallContext, backend: Backend, x, w, b, sides, stage, runs, batchnorm,
        replica: ReplicaBlock | None = None,
    ):  # fmt: skip
        self.ctx, self.backend, self.x, self.w, self.b = ctx, backend, x, w, b
        self.sides, self.stage, self.runs = sides, stage, runs
        self.replica = replica  # workers compute x themselves from it (hetconv.replica)
        self.batchnorm = list(batchnorm)
        self.training = all(layer.training for layer in self.batchnorm)
        self.kernels = w.shape[0]
        self.images = x.shape[0]
        ho = x.shape[2] + sides[0] + sides[1] - w.shape[2] + 1
        wo = x.shape[3] + sides[2] + sides[3] - w.shape[3] + 1
        self.y = np.empty((x.shape[0], self.kernels, *stage.output_hw((ho, wo))), np.float32)
        self.counts = [x.shape[0] * h * w for h, w in stage.batchnorm_hw((ho, wo))]

    def _wide(self, piece: Piece) -> tuple[slice, slice]:
        own = piece.part
        wide = self.stage.widened(own, self.kernels)
        return wide, slice(own.start - wide.start, own.stop - wide.start)

    def worker_request(self, piece: Piece) -> WorkerRequest:
        (wide, own), ctx, sl = self._wide(piece), self.ctx, piece.part
        w, b = self.w[wide], self.b[wide]
        batchnorm = _batchnorm_slices(self.batchnorm, wide)
        bn_bytes = sum(4 * 4 * (wide.stop - wide.start) for _ in batchnorm)
        kwargs = {"out": self.y[:, sl], "kernel_offset": wide.start, "batchnorm": batchnorm}
        if self.replica is not None:
            kwargs["replica"] = self.replica
        if ctx.overlap_images:
            kwargs["overlap_images"] = ctx.overlap_images
        return WorkerRequest(
            piece.node.client.stage_forward,
            (ctx.session, ctx.step, ctx.layer, self.x, w, b, self.sides, self.stage, own),
            kwargs,
            input_bytes(self.x, self.replica) + w.nbytes + self.y[:, sl].nbytes + bn_bytes,
        )

    def check(self, piece: Piece, answer) -> None:
        wide, _ = self._wide(piece)
        what = f"stage forward {self.ctx.layer}"
        if not finite(self.y[:, piece.part]) and finite(self.x, self.w[wide], self.b[wide]):
            raise _non_finite(piece, what)
        _check_rows(piece, what, answer[1], 2 * len(self.batchnorm) if self.training else 0)

    def _track(self, part: slice, stats: np.ndarray) -> None:
        """Move the running statistics of ``part`` by its rows of batch mean and variance."""
        if self.training:
            track_statistics(self.batchnorm, self.counts, part, stats)

    @property
    def covers_early(self) -> bool:
        """Whether a lost piece is computed as soon as it is lost (:class:`PhaseRunner`)."""
        return split_of(self.replica) is not None

    def compute_locally(self, piece: Piece) -> None:
        lost_forward(self.replica, piece, self.x)
        wide, own = self._wide(piece)
        batchnorm = _batchnorm_slices(self.batchnorm, wide)
        y, run = stage_forward(
            self.backend, self.x, self.w[wide], self.b[wide], self.sides, self.stage, own, batchnorm
        )
        self.y[:, piece.part] = y
        self.runs[self.ctx.layer, piece.part.start, piece.part.stop] = run
        self._track(piece.part, batch_statistics_rows(run))

    def accept(self, piece: Piece, answer) -> CallStats:
        _, stats, call_stats = answer  # the stage output arrived in place (out=)
        self._track(piece.part, stats)
        return call_stats

    def spot_sample(self, piece: Piece, answer, draw: Callable[[int, int], Sample]):
        """Sampled stage outputs next to the master's (:mod:`.spotcheck`)."""
        fmt, sample = piece.node.client.wire_format, draw(*self.x.shape[:2])
        bn = _batchnorm_slices(self.batchnorm, slice(0, self.w.shape[0]))  # every image's
        # x travelled in fmt, unless the worker computed it (a replicated block: float32)
        received = self.x if self.replica is not None else None
        return stage_forward_sample(
            fmt, self.x, self.w, self.b, self.sides, self.stage, self.y, sample, bn, received
        )

    def result(self):
        return self.y


class _StageBackward:
    """A fused stage's backward: each node gets the stage-output gradient of its owned and halo
    channels and answers its owned kernels' gradients (into their slice) and input-gradient part
    (summed). A piece the master covers uses what its own forward kept, or recomputes that
    forward (a worker lost between the two phases)."""

    phase = BACKWARD

    def __init__(
        self, ctx, backend, x, w, b, dy, sides, need_input_grad, stage, runs, batchnorm,
        replica: BlockGradients | None = None,
    ):  # fmt: skip
        self.ctx, self.backend, self.x, self.w, self.b, self.dy = ctx, backend, x, w, b, dy
        self.sides, self.need_input_grad = sides, need_input_grad
        self.stage, self.runs = stage, runs
        self.replica = replica  # workers answer the replicated block's gradient parts into it
        self.kernels = w.shape[0]
        self.images = x.shape[0]
        self.dw = np.empty_like(w)
        self.db = np.empty(w.shape[0], np.float32)
        self.dx = None
        # the batch norms' weight and bias gradients, filled piece by piece
        self.batchnorm = list(batchnorm)
        for layer in self.batchnorm:
            layer.grads = {name: np.zeros_like(p) for name, p in layer.params.items()}

    def _take_dbn(self, part: slice, dbn: np.ndarray) -> None:
        for i, layer in enumerate(self.batchnorm):
            layer.grads["weight"][part], layer.grads["bias"][part] = dbn[2 * i], dbn[2 * i + 1]

    def _ranges(self, piece: Piece) -> tuple[slice, slice]:
        wide = self.stage.widened(piece.part, self.kernels)
        return wide, self.stage.grad_range(piece.part, self.kernels)

    def worker_request(self, piece: Piece) -> WorkerRequest:
        (wide, grad), ctx, sl = self._ranges(piece), self.ctx, piece.part
        fmt = piece.node.client.wire_format
        dx_bytes = fmt.nbytes(self.x.shape) if self.need_input_grad else 0
        dw, db, dy = self.dw[sl], self.db[sl], self.dy[:, grad]
        dbn_bytes = 2 * 4 * len(self.batchnorm) * piece.size
        kwargs = {"dw_out": dw, "db_out": db, "kernel_offset": wide.start}
        if self.replica is not None:
            kwargs["replica"] = self.replica.request(piece.index)
            dx_bytes = self.replica.nbytes
        kwargs["answer_bytes"] = dw.nbytes + db.nbytes + dbn_bytes + dx_bytes
        if ctx.overlap_images:
            kwargs["grouped"] = True
        return WorkerRequest(
            piece.node.client.stage_backward,
            (ctx.session, ctx.step, ctx.layer, dy, grad.start - wide.start, self.need_input_grad),
            kwargs,
            dy.nbytes + dw.nbytes + dbn_bytes + dx_bytes,
        )

    def check(self, piece: Piece, answer) -> None:
        sl, dx_part = piece.part, answer[0]
        wide, grad = self._ranges(piece)
        through = self.replica.part(piece.index) if self.replica is not None else ()
        if not finite(self.dw[sl], self.db[sl], dx_part, *through) and finite(
            self.x, self.w[wide], self.dy[:, grad]
        ):
            raise _non_finite(piece, f"stage backward {self.ctx.layer}")
        _check_rows(piece, f"stage backward {self.ctx.layer}", answer[3], 2 * len(self.batchnorm))

    def compute_locally(self, piece: Piece) -> None:
        wide, grad = self._ranges(piece)
        sl = piece.part
        run: StageRun | None = self.runs.pop((self.ctx.layer, sl.start, sl.stop), None)
        if run is None:  # the worker's forward ran there: run it again here
            # (training: the same batch statistics; the running ones moved by them once, then)
            own = slice(sl.start - wide.start, sl.stop - wide.start)
            batchnorm = _batchnorm_slices(self.batchnorm, wide)
            _, run = stage_forward(
                self.backend, self.x, self.w[wide], self.b[wide], self.sides, self.stage, own,
                batchnorm,
            )  # fmt: skip
        dy = np.ascontiguousarray(self.dy[:, grad])
        rel = slice(grad.start - wide.start, grad.stop - wide.start)
        first = self.replica.rows_first(piece.index) if self.replica is not None else ()
        dx, self.dw[sl], self.db[sl] = stage_backward(
            self.backend, run, dy, rel, self.need_input_grad, rows_first=first
        )
        if not lost_backward(self.replica, piece, dx):
            self._add_dx(dx)
        self._take_dbn(sl, batchnorm_grad_rows(run))

    @property
    def covers_early(self) -> bool:
        """Whether a lost piece is computed as soon as it is lost (:class:`PhaseRunner`)."""
        return self.replica is not None and self.replica.split is not None

    def _add_dx(self, part) -> None:
        if self.need_input_grad:
            self.dx = part if self.dx is None else self.dx + part

    def accept(self, piece: Piece, answer) -> CallStats:
        dx_part, _, _, dbn, stats = answer
        if self.replica is not None:
            self.replica.take(piece.index, piece.node.client.address)
        else:
            self._add_dx(dx_part)
        self._take_dbn(piece.part, dbn)
        return stats

    def spot_sample(self, piece: Piece, answer, draw: Callable[[int, int], Sample]):
        """Sampled kernel gradients next to the master's (:mod:`.spotcheck`)."""
        if self.batchnorm:
            # Its gradients sum over the batch, where a normalised value within round-off of a
            # ReLU's zero can go either way (the forward is sampled, spotcheck.py).
            return None
        fmt, sample = piece.node.client.wire_format, draw(*self.x.shape[:2])
        received = self.x if self.replica is not None else None  # as the forward's sample
        return stage_backward_sample(
            fmt, self.x, self.w, self.b, self.dy, self.sides, self.stage, self.dw, self.db,
            sample, received=received,
        )  # fmt: skip

    def while_waiting(self) -> None:
        """With a replicated block before the layer, the master's input-gradient part goes
        back through the block now, while the workers compute (:class:`BlockGradients`)."""
        if self.replica is not None and self.replica.back_through(self.dx):
            self.dx = None

    def result(self):
        dx = self.replica.later(self.dx) if self.replica is not None else self.dx
        return replica_input_grad(dx, self.x, self.replica), self.dw, self.db


class FusedKernelSplit(KernelSplit):
    """Fused worker stages: the kernel split's pieces, each node also running the channel-local
    layers after the convolution on its slice (:mod:`hetconv.stages`), halo included.

    Its jobs take the stage besides the convolution's tensors. What the master's own forward
    pieces keep for their backward is held here, per layer, until that backward takes it.
    """

    name = "fused"

    def __init__(self):
        self._runs: dict[tuple[str, int, int], StageRun] = {}

    def forward(
        self,
        ctx,
        backend,
        x,
        w,
        b,
        sides,
        stage: StageSpec | None = None,
        batchnorm=(),
        replica: ReplicaBlock | None = None,
    ) -> PhaseJob:
        """``batchnorm``: the model's batch norm layers of the stage (see ``_StageForward``).
        ``replica``: ``x`` is that replicated block's output, which workers compute."""
        if stage is None:
            raise ValueError(f"{ctx.layer}: a fused forward needs its stage")
        _check_batchnorm(ctx.layer, stage, batchnorm)
        for key in [k for k in self._runs if k[0] == ctx.layer]:
            del self._runs[key]  # an earlier step's, whose backward never came (evaluation)
        return _StageForward(ctx, backend, x, w, b, sides, stage, self._runs, batchnorm, replica)

    def backward(
        self,
        ctx,
        backend,
        x,
        w,
        dy,
        sides,
        need_input_grad,
        b=None,
        stage: StageSpec | None = None,
        batchnorm=(),
        replica: BlockGradients | None = None,
    ) -> PhaseJob:
        """``batchnorm``: as forward's; their ``grads`` are set (weight and bias).
        ``replica``: the layer's input came from a replicated block; workers answer its gradient
        parts into it, and the input gradient returned is the master's part."""
        if stage is None or b is None:
            raise ValueError(f"{ctx.layer}: a fused backward needs its stage and biases")
        _check_batchnorm(ctx.layer, stage, batchnorm)
        return _StageBackward(
            ctx, backend, x, w, b, dy, sides, need_input_grad, stage, self._runs, batchnorm,
            replica,
        )  # fmt: skip


def _check_batchnorm(layer: str, stage: StageSpec, batchnorm: Sequence[BatchNorm2d]) -> None:
    if len(batchnorm) != stage.batchnorms:
        raise ValueError(
            f"{layer}: the stage has {stage.batchnorms} batch norm layers, {len(batchnorm)} came"
        )
    if len({layer.training for layer in batchnorm}) > 1:
        raise ValueError(f"{layer}: the stage's batch norm layers are not all in one mode")
