"""Dispatch: one phase runner for forward and backward, over a split strategy.

A *split strategy* decides how a layer's work is cut into pieces (one per node, master first),
what each worker is sent for its piece, what the master computes for a piece it covers, and how
answers are put back together. :class:`PhaseRunner` does everything else, the same way for every
strategy and both phases: it sends the workers' pieces concurrently (each call with a deadline
from the probe and the measured link), computes the master's own piece meanwhile, waits, covers
the pieces of workers that failed (the worker is lost; the step completes), records what moved
and how long it took, and splits the time into communication and convolution. An answer that
holds NaN or Inf although every input of its piece was finite is a failure too: a convolution
of finite numbers cannot produce them (short of overflowing float32, which local training would
hit as well), so the worker is broken or lying.
On the steps spot checks are due (:mod:`.spotcheck`), the master also recomputes a small
sample of every worker answer (the job's ``spot_sample``) and an answer off by more than round-off
fails the same way, except that the worker is never re-admitted in the run.

Today's strategy is :class:`KernelSplit` (the paper's): every node gets the same inputs and a
slice of the kernels; feature maps come back into their channel slice of the output; backward
sends each node its slice of the output gradient, and the kernel gradients come back into their
slice while the input-gradient parts are summed.

How the next strategies plug in (each is one new class; the runner does not change):

* **Image split** (data parallel within a layer): ``pieces`` cuts the batch axis by the shares
  instead of the kernel axis; a worker's forward job sends ``x[images]`` and the whole ``w``,
  ``b`` and writes the answer into ``y[images]``; backward sends ``dy[images]`` and *sums* the
  kernel and bias gradients while the input-gradient parts land in ``dx[images]``. The plan's
  shares then count images, not kernels.
* **Fused stages** (:class:`FusedKernelSplit`, built): a worker also runs the channel-local
  layers after its convolution (ReLU, LRN, max-pool): the same kernel pieces, but the forward
  job calls a worker stage that returns pooled maps (written into the pooled output's channel
  slice) and the backward job sends the pooled-map gradient of the owned and halo channels. LRN's
  halo is part of the job: each piece is widened by the stage's halo for computing
  (:mod:`hetconv.stages` derives it) and only the owned channels come back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hetconv.backends import Backend
from hetconv.replica import ReplicaBlock

from .call import Call
from .client import CallStats, WorkerError
from .membership import ACTIVE, Membership, Node
from .planning import LayerPlan
from .replica import BlockGradients
from .split_step import blame_parts, silent_peers
from .spotcheck import (
    Sample,
    SpotChecker,
    kernel_backward_sample,
    kernel_forward_sample,
)

FORWARD, BACKWARD = "forward", "backward"


def split_of(block: ReplicaBlock | None):
    """The :class:`~.replica.SplitStep` of a stage's replicated input block, or None."""
    return block.split if block is not None else None


def lost_forward(block: ReplicaBlock | None, piece: Piece, x: np.ndarray) -> None:
    """A worker piece computed here in a stage forward whose input block is split: its images'
    rows of ``x`` (the block's output, every image) go to the split's other workers."""
    split = split_of(block)
    if split is not None and piece.index and split.covers(piece.node.client.address):
        split.lost_forward(piece.node.client.address, x)


def lost_backward(gradients: BlockGradients | None, piece: Piece, dx) -> bool:
    """A worker piece computed here in a stage backward whose input block is split: its input
    gradient goes to the split's other workers (True), not into the master's. A piece of a
    worker outside the split (lost before the block began: a step computed again after a
    catch) is the master's (False); with the master a peer its rows of the workers' images
    then go with the master's own (:meth:`~.split_step.SplitStep.outside`)."""
    if gradients is None or not piece.index or dx is None:
        return False
    if gradients.lost(piece.node.client.address, dx):
        return True
    split = gradients.split
    if split is not None and split.with_master:
        split.outside(dx)
    return False


def finite(*arrays) -> bool:
    """Whether every value of every array (None: none) is finite. Measured here on 19 MB of
    float32: ``np.isfinite(a).all()`` 0.5 ms (~38 GB/s), faster than a float32 ``a.sum()``
    (0.7 ms, and one that overflows would need this look anyway)."""
    return all(a is None or np.isfinite(a).all() for a in arrays)


