"""Resident kernels: workers keep their kernel slices and SGD state between steps.

With ``ClusterConfig.kernels`` ``"resident"`` (``hetconv train --kernels resident``; ``auto``
picks it per layer by the cost model), a fused layer's kernels (:mod:`hetconv.stages`) do not
cross the link each step. Each worker holds its slice of the layer (weights, biases and their
momentum buffers) and applies the SGD update itself at the end of its backward; the master's
optimizer skips the layer (:meth:`ResidentKernels.parameters`), and the master updates the rows
it computes itself (its own share and the slices it covers) with the same elementwise rule
(:func:`hetconv.optim.sgd_update`), so every row gets bitwise the update local training gives
it from the same gradient.

The wire (:mod:`hetconv.calls`): ``PlaceKernels`` puts a slice on a worker with a version;
``ResidentStageForward`` sends only the input and the slice's *halo* kernels (the neighbours'
kernels the stage's LRN reads, ``size - 1`` on each side) and names the version it expects;
``ResidentStageBackward`` sends the stage-output gradient as the fused call does and gets back
the input-gradient part and the slice's updated *edge* kernels (those within the halo width of
its ends: its neighbours' next halo), no kernel gradients; the version goes up by one.
``FetchKernels`` returns a slice (weights and momentum) for checkpoints, ``--save``, share
changes and syncs. A worker that holds another version refuses (FAILED_PRECONDITION, naming
both): a stale slice is never computed with.

So per step and worker the link carries the halo out and the edges back: ``2 * halo`` kernels
each way (8 for LRN size 5) instead of the slice out and its gradient back.

Nothing lost, by replay. For each placed slice the master keeps the copy it last synced
(weights, biases, momentum: placed or fetched) and, for every step since whose update the
worker made, what recomputing that update needs and the master has anyway: the layer input it
sent, the halo it sent and the stage-output gradient slice it sent. When the worker is lost
(a call fails, or its answer is refused), the master replays the slice's updates from the sync
(the stage's forward and backward on the slice, then the SGD rule), so it holds the slice
exactly as the worker did, and covers it like any lost worker's piece. The log is bounded by a
sync every ``sync_every`` steps (FetchKernels of every slice; the bytes are counted in the step
record under ``resident``) or sooner when it outgrows ``log_limit_bytes``.

When shares change (a worker joins or is lost, a rebalance), a slice whose range moved is
fetched (or replayed, its worker gone) into the master's arrays and the new ranges are placed
with new versions before the layer's next forward.

A split head (:mod:`hetconv.head`): the layer's slices also hold the final fc's columns of
their channels (a view of the model's fc weight, :func:`~hetconv.head.head_columns`) and their
momentum, placed, fetched, updated, logged and replayed with the kernels; forward answers
partial logits, which the master sums (:attr:`_ResidentForward.result`), and backward sends the
logits' gradient. The halo and edge rows carry the halo and edge channels' columns too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hetconv.backends import Backend
from hetconv.formats import FLOAT32
from hetconv.head import columns_grad, head_columns, partial_logits, stage_grad
from hetconv.optim import SGDConfig, sgd_update
from hetconv.resident import edge_rows, placement_version
from hetconv.stages import StageRun, StageSpec, stage_backward, stage_forward

from .client import CallStats, WorkerError
from .dispatch import (
    BACKWARD,
    FORWARD,
    CallContext,
    FusedKernelSplit,
    PhaseJob,
    Piece,
    WorkerRequest,
    _non_finite,
    finite,
    lost_backward,
    lost_forward,
    split_of,
)
from .membership import ACTIVE, Membership, Node
from .replica import input_bytes, replica_input_grad
from .spotcheck import stage_forward_sample

#: Steps between syncs of every resident slice (FetchKernels), bounding the replay log.
DEFAULT_SYNC_EVERY = 20
#: The replay log's bytes per layer beyond which its slices are synced early.
DEFAULT_LOG_LIMIT = 512 << 20


@dataclass
class _Logged:
    """One step of a slice's updates, as the master can recompute it."""

    x: np.ndarray  # the layer input (shared by the layer's slices)
    hw: np.ndarray
    hb: np.ndarray
    hf: np.ndarray  # the halo's fc columns of a split head; (halo, 0, 0) without
    # the stage-output gradient of the slice's gradient range; with a split head, the
    # logits' gradient (N, classes), shared by the layer's slices
    dy: np.ndarray
    grad_start: int  # within the widened slice
    step: int = -1


