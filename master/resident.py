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

Spot checks, by the same replay (:mod:`.spotcheck`): with checks on, each placement and sync
draws in secret a few kernels of the slice whose forward answers the log keeps (with a split
head, the slice's partial logits); at the next sync (or fetch) the master replays those
kernels from the synced copy (a kernel's update reads its stage neighbours', so going back each
step widens the rows by the halo; the logged halo beyond the slice) and compares the answers of
every step since and the fetched rows with its own (:meth:`ResidentKernels._audit`): the
answers between syncs and the worker's own updates are checked, not only the first forward
after a sync. A worker caught is lost and kept out; its slice is replayed whole from the sync.

When shares change (a worker joins or is lost, a rebalance), a slice whose range moved is
fetched (or replayed, its worker gone) into the master's arrays and the new ranges are placed
with new versions before the layer's next forward.

A split head (:mod:`hetconv.head`): the layer's slices also hold the final fc's columns of
their channels (a view of the model's fc weight, :func:`~hetconv.head.head_columns`) and their
momentum, placed, fetched, updated, logged and replayed with the kernels; forward answers
partial logits, which the master sums (:attr:`_ResidentForward.result`), and backward sends the
logits' gradient. The halo and edge rows carry the halo and edge channels' columns too.

Batch norm in the stage: its weight and bias stay the master's (its optimizer updates them).
Each resident stage call sends them as the sent-kernel fused stage does (:mod:`.fused`: the
widened slice's rows, in evaluation the running statistics too); the forward's answer carries
the owned channels' batch statistics, which move the running statistics as there, and the
backward's their weight and bias gradients. The replay log keeps the batch norms' rows each
step's forward was sent, so a replay normalises as the worker did. A convolution without bias
(:attr:`ResidentKernels.no_bias`) is placed with ``fixed_bias``: neither the worker nor the
master's own rows, replay or sync ever change its zero bias.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hetconv.backends import Backend
from hetconv.head import head_columns
from hetconv.optim import SGDConfig, sgd_update
from hetconv.resident import placement_version
from hetconv.stages import StageSpec

from .client import WorkerError
from .dispatch import (
    CallContext,
    PhaseJob,
    Piece,
    finite,
)
from .fused import FusedKernelSplit, _check_batchnorm
from .membership import ACTIVE, Membership, Node
from .resident_jobs import _Logged, _ResidentBackward, _ResidentForward, replay
from .spotcheck import REPLAY_RTOL, UPDATE_RTOL, Comparison, SpotCheckFailed, as_received

#: Steps between syncs of every resident slice (FetchKernels), bounding the replay log.
DEFAULT_SYNC_EVERY = 20
#: The replay log's bytes per layer beyond which its slices are synced early.
DEFAULT_LOG_LIMIT = 512 << 20


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
    # spot checks: the kernels whose forward answers are kept for the replay at the next sync
    # (drawn in secret at each placement and sync), and this step's answer until logged
    watch: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    answer: np.ndarray | None = None

    def log_bytes(self) -> int:
        return sum(e.dy.nbytes + e.hw.nbytes + e.hf.nbytes for e in self.log)


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
        self.bias = True  # False: a convolution without bias, whose zero b is never updated
        self.batchnorm: list = []  # the stage's BatchNorm2d layers (the model's), in order
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
        if bw is not None:
            mw[...] = bw
        if self.bias:
            bb = sgd_update(b, db, mb if self.started else None, config)
            if bb is not None:
                mb[...] = bb
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
        out = {f"{self.name}.weight": self.mw.copy()}
        if self.bias:
            out[f"{self.name}.bias"] = self.mb.copy()
        if self.head_weight is not None:  # back to the fc weight's (classes, C * P)
            out[f"{self.head_name}.weight"] = np.ascontiguousarray(
                self.mf.transpose(2, 0, 1)
            ).reshape(self.head_weight.shape)
        return out

    def parameter_names(self) -> list[str]:
        """The parameters this layer's slices hold, as the optimizer names them."""
        names = [f"{self.name}.weight"] + ([f"{self.name}.bias"] if self.bias else [])
        return names + ([f"{self.head_name}.weight"] if self.head_weight is not None else [])


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
        #: layers without bias (the cluster sets it at prepare): their zero bias stays zero
        self.no_bias: frozenset[str] = frozenset()
        self.split = ResidentSplit()
        #: the cluster's spot checks (None: off): each sync replays a sample of the slice
        self.spot_checks = None
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

    def layer(
        self, name: str, w, b, stage: StageSpec, sides, head=None, batchnorm=()
    ) -> ResidentLayer:
        """The resident state of layer ``name``, bound to the model's arrays at first use;
        ``head``: its split head, (the fc's name, its weight array); ``batchnorm``: the
        model's batch norm layers of the stage (their parameters stay the master's)."""
        _check_batchnorm(name, stage, batchnorm)
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
            layer.bias = name not in self.no_bias
            mw, mb = (
                self._momentum.pop(f"{name}.weight", None),
                self._momentum.pop(f"{name}.bias", None),
            )
            if mw is not None and (mb is not None or not layer.bias):
                layer.mw[...], layer.started = mw, True
                if mb is not None:
                    layer.mb[...] = mb
            if head is not None:
                mf = self._momentum.pop(f"{head[0]}.weight", None)
                if mf is not None:
                    layer.mf[...] = head_columns(mf, layer.kernels)
            self.layers[name] = layer
        layer.batchnorm = list(batchnorm)
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
                fixed_bias=not layer.bias,
            )  # fmt: skip
        except WorkerError as e:
            self.membership.lose(node, e)  # its piece is covered by the master this step
            return
        self._count(layer.name, "placed_bytes", stats.bytes_sent)
        placed = Placement(node, part, version, arrays, layer.started, step)
        layer.placements[node.name] = placed
        self._watch(layer, placed, step)

    def _watch(self, layer: ResidentLayer, placed: Placement, step: int) -> None:
        if self.spot_checks is not None:
            placed.watch = self.spot_checks.watch(layer.name, placed.node.name, placed.part, step)

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
        if not fetched or not self._audit(layer, placed, outs):
            self.recover(layer, node.name)
            return
        for dest, value in zip(layer.arrays(), outs, strict=True):
            dest[part] = value
        if keep:
            placed.synced, placed.synced_started = outs, layer.started
            placed.synced_step = step if step is not None else placed.synced_step
            placed.log.clear()
            self._watch(layer, placed, placed.synced_step)
        else:
            del layer.placements[node.name]

    def recover(self, layer: ResidentLayer, node_name: str) -> None:
        """The slice ``node_name`` held (if any) into the master's arrays, by replaying its
        updates since the last sync; it is no longer placed."""
        placed = layer.placements.pop(node_name, None)
        if placed is None:
            return
        part = placed.part
        replayed = replay(self.backend, layer, placed, part, self.sgd)
        self._count(layer.name, "replayed_steps", len(placed.log))
        for dest, value in zip(layer.arrays(), replayed.state, strict=True):
            dest[part] = value

    def _audit(self, layer: ResidentLayer, placed: Placement, outs) -> bool:
        """A spot check of a fetched slice (:mod:`.spotcheck`) when it is due (one sync in
        ``every``, drawn in secret: :meth:`~.spotcheck.SpotChecker.replay_due`):
        the watched kernels are replayed from the sync, and their forward answers of every
        logged step and their fetched rows (weights, biases, momentum: the worker's updates)
        compared with the master's; with a split head the whole slice is replayed and its
        partial logits compared too. False: the worker was caught (lost, kept out).

        The master's float32 is not the worker's bit for bit (another BLAS, other threads),
        and over steps a value within round-off of a ReLU's zero or a max-pool's tie can go
        the other way in one kernel and move that kernel's update by a percent, spreading to
        its LRN neighbours: so the forward answers are allowed
        :data:`~.spotcheck.REPLAY_RTOL` of their scale, and the updates are compared as a
        whole: the fetched change since the sync over the replayed one (their projection: 1
        for an honest worker, 1.01 for one that scales its updates by 1.01, 0 for one that
        skips them) must be 1 within :data:`~.spotcheck.UPDATE_RTOL`, and what is left of it
        (the change's part that is not the replayed one) under a tenth of the replayed."""
        checker = self.spot_checks
        if checker is None or not placed.log or not checker.replay_due(placed, layer.name):
            return True
        node, part = placed.node, placed.part
        fmt = node.client.wire_format
        start = time.perf_counter()
        compared: list[Comparison] = []
        changes: list[tuple[np.ndarray, ...]] = []  # per array: fetched, synced, replayed
        for rows in [part] if layer.classes else [slice(k, k + 1) for k in placed.watch.tolist()]:
            got = replay(self.backend, layer, placed, rows, self.sgd)
            compared += _answers(layer, placed, got, fmt)
            at = slice(rows.start - part.start, rows.stop - part.start)
            changes += [
                (fetched[at], synced[at], want)
                for fetched, synced, want in zip(outs, placed.synced, got.state, strict=True)
            ]
        compared += _updates(changes, f"kernels {_names(placed.watch, layer.classes, part)}")
        try:
            checker.compare(node, layer.name, "replay", compared)
        except SpotCheckFailed as e:
            self.membership.lose(node, e)
            return False
        finally:
            checker.seconds += time.perf_counter() - start
        return True

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


_STATE = ("weights", "biases", "weight momentum", "bias momentum", "fc columns", "fc momentum")


def _answers(layer: ResidentLayer, placed: Placement, got, fmt) -> list[Comparison]:
    """The worker's kept forward answers of every logged step next to the replay's: a split
    head's partial logits (the whole slice replayed), or a watched kernel's stage outputs."""
    out = []
    k = got.rows.start
    index = int(np.searchsorted(placed.watch, k))
    watched = not layer.classes and index < len(placed.watch) and placed.watch[index] == k
    for e, y, z in zip(
        placed.log, got.outputs, got.logits or [None] * len(placed.log), strict=True
    ):
        if e.answer is None:
            continue
        if z is not None:
            what = f"partial logits of step {e.step}"
            out.append(_compared("z", what, e.answer, as_received(fmt, z)))
        elif watched:
            what = f"stage outputs of kernel {k} in step {e.step}"
            out.append(_compared("y", what, e.answer[:, index], as_received(fmt, y[:, 0])))
    return out


def _compared(tensor: str, what: str, got: np.ndarray, want: np.ndarray) -> Comparison:
    want = want.astype(np.float64)
    scale = float(np.abs(want).max(initial=0.0))
    return Comparison(tensor, what, got, want, scale, True, REPLAY_RTOL)


def _names(watch: np.ndarray, head: bool, part: slice) -> str:
    return f"{part.start}..{part.stop - 1}" if head else ",".join(map(str, watch.tolist()))


def _updates(changes, kernels: str) -> list[Comparison]:
    """The fetched change since the sync of the parameters (weights, biases, fc columns) and
    of their momentum, each against the replayed change: its projection on it (1 when
    honest) and the rest's size over the replayed change's."""
    out = []
    for name, arrays in (("parameters", changes[0::6] + changes[1::6] + changes[4::6]),
                         ("momentum", changes[2::6] + changes[3::6] + changes[5::6])):  # fmt: skip
        got = np.concatenate([(f.astype(np.float64) - s).ravel() for f, s, _ in arrays])
        want = np.concatenate([(w.astype(np.float64) - s).ravel() for _, s, w in arrays])
        energy = float(want @ want)
        if energy == 0.0:
            if got.any():
                out.append(Comparison("update", f"{name} of {kernels}: changed, replayed "
                    "unchanged", got, want, 0.0, False))  # fmt: skip
            continue
        ratio = float(got @ want) / energy
        rest = float(np.linalg.norm(got - ratio * want)) / np.sqrt(energy)
        what = f"{name} of {kernels} as updated since the sync (their change over the master's)"
        one = np.ones(1)
        out.append(Comparison("update", what, np.array([ratio]), one, 1.0, False, UPDATE_RTOL))
        what = f"{name} of {kernels}: what their change holds besides the master's"
        out.append(Comparison("update", what, np.array([rest]), np.zeros(1), 1.0, False, 0.1))
    return out


__all__ = [
    "DEFAULT_LOG_LIMIT",
    "DEFAULT_SYNC_EVERY",
    "Placement",
    "ResidentKernels",
    "ResidentLayer",
    "ResidentSplit",
]