def _non_finite(piece: Piece, what: str) -> WorkerError:
    return WorkerError(
        piece.node.name,
        f"{what}: bad answer: NaN or Inf from finite inputs (a convolution of finite numbers "
        "cannot produce them)",
    )


@dataclass(frozen=True)
class Piece:
    """One node's part of a layer: ``part`` along the strategy's split axis (kernels for the
    kernel split), on node number ``index`` (0: the master)."""

    index: int
    node: Node
    part: slice

    @property
    def size(self) -> int:
        return self.part.stop - self.part.start


@dataclass(frozen=True)
class WorkerRequest:
    """What a job asks of a worker for one piece: ``call(*args, timeout=..., **kwargs)``, and
    the bytes it moves both ways (for the call's deadline)."""

    call: Callable[..., Any]
    args: tuple
    kwargs: dict
    nbytes: int


@dataclass(frozen=True)
class CallContext:
    """What every worker call of one layer in one step carries."""

    session: int
    step: int
    layer: str
    overlap_images: int = 0  # fused stage calls: image groups streamed as computed/needed


class PhaseJob(Protocol):
    """One phase (forward or backward) of one layer, cut by a strategy. A job may also have
    ``while_waiting()``: what the master does after its own piece, before it waits for the
    workers' answers (a replicated block's backward, :mod:`.replica`)."""

    phase: str
    images: int

    def worker_request(self, piece: Piece) -> WorkerRequest: ...

    def check(self, piece: Piece, answer) -> None:
        """Raise if a worker's answer for ``piece`` cannot be right (it is then covered)."""

    def compute_locally(self, piece: Piece) -> None:
        """The master computes ``piece`` (its own, or a failed worker's) into the result."""

    def accept(self, piece: Piece, answer) -> CallStats:
        """Put a worker's answer for ``piece`` into the result; its call's figures."""

    def result(self): ...


class SplitStrategy(Protocol):
    """How a layer is cut into pieces and how each phase's answers are reassembled."""

    name: str

    def pieces(self, plan: LayerPlan, nodes: Sequence[Node]) -> list[Piece]: ...

    def forward(self, ctx: CallContext, backend: Backend, x, w, b, sides) -> PhaseJob: ...

    def backward(
        self, ctx: CallContext, backend: Backend, x, w, dy, sides, need_input_grad: bool
    ) -> PhaseJob: ...


class _KernelForward:
    phase = FORWARD

    def __init__(self, ctx: CallContext, backend: Backend, x, w, b, sides):
        self.ctx, self.backend, self.x, self.w, self.b, self.sides = ctx, backend, x, w, b, sides
        self.images = x.shape[0]
        ho = x.shape[2] + sides[0] + sides[1] - w.shape[2] + 1
        wo = x.shape[3] + sides[2] + sides[3] - w.shape[3] + 1
        self.y = np.empty((x.shape[0], w.shape[0], ho, wo), np.float32)

    def worker_request(self, piece: Piece) -> WorkerRequest:
        sl, ctx = piece.part, self.ctx
        return WorkerRequest(
            piece.node.client.forward,
            (ctx.session, ctx.step, ctx.layer, self.x, self.w[sl], self.b[sl], self.sides),
            {"out": self.y[:, sl], "kernel_offset": sl.start},
            self.x.nbytes + self.w[sl].nbytes + self.y[:, sl].nbytes,
        )

    def check(self, piece: Piece, answer) -> None:
        sl = piece.part  # the feature maps arrived in place
        if not finite(self.y[:, sl]) and finite(self.x, self.w[sl], self.b[sl]):
            raise _non_finite(piece, f"forward {self.ctx.layer}")

    def compute_locally(self, piece: Piece) -> None:
        sl = piece.part
        self.y[:, sl] = self.backend.conv_forward(self.x, self.w[sl], self.b[sl], self.sides)

    def accept(self, piece: Piece, answer) -> CallStats:
        return answer[1]  # the feature maps arrived in place (out=)

    def spot_sample(self, piece: Piece, answer, draw: Callable[[int, int], Sample]):
        """Sampled feature maps next to the master's (:mod:`.spotcheck`)."""
        fmt, sample = piece.node.client.wire_format, draw(*self.x.shape[:2])
        return kernel_forward_sample(fmt, self.x, self.w, self.b, self.sides, self.y, sample)

    def result(self):
        return self.y