@dataclass
class Placement:
    """A slice on a worker: its kernels, version, last synced copy and updates since."""

    node: Node
    part: slice
    version: int
    synced: tuple[np.ndarray, ...]  # w, b, mw, mb, f, mf (ResidentLayer.arrays)
    synced_started: bool
    synced_step: int
    log: list[_Logged] = field(default_factory=list)
    pending: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def log_bytes(self) -> int:
        return sum(e.dy.nbytes + e.hw.nbytes + e.hf.nbytes for e in self.log)


def as_received(array: np.ndarray, fmt) -> np.ndarray:
    """A copy of ``array`` as a worker receives it in wire format ``fmt`` (rounded when the
    format is 16-bit): what the replay log must keep to recompute the worker's update."""
    if fmt.exact:
        return np.array(array)
    return fmt.to_host(fmt.to_wire(array))


class ResidentLayer:
    """One layer's resident state on the master: the model's weight and bias arrays (current
    for every row no worker holds, and for the edge rows of those that do), the momentum
    buffers of the same rows, and the placements.

    ``head``: a split head, (the fc's name, its weight (classes, C * P)): ``f`` is then that
    weight's (C, P, classes) view (:func:`~hetconv.head.head_columns`) and ``mf`` its momentum;
    without, both are (C, 0, 0).
    """

    def __init__(self, name: str, w: np.ndarray, b: np.ndarray, stage: StageSpec, sides, head=None):
        self.name, self.w, self.b, self.stage, self.sides = name, w, b, stage, sides
        self.mw = np.zeros_like(w)
        self.mb = np.zeros_like(b)
        self.head_name, self.head_weight = head if head is not None else (None, None)
        if self.head_weight is not None:
            self.f = head_columns(self.head_weight, w.shape[0])
            self.mf = np.zeros(self.f.shape, np.float32)
        else:
            self.f = self.mf = np.empty((w.shape[0], 0, 0), np.float32)
        self.started = False  # whether the momentum buffers hold momentum yet
        self.placements: dict[str, Placement] = {}

    @property
    def kernels(self) -> int:
        return self.w.shape[0]

    @property
    def classes(self) -> int:
        """The split head's classes; 0 without one."""
        return self.f.shape[2]

    def arrays(self) -> tuple[np.ndarray, ...]:
        """What a slice holds, per kernel row: w, b, mw, mb, f, mf (the model's arrays and
        views of them, so writing rows writes the model)."""
        return self.w, self.b, self.mw, self.mb, self.f, self.mf

    def wide(self, part: slice) -> slice:
        return self.stage.widened(part, self.kernels)

    def halo(self, part: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(hw, hb, hf, halo_before): the widened slice's kernels (and split head columns)
        that are not ``part``'s."""
        wide = self.wide(part)
        before, after = slice(wide.start, part.start), slice(part.stop, wide.stop)
        hw, hb, hf = (
            np.ascontiguousarray(np.concatenate([a[before], a[after]]))  # f's rows are strided
            for a in (self.w, self.b, self.f)
        )
        return hw, hb, hf, part.start - wide.start

    def update_rows(
        self, part: slice, dw: np.ndarray, db: np.ndarray, config: SGDConfig, df=None
    ) -> None:
        """The SGD update of rows ``part`` (the master computed their gradients; ``df``
        their split head columns' gradient)."""
        w, b, mw, mb = self.w[part], self.b[part], self.mw[part], self.mb[part]
        bw = sgd_update(w, dw, mw if self.started else None, config)
        bb = sgd_update(b, db, mb if self.started else None, config)
        if bw is not None:
            mw[...], mb[...] = bw, bb
        if df is not None:
            f = np.array(self.f[part])  # the view is strided: update a copy, write it back
            bf = sgd_update(f, df, self.mf[part] if self.started else None, config)
            self.f[part] = f
            if bf is not None:
                self.mf[part] = bf

    def log_bytes(self) -> int:
        """What the replay logs of this layer's slices hold (each step's input counted once)."""
        inputs = {id(e.x): e.x.nbytes for p in self.placements.values() for e in p.log}
        return sum(p.log_bytes() for p in self.placements.values()) + sum(inputs.values())

    def momentum(self) -> dict[str, np.ndarray]:
        """The momentum buffers as the optimizer names them (none before the first update)."""
        if not self.started:
            return {}
        out = {f"{self.name}.weight": self.mw.copy(), f"{self.name}.bias": self.mb.copy()}
        if self.head_weight is not None:  # back to the fc weight's (classes, C * P)
            out[f"{self.head_name}.weight"] = np.ascontiguousarray(
                self.mf.transpose(2, 0, 1)
            ).reshape(self.head_weight.shape)
        return out

    def parameter_names(self) -> list[str]:
        """The parameters this layer's slices hold, as the optimizer names them."""
        names = [f"{self.name}.weight", f"{self.name}.bias"]
        return names + ([f"{self.head_name}.weight"] if self.head_weight is not None else [])


class _ResidentForward:
    """A resident fused stage's forward: workers get the input and their slice's halo."""

    phase = FORWARD

    def __init__(self, owner: ResidentKernels, ctx, layer: ResidentLayer, x, runs, synced, replica):
        self.owner, self.ctx, self.layer, self.runs = owner, ctx, layer, runs
        self.replica = replica  # workers compute x themselves from it (hetconv.replica)
        self.synced = synced  # every slice placed or synced just now: the master is current
        self.x = x
        self.x_kept: np.ndarray | None = None  # one copy per step for the replay log
        self.images = x.shape[0]
        kh, kw = layer.w.shape[2:]
        s = layer.sides
        ho, wo = x.shape[2] + s[0] + s[1] - kh + 1, x.shape[3] + s[2] + s[3] - kw + 1
        out_hw = layer.stage.output_hw((ho, wo))
        # A split head: each piece's partial logits (summed in piece order at the end); the
        # stage outputs of the pieces the master computes are kept for their backward.
        self.z: dict[int, np.ndarray] = {}
        self.y = np.empty((x.shape[0], layer.kernels, *out_hw), np.float32)

    def _out(self, piece: Piece) -> np.ndarray:
        """Where a piece's answer goes: its partial logits, or its channels of the output."""
        if self.layer.classes:
            return self.z.setdefault(
                piece.index, np.empty((self.images, self.layer.classes), np.float32)
            )
        return self.y[:, piece.part]

    def worker_request(self, piece: Piece) -> WorkerRequest:
        layer, ctx, part = self.layer, self.ctx, piece.part
        placed = layer.placements[piece.node.name]
        hw, hb, hf, before = layer.halo(part)
        if self.x_kept is None:  # the input as the worker has it: as sent, or computed there
            fmt = FLOAT32 if self.replica is not None else piece.node.client.wire_format
            self.x_kept = as_received(self.x, fmt)
        placed.pending = (self.x_kept, hw, hb, hf)
        out = self._out(piece)
        kwargs = {"out": out, "kernel_offset": layer.wide(part).start}
        if layer.classes:
            kwargs["hf"] = hf
        if self.replica is not None:
            kwargs["replica"] = self.replica
        if ctx.overlap_images:
            kwargs["overlap_images"] = ctx.overlap_images
        return WorkerRequest(
            piece.node.client.resident_stage_forward,
            (
                ctx.session, ctx.step, ctx.layer, self.x, hw, hb, before, placed.version,
                layer.sides, layer.stage, part.stop - part.start,
            ),
            kwargs,
            input_bytes(self.x, self.replica) + hw.nbytes + hb.nbytes + hf.nbytes + out.nbytes,
        )  # fmt: skip

    def input_arrived(self) -> None:
        """``x`` holds the layer's input now (its calls started before it was computed,
        :meth:`~.cluster.Cluster.forward`): the replay log's copy of it is made again."""
        if self.replica is None:
            raise RuntimeError(f"{self.ctx.layer}: only a replicated block's output comes late")
        if self.x_kept is not None:  # float32: the workers computed it themselves
            self.x_kept[...] = self.x

    def check(self, piece: Piece, answer) -> None:
        if not finite(self._out(piece)) and finite(self.x):
            raise _non_finite(piece, f"resident stage forward {self.ctx.layer}")

    @property
    def covers_early(self) -> bool:
        """Whether a lost piece is computed as soon as it is lost (see PhaseRunner)."""
        return split_of(self.replica) is not None

    def compute_locally(self, piece: Piece) -> None:
        lost_forward(self.replica, piece, self.x)
        layer, part = self.layer, piece.part
        self.owner.recover(layer, piece.node.name)  # a lost worker's slice: replayed here
        wide = layer.wide(part)
        own = slice(part.start - wide.start, part.stop - wide.start)
        y, run = stage_forward(
            self.owner.backend, self.x, layer.w[wide], layer.b[wide], layer.sides, layer.stage, own
        )
        self.y[:, part] = y
        if layer.classes:
            self._out(piece)[...] = partial_logits(y, layer.f[part])
        self.runs[layer.name, part.start, part.stop] = run
        if layer.classes:  # its backward needs the owned channels' output
            self.owner.maps[layer.name, part.start, part.stop] = y

    def accept(self, piece: Piece, answer) -> CallStats:
        return answer[1]

    def spot_sample(self, piece: Piece, answer, draw):
        """Sampled stage outputs next to the master's (:mod:`.spotcheck`), on a step whose
        slices were all placed or synced just before this forward, so the master's weights are
        the workers' exactly; none otherwise (a spot check of a resident layer waits for a
        sync: forcing one on every due step would fetch every slice that often)."""
        if not self.synced or self.layer.classes:
            return []  # a split head answers logits: not sampled (see the module's docstring)
        layer, fmt = self.layer, piece.node.client.wire_format
        sample = draw(*self.x.shape[:2])
        return stage_forward_sample(
            fmt, self.x, layer.w, layer.b, layer.sides, layer.stage, self.y, sample
        )

    def result(self):
        """The stage output, or with a split head the summed partial logits (no bias)."""
        if not self.layer.classes:
            return self.y
        parts = [self.z[i] for i in sorted(self.z)]
        return (
            np.sum(parts, axis=0, dtype=np.float32)
            if parts
            else np.zeros((self.images, self.layer.classes), np.float32)
        )


class _ResidentBackward:
    """A resident fused stage's backward: workers get the stage-output gradient of their
    owned and halo channels (with a split head, the logits' gradient ``dy`` (N, classes),
    the same for all), update their slice and answer their edge kernels and input-gradient
    part; the master updates the rows it computed, at the end (every piece has read the
    weights of this step by then)."""

    phase = BACKWARD

    def __init__(
        self, owner: ResidentKernels, ctx, layer: ResidentLayer, x, dy, need, runs, replica
    ):
        self.owner, self.ctx, self.layer, self.x, self.dy = owner, ctx, layer, x, dy
        self.need_input_grad, self.runs = need, runs
        self.replica = replica  # workers answer the replicated block's gradient parts into it
        self.images = x.shape[0]
        self.dx = None
        # rows the master computed; workers keep theirs. np.zeros, not zeros_like: the pages
        # of rows nobody writes are never touched (calloc), not filled every step.
        self.dw = np.zeros(layer.w.shape, np.float32)
        self.db = np.zeros(layer.b.shape, np.float32)
        self.df = np.zeros(layer.f.shape, np.float32)
        self._edges: list[tuple[slice, np.ndarray, np.ndarray, np.ndarray]] = []
        self._ef: dict[int, np.ndarray] = {}  # where each piece's edge columns come back
        self._computed: list[slice] = []

    def _add_dx(self, part) -> None:
        if self.need_input_grad:
            self.dx = part if self.dx is None else self.dx + part

    def worker_request(self, piece: Piece) -> WorkerRequest:
        layer, ctx, part = self.layer, self.ctx, piece.part
        placed = layer.placements[piece.node.name]
        wide, grad = layer.wide(part), layer.stage.grad_range(part, layer.kernels)
        head = layer.classes > 0
        dz = self.dy if head else None
        dy = self.dy[:, grad] if not head else np.empty((self.images, 0, 0, 0), np.float32)
        rows = edge_rows(part.stop - part.start, layer.stage.halo)
        ew = np.empty((len(rows), *layer.w.shape[1:]), np.float32)
        eb = np.empty(len(rows), np.float32)
        ef = self._ef[piece.index] = np.empty((len(rows), *layer.f.shape[1:]), np.float32)
        fmt = piece.node.client.wire_format
        dx_bytes = fmt.nbytes(self.x.shape) if self.need_input_grad else 0
        kwargs: dict = {"edges_out": (ew, eb, ef)}
        if head:
            kwargs["dz"] = dz
        if self.replica is not None:
            kwargs["replica"] = self.replica.request(piece.index)
            dx_bytes = self.replica.nbytes
        kwargs["answer_bytes"] = ew.nbytes + eb.nbytes + ef.nbytes + dx_bytes
        if ctx.overlap_images:
            kwargs["grouped"] = True
        sent = dy.nbytes + (dz.nbytes if dz is not None else 0)
        return WorkerRequest(
            piece.node.client.resident_stage_backward,
            (
                ctx.session, ctx.step, ctx.layer, dy, grad.start - wide.start, placed.version,
                self.need_input_grad,
            ),
            kwargs,
            sent + kwargs["answer_bytes"],
        )  # fmt: skip

    def check(self, piece: Piece, answer) -> None:
        dx, ew, eb, _ = answer
        through = self.replica.part(piece.index) if self.replica is not None else ()
        given = self.dy if self.layer.classes else self.dy[:, piece.part]
        if not finite(ew, eb, dx, *through) and finite(self.x, given):
            raise _non_finite(piece, f"resident stage backward {self.ctx.layer}")

    def compute_locally(self, piece: Piece) -> None:
        layer, part = self.layer, piece.part
        self.owner.recover(layer, piece.node.name)
        wide, grad = layer.wide(part), layer.stage.grad_range(part, layer.kernels)
        key = (layer.name, part.start, part.stop)
        run: StageRun | None = self.runs.pop(key, None)
        y = self.owner.maps.pop(key, None)
        own = slice(part.start - wide.start, part.stop - wide.start)
        if run is None or (layer.classes and y is None):  # the worker's forward ran there
            y, run = stage_forward(
                self.owner.backend, self.x, layer.w[wide], layer.b[wide], layer.sides,
                layer.stage, own,
            )  # fmt: skip
        rel = slice(grad.start - wide.start, grad.stop - wide.start)
        if layer.classes:
            dy = stage_grad(self.dy, layer.f[grad], y.shape[2:])
            self.df[part] = columns_grad(self.dy, y)
        else:
            dy = np.ascontiguousarray(self.dy[:, grad])
        first = self.replica.rows_first(piece.index) if self.replica is not None else ()
        dx, self.dw[part], self.db[part] = stage_backward(
            self.owner.backend, run, dy, rel, self.need_input_grad, rows_first=first
        )
        self._computed.append(part)
        if not lost_backward(self.replica, piece, dx):
            self._add_dx(dx)

    @property
    def covers_early(self) -> bool:
        """Whether a lost piece is computed as soon as it is lost (see PhaseRunner)."""
        return self.replica is not None and self.replica.split is not None

    def while_waiting(self) -> None:
        """As :meth:`~.dispatch._StageBackward.while_waiting`: the master's part goes back
        through a replicated block while the workers compute."""
        if self.replica is not None and self.replica.back_through(self.dx):
            self.dx = None

    def accept(self, piece: Piece, answer) -> CallStats:
        dx, ew, eb, stats = answer
        layer, part = self.layer, piece.part
        placed = layer.placements[piece.node.name]
        placed.version += 1
        wide, grad = layer.wide(part), layer.stage.grad_range(part, layer.kernels)
        if placed.pending is not None:
            x, hw, hb, hf = placed.pending
            if layer.classes:  # the logits' gradient, float32 whatever the wire
                dy = self.dy
            else:
                dy = as_received(self.dy[:, grad], piece.node.client.wire_format)
            placed.log.append(_Logged(x, hw, hb, hf, dy, grad.start - wide.start, self.ctx.step))
            placed.pending = None
        self._edges.append((part, ew, eb, self._ef[piece.index]))
        if self.replica is not None:
            self.replica.take(piece.index, piece.node.client.address)
        else:
            self._add_dx(dx)
        return stats

    def result(self):
        layer, config = self.layer, self.owner.sgd
        # What this step changes on the master, so that a step computed again (a spot check
        # caught a worker elsewhere) starts from where this one did (ResidentKernels.undo_step).
        before = [(part, *(np.array(a[part]) for a in layer.arrays())) for part in self._computed]
        self.owner.undo.setdefault(layer.name, (layer.started, before))
        for part, ew, eb, ef in self._edges:
            rows = part.start + edge_rows(part.stop - part.start, layer.stage.halo)
            layer.w[rows], layer.b[rows] = ew, eb
            if layer.classes:
                layer.f[rows] = ef
        head = layer.classes > 0
        for part in self._computed:
            df = self.df[part] if head else None
            layer.update_rows(part, self.dw[part], self.db[part], config, df)
        layer.started = True
        dx = self.replica.later(self.dx) if self.replica is not None else self.dx
        dx = replica_input_grad(dx, self.x, self.replica)
        if head:
            return dx, self.dw, self.db, self.df
        return dx, self.dw, self.db


class ResidentSplit(FusedKernelSplit):
    """The fused split's pieces, with the kernels resident on the workers
    (:class:`ResidentKernels` makes the jobs)."""

    name = "resident"


class ResidentKernels:
    """The master's side of resident kernels: the layers' state, placement, sync, replay.

    Args:
        session: the cluster's session (scopes the workers' slices).
        backend: the master's backend (replay and covered pieces run on it).
        membership: the nodes; a worker whose place or fetch call fails is lost through it.
        deadline: seconds a place or fetch call of ``nbytes`` to ``node`` may take.
        sync_every: steps between syncs of every slice (0: only when the log outgrows
            ``log_limit_bytes``).
        log_limit_bytes: the replay log's bytes per layer beyond which it is synced early.
    """

    def __init__(
        self,
        session: int,
        backend: Backend,
        membership: Membership,
        deadline,
        sync_every: int = DEFAULT_SYNC_EVERY,
        log_limit_bytes: int = DEFAULT_LOG_LIMIT,
    ):
        if sync_every < 0:
            raise ValueError(f"resident sync interval must be >= 0 steps, got {sync_every}")
        self.session, self.backend, self.membership = session, backend, membership
        self.deadline = deadline
        self.sync_every, self.log_limit_bytes = sync_every, log_limit_bytes
        self.sgd: SGDConfig | None = None
        self.layers: dict[str, ResidentLayer] = {}
        self.split = ResidentSplit()
        # stage outputs of the pieces the master computed, for a split head's backward
        self.maps: dict[tuple[str, int, int], np.ndarray] = {}
        self._placements = 0
        self._momentum: dict[str, np.ndarray] = {}  # to load when a layer is first seen
        self.start_step()

    def start_step(self) -> None:
        self.record: dict[str, dict] = {}  # layer -> placed/fetched bytes, replayed steps
        # layer -> (momentum started, rows the master updated with their values before)
        self.undo: dict[str, tuple[bool, list]] = {}

    def undo_step(self, step: int) -> None:
        """Take back this step's updates of every resident layer (the step is computed again):
        the master's rows get their values from before it, and each slice a worker updated in
        it is replayed on the master up to the step before and is no longer placed (the next
        forward places it again, with a new version)."""
        for name, (started, before) in self.undo.items():
            layer = self.layers[name]
            for node_name, placed in list(layer.placements.items()):
                if placed.log and placed.log[-1].step == step:
                    placed.log.pop()
                    self.recover(layer, node_name)
            for part, *values in before:
                for dest, value in zip(layer.arrays(), values, strict=True):
                    dest[part] = value
            layer.started = started
        self.undo = {}

    def _count(self, layer: str, key: str, value: int) -> None:
        per_layer = self.record.setdefault(layer, {})
        per_layer[key] = per_layer.get(key, 0) + value

    # -- the layers --------------------------------------------------------------------------

    def layer(self, name: str, w, b, stage: StageSpec, sides, head=None) -> ResidentLayer:
        """The resident state of layer ``name``, bound to the model's arrays at first use;
        ``head``: its split head, (the fc's name, its weight array)."""
        if self.sgd is None:
            raise RuntimeError(
                f"{name}: resident kernels need the optimizer's settings "
                "(Cluster.attach_optimizer) before the first step"
            )
        layer = self.layers.get(name)
        head_weight = head[1] if head is not None else None
        if layer is not None and (
            layer.w is not w or layer.b is not b or layer.head_weight is not head_weight
        ):
            raise RuntimeError(
                f"{name}: resident kernels are bound to the model's weight and bias arrays "
                "(and a split head's fc weight), but this call passed others (they must be "
                "updated in place, and a layer's head stays split or not)"
            )
        if layer is None:
            layer = ResidentLayer(name, w, b, stage, sides, head)
            mw, mb = (
                self._momentum.pop(f"{name}.weight", None),
                self._momentum.pop(f"{name}.bias", None),
            )
            if mw is not None and mb is not None:
                layer.mw[...], layer.mb[...], layer.started = mw, mb, True
            if head is not None:
                mf = self._momentum.pop(f"{head[0]}.weight", None)
                if mf is not None:
                    layer.mf[...] = head_columns(mf, layer.kernels)
            self.layers[name] = layer
        return layer

    def load_momentum(self, momentum: dict[str, np.ndarray]) -> None:
        """Momentum buffers of resident layers from a checkpoint (before the first step)."""
        taken = set()
        for name, layer in self.layers.items():
            for key, buf in (("weight", layer.mw), ("bias", layer.mb)):
                value = momentum.get(f"{name}.{key}")
                if value is not None:
                    buf[...] = value
                    layer.started = True
            if layer.head_weight is not None:
                value = momentum.get(f"{layer.head_name}.weight")
                if value is not None:
                    layer.mf[...] = head_columns(np.asarray(value), layer.kernels)
            taken.update(layer.parameter_names())
            layer.placements.clear()  # the master's arrays are the truth now
        self._momentum = {k: v for k, v in momentum.items() if k not in taken}

    # -- placement, sync, gather, replay ----------------------------------------------------

    def arrange(self, layer: ResidentLayer, pieces: Sequence[Piece], step: int) -> bool:
        """Before a layer's forward: slices whose range changed come back to the master
        (fetched, or replayed when the worker is gone), the new ranges are placed, and
        slices due for a sync are synced. Returns whether every slice was placed or synced
        just now (the master's weights are then the workers' exactly: spot checks can
        recompute their answers)."""
        fresh = set()
        want = {
            p.node.name: p
            for p in pieces[1:]
            if p.size and p.node.state == ACTIVE and p.node.name not in self.membership.failed
        }
        for name, placed in list(layer.placements.items()):
            piece = want.get(name)
            if piece is None or piece.part != placed.part:
                self._gather(layer, placed, keep=False)
        for name, piece in want.items():
            if name not in layer.placements:
                self._place(layer, piece, step)
                fresh.add(name)
        full = layer.log_bytes() > self.log_limit_bytes
        for name, placed in list(layer.placements.items()):
            due = self.sync_every and step - placed.synced_step >= self.sync_every
            if due or full:
                self._gather(layer, placed, keep=True, step=step)
                fresh.add(name)
        return set(layer.placements) <= fresh

    def _place(self, layer: ResidentLayer, piece: Piece, step: int) -> None:
        part, node = piece.part, piece.node
        self._placements += 1
        version = placement_version(self._placements)
        arrays = tuple(np.array(a[part], order="C") for a in layer.arrays())  # copies
        nbytes = sum(a.nbytes for a in arrays)
        try:
            stats = node.client.place_kernels(
                self.session, layer.name, part.start, version, *arrays[:4], layer.started,
                self.sgd, timeout=self.deadline(node, nbytes), head=arrays[4:],
            )  # fmt: skip
        except WorkerError as e:
            self.membership.lose(node, e)  # its piece is covered by the master this step
            return
        self._count(layer.name, "placed_bytes", stats.bytes_sent)
        layer.placements[node.name] = Placement(node, part, version, arrays, layer.started, step)

    def _gather(
        self, layer: ResidentLayer, placed: Placement, keep: bool, step: int | None = None
    ) -> None:
        """Bring ``placed``'s slice into the master's arrays: fetched from its worker, or
        replayed when that fails. ``keep``: it stays placed (a sync) and the log restarts."""
        part, node = placed.part, placed.node
        outs = tuple(np.empty(a[part].shape, np.float32) for a in layer.arrays())
        fetched = False
        if node.state == ACTIVE and node.name not in self.membership.failed:
            try:
                _, stats = node.client.fetch_kernels(
                    self.session, layer.name, placed.version, outs,
                    timeout=self.deadline(node, sum(a.nbytes for a in outs)),
                )  # fmt: skip
                self._count(layer.name, "fetched_bytes", stats.bytes_received)
                fetched = finite(*outs)
                if not fetched:
                    self.membership.lose(node, WorkerError(node.name, "fetch: NaN or Inf"))
            except WorkerError as e:
                self.membership.lose(node, e)
        if not fetched:
            self.recover(layer, node.name)
            return
        for dest, value in zip(layer.arrays(), outs, strict=True):
            dest[part] = value
        if keep:
            placed.synced, placed.synced_started = outs, layer.started
            placed.synced_step = step if step is not None else placed.synced_step
            placed.log.clear()
        else:
            del layer.placements[node.name]

    def recover(self, layer: ResidentLayer, node_name: str) -> None:
        """The slice ``node_name`` held (if any) into the master's arrays, by replaying its
        updates since the last sync; it is no longer placed."""
        placed = layer.placements.pop(node_name, None)
        if placed is None:
            return
        part, config = placed.part, self.sgd
        w, b, mw, mb, f, mf = (np.array(a) for a in placed.synced)
        started = placed.synced_started
        wide = layer.wide(part)
        before = part.start - wide.start
        own = slice(before, before + part.stop - part.start)
        head = layer.classes > 0
        for e in placed.log:
            ww = np.concatenate([e.hw[:before], w, e.hw[before:]])
            bb = np.concatenate([e.hb[:before], b, e.hb[before:]])
            y, run = stage_forward(self.backend, e.x, ww, bb, layer.sides, layer.stage, own)
            if head:  # the stage-output gradient from the logits' gradient, as the worker did
                ff = np.concatenate([e.hf[:before], f, e.hf[before:]])
                rel = layer.stage.grad_range(own, ww.shape[0])
                dy = stage_grad(e.dy, ff[rel], y.shape[2:])
                df = columns_grad(e.dy, y)
            else:
                rel = slice(e.grad_start, e.grad_start + e.dy.shape[1])
                dy = e.dy
            _, dw, db = stage_backward(self.backend, run, dy, rel, False)
            bw = sgd_update(w, dw, mw if started else None, config)
            bm = sgd_update(b, db, mb if started else None, config)
            if bw is not None:
                mw[...], mb[...] = bw, bm
            if head:
                bf = sgd_update(f, df, mf if started else None, config)
                if bf is not None:
                    mf[...] = bf
            started = True
        self._count(layer.name, "replayed_steps", len(placed.log))
        for dest, value in zip(layer.arrays(), (w, b, mw, mb, f, mf), strict=True):
            dest[part] = value

    def gather(self) -> dict[str, np.ndarray]:
        """Every slice into the master's arrays (each stays placed; a free sync); returns
        the resident layers' momentum buffers by parameter name."""
        momentum = {}
        for layer in self.layers.values():
            for placed in list(layer.placements.values()):
                self._gather(layer, placed, keep=True)
            momentum.update(layer.momentum())
        return momentum

    # -- the jobs ----------------------------------------------------------------------------

    def forward_job(
        self, ctx: CallContext, layer: ResidentLayer, x, synced=False, replica=None
    ) -> PhaseJob:
        """``replica``: ``x`` is that replicated block's output, which workers compute."""
        runs = self.split._runs
        for key in [k for k in runs if k[0] == layer.name]:
            del runs[key]
            self.maps.pop(key, None)
        return _ResidentForward(self, ctx, layer, x, runs, synced, replica)

    def backward_job(
        self, ctx: CallContext, layer: ResidentLayer, x, dy, need, replica=None
    ) -> PhaseJob:
        """``replica``: a :class:`~.replica.BlockGradients` the workers' parts go into."""
        return _ResidentBackward(self, ctx, layer, x, dy, need, self.split._runs, replica)


__all__ = [
    "DEFAULT_LOG_LIMIT",
    "DEFAULT_SYNC_EVERY",
    "Placement",
    "ResidentKernels",
    "ResidentLayer",
    "ResidentSplit",
]