class _KernelBackward:
    phase = BACKWARD

    def __init__(self, ctx: CallContext, backend: Backend, x, w, dy, sides, need_input_grad):
        self.ctx, self.backend, self.x, self.w, self.dy = ctx, backend, x, w, dy
        self.sides, self.need_input_grad = sides, need_input_grad
        self.images = x.shape[0]
        self.dw = np.empty_like(w)
        self.db = np.empty(w.shape[0], np.float32)
        self.dx = None  # the sum of the input-gradient parts, in the order they are added

    def _add_dx(self, part) -> None:
        if self.need_input_grad:
            self.dx = part if self.dx is None else self.dx + part

    def worker_request(self, piece: Piece) -> WorkerRequest:
        sl, ctx = piece.part, self.ctx
        fmt = piece.node.client.wire_format  # dx comes back in it (dw, db as float32)
        dx_bytes = fmt.nbytes(self.x.shape) if self.need_input_grad else 0
        dw, db = self.dw[sl], self.db[sl]
        return WorkerRequest(
            piece.node.client.backward,
            (ctx.session, ctx.step, ctx.layer, self.dy[:, sl], self.need_input_grad),
            {
                "dw_out": dw,
                "db_out": db,
                "kernel_offset": sl.start,
                "answer_bytes": dw.nbytes + db.nbytes + dx_bytes,
            },
            self.dy[:, sl].nbytes + dw.nbytes + dx_bytes,
        )

    def check(self, piece: Piece, answer) -> None:
        sl, dx_part = piece.part, answer[0]  # kernel gradients arrived in place
        if not finite(self.dw[sl], self.db[sl], dx_part) and finite(
            self.x, self.w[sl], self.dy[:, sl]
        ):
            raise _non_finite(piece, f"backward {self.ctx.layer}")

    def compute_locally(self, piece: Piece) -> None:
        sl = piece.part
        dy_part = np.ascontiguousarray(self.dy[:, sl])
        self.dw[sl], self.db[sl] = self.backend.conv_grad_kernels(
            self.x, dy_part, self.w.shape[2:], self.sides
        )
        if self.need_input_grad:
            self._add_dx(
                self.backend.conv_grad_input(dy_part, self.w[sl], self.x.shape[2:], self.sides)
            )

    def accept(self, piece: Piece, answer) -> CallStats:
        dx_part, _, _, stats = answer  # kernel gradients arrived in place (dw_out=, db_out=)
        self._add_dx(dx_part)
        return stats

    def spot_sample(self, piece: Piece, answer, draw: Callable[[int, int], Sample]):
        """Sampled gradients next to the master's (:mod:`.spotcheck`)."""
        fmt, sample = piece.node.client.wire_format, draw(*self.x.shape[:2])
        return kernel_backward_sample(
            fmt, self.x, self.w, self.dy, self.sides, piece.part, self.dw, self.db, answer[0],
            sample,
        )  # fmt: skip

    def result(self):
        return self.dx, self.dw, self.db


class KernelSplit:
    """The paper's split: the same inputs to every node, a slice of the kernels each."""

    name = "kernels"

    def pieces(self, plan: LayerPlan, nodes: Sequence[Node]) -> list[Piece]:
        return [
            Piece(i, node, slice(plan.starts[i], plan.starts[i] + plan.shares[i]))
            for i, node in enumerate(nodes)
        ]

    def forward(self, ctx, backend, x, w, b, sides) -> PhaseJob:
        return _KernelForward(ctx, backend, x, w, b, sides)

    def backward(self, ctx, backend, x, w, dy, sides, need_input_grad) -> PhaseJob:
        return _KernelBackward(ctx, backend, x, w, dy, sides, need_input_grad)


def _phase_record(stats: CallStats) -> dict:
    return {
        "bytes_sent": stats.bytes_sent,
        "bytes_received": stats.bytes_received,
        "send_seconds": stats.send_seconds,
        "compute_seconds": stats.compute_seconds,
        "receive_seconds": stats.receive_seconds,
        "wall_seconds": stats.wall_seconds,
        "bundled": stats.bundled,
    }


@dataclass
class Started:
    """A phase whose worker calls run (:meth:`PhaseRunner.start`), for its finish."""

    job: PhaseJob
    layer: str
    pieces: list
    calls: list
    covered: list
    at: float  # when the calls started: the phase's start


class PhaseRunner:
    """Runs phase jobs over the membership's nodes and keeps the step's figures.

    Args:
        membership: the nodes (master first); a worker whose call fails is lost through it.
        deadline_floor, deadline_factor: a call may take the floor plus this many times what
            the probe and the measured link predict for it.
        spot_checks: recomputes samples of workers' answers on the steps it is due (a
            mismatch fails the call like a NaN does); None: no checks.
    """

    def __init__(
        self,
        membership: Membership,
        deadline_floor: float,
        deadline_factor: float,
        spot_checks: SpotChecker | None = None,
    ):
        self.membership = membership
        self.deadline_floor, self.deadline_factor = deadline_floor, deadline_factor
        self.spot_checks = spot_checks
        self.start_step()

    def start_step(self) -> None:
        self.records: dict[str, dict] = {}  # node name -> layer -> {"kernels", phase: figures}
        self.comm = self.conv = self.wall = 0.0

    def deadline(self, node: Node, plan: LayerPlan, layer: str, piece: int, nbytes: int, images):
        """Seconds a call may take: a floor plus a multiple of what probe and link predict."""
        t = node.probe_seconds.get(layer, 0.0)
        compute = t * piece / max(plan.shape.k, 1) * images / max(plan.shape.n, 1)
        transfer = nbytes / node.link_bytes_per_second + node.link_latency
        return self.deadline_floor + self.deadline_factor * (compute + transfer)

    def run(self, strategy: SplitStrategy, job: PhaseJob, layer: str, plan: LayerPlan):
        """Run ``job`` over the pieces ``strategy`` cuts ``plan`` into; returns its result."""
        return self.finish(self.start(strategy, job, layer, plan))

    def start(self, strategy: SplitStrategy, job: PhaseJob, layer: str, plan: LayerPlan):
        """Start ``job``'s worker calls (a :class:`Started` for :meth:`finish`): the workers
        compute from now on, while the master may still be computing what its own piece
        needs (a layer whose input is a replicated block: :meth:`Cluster.forward`)."""
        started_at = time.perf_counter()
        pieces = strategy.pieces(plan, self.membership.nodes)
        calls, covered = [], []
        for piece in pieces[1:]:
            if not piece.size:
                continue
            node = piece.node
            if node.state != ACTIVE or node.name in self.membership.failed:
                covered.append(piece)  # lost earlier in this step: the master covers it
                continue
            request = job.worker_request(piece)
            timeout = self.deadline(node, plan, layer, piece.size, request.nbytes, job.images)
            call = Call(request.call, *request.args, timeout=timeout, **request.kwargs)
            calls.append((piece, call))
        return Started(job, layer, pieces, calls, covered, started_at)

    def finish(self, started: Started):
        """Compute the master's piece of a started job, take the workers' answers, cover what
        failed; the job's result."""
        job, layer, pieces = started.job, started.layer, started.pieces
        calls, covered, start = started.calls, started.covered, started.at
        nodes = self.membership.nodes
        t0 = time.perf_counter()
        early = getattr(job, "covers_early", False)
        if early:  # a split block's peers wait for these pieces' parts: computed first
            for piece in covered:
                job.compute_locally(piece)
        own = pieces[0]
        if own.size:
            job.compute_locally(own)
        master_seconds = time.perf_counter() - t0
        # What the master can do with its own part before the workers answer (a replicated
        # block's backward): in the phase, on the master, but not this layer's convolution.
        waiting = getattr(job, "while_waiting", None)
        t0 = time.perf_counter()
        if waiting is not None:
            waiting()
        beside = time.perf_counter() - t0
        # The master's wall in the phase, as a worker's is request to answer: from the phase's
        # start (its calls started) until its own piece and what it does beside are done.
        own_wall = time.perf_counter() - start if own.size else 0.0
        # The answers are taken in node order, whichever call finishes first, so the parts
        # that a job sums (backward's input gradient) are added in a fixed order: the master's
        # own, the pieces it covers, then the workers' in node order (a deterministic run
        # relies on it; tests/test_determinism.py).
        checked = self.spot_checks.seconds if self.spot_checks is not None else 0.0
        done, failed, lost_seconds = self._gather(job, calls, layer, early)
        if self.spot_checks is not None:  # master computation, not communication
            start += self.spot_checks.seconds - checked
        t0 = time.perf_counter()
        for piece in [] if early else covered + failed:
            job.compute_locally(piece)
        master_seconds += time.perf_counter() - t0 + lost_seconds
        computes = [master_seconds + beside]
        if own.size or covered or failed:
            kernels = own.size + sum(p.size for p in covered + failed)
            stats = CallStats(compute_seconds=master_seconds, wall_seconds=own_wall)
            self._record(nodes[0], layer, job.phase, kernels, stats)
        for piece, answer in done:
            stats = job.accept(piece, answer)
            computes.append(stats.compute_seconds)
            self._record(piece.node, layer, job.phase, piece.size, stats)
        self._account(time.perf_counter() - start, computes)
        return job.result()

    def _gather(
        self, job: PhaseJob, calls: list[tuple[Piece, Call]], layer: str, early: bool = False
    ):
        """Wait for every worker call; (answers, failed pieces, seconds the master computed
        failed pieces in). A failed worker, or one whose answer fails the job's check or a
        spot check, is lost. Answers are taken in node order. ``early``: a call that fails
        while the master waits for another is lost at once and its piece computed then (the
        other workers of a split block wait for its parts)."""
        done, failed, seconds = [], [], 0.0
        lost: set[int] = set()
        ended = threading.Event()
        if early:
            for _, call in calls:
                call.notify(ended)

        def lose(piece: Piece, e: BaseException) -> None:
            nonlocal seconds
            self.membership.lose(piece.node, e)
            failed.append(piece)
            lost.add(piece.index)
            if early:
                t0 = time.perf_counter()
                job.compute_locally(piece)
                seconds += time.perf_counter() - t0

        for piece, call in calls:
            while early and not call.done():
                ended.clear()
                for other, pending in calls:  # a failure elsewhere is covered now
                    if other.index not in lost and pending.done() and pending.failed():
                        lose(other, pending.error())
                for other, e in silent_peers(job, calls):  # a peer whose parts never came
                    if other.index not in lost:
                        lose(other, e)
                if not call.done():
                    ended.wait(0.5)
            if piece.index in lost:
                continue
            try:
                answer = call.result()
                if blame_parts(job, piece, self.membership, self.spot_checks, calls):
                    done.append((piece, answer))  # on a peer's wrong part: the step is redone
                    continue
                job.check(piece, answer)
                if self.spot_checks is not None:
                    self.spot_checks.check(job, piece, answer, layer)
                done.append((piece, answer))
            except Exception as e:  # WorkerError, or anything else a broken answer raises
                lose(piece, e)
        return done, failed, seconds

    def _record(self, node: Node, layer: str, phase: str, kernels: int, stats: CallStats):
        per_layer = self.records.setdefault(node.name, {}).setdefault(layer, {"kernels": kernels})
        per_layer[phase] = _phase_record(stats)

    def local(
        self,
        layer: str,
        phase: str,
        kernels: int,
        seconds: float,
        earlier: float = 0.0,
        compute: float | None = None,
    ) -> None:
        """Record and account a convolution the master ran alone (a replicated block's);
        ``earlier``: seconds of it already computed inside another layer's phase (a
        replicated block's backward beside the workers), recorded but not accounted again.
        ``compute``: the seconds of it that were computation, where the rest was waiting for
        workers (a block split with the master a peer); None: all of it."""
        computed = seconds + earlier if compute is None else compute
        self._record(self.membership.nodes[0], layer, phase, kernels, CallStats(
            compute_seconds=computed, wall_seconds=seconds
        ))  # fmt: skip
        self._account(seconds, [seconds if compute is None else min(compute, seconds)])

    def _account(self, wall: float, computes: list[float]) -> None:
        conv = max(computes, default=0.0)
        self.conv += conv
        self.comm += max(wall - conv, 0.0)
        self.wall += wall
