"""The forward and backward jobs of a stage whose kernels are resident on the workers
(:mod:`.resident`), over the phase runner (:mod:`.dispatch`), and the replay log's entries."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from hetconv.formats import FLOAT32
from hetconv.head import columns_grad, partial_logits, stage_grad
from hetconv.optim import sgd_update
from hetconv.resident import edge_rows
from hetconv.stages import (
    StageRun,
    batch_statistics_rows,
    batchnorm_grad_rows,
    stage_backward,
    stage_forward,
)

from .client import CallStats
from .dispatch import (
    BACKWARD,
    FORWARD,
    Piece,
    WorkerRequest,
    _non_finite,
    finite,
    lost_backward,
    lost_forward,
    split_of,
)
from .fused import _batchnorm_slices, _check_rows, track_statistics
from .replica import BlockOutput, arrived, input_bytes, replica_input_grad
from .spotcheck import stage_forward_sample


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
    bn: tuple = ()  # the BatchNormSlices of the widened slice the forward was sent
    # what the worker answered of the forward: its watched kernels' stage outputs (as they
    # arrived), or with a split head its partial logits; None: not kept (spot checks off)
    answer: np.ndarray | None = None


@dataclass
class Replayed:
    """The end of a replay of rows ``rows`` of a slice: their six arrays after the logged steps
    (w, b, mw, mb, f, mf), and per logged step their stage outputs and, where ``rows`` is the
    whole slice of a split head, its partial logits."""

    rows: slice
    state: tuple[np.ndarray, ...]
    outputs: list[np.ndarray]
    logits: list[np.ndarray]


def _within(a: slice, b: slice) -> slice:
    return slice(max(a.start, b.start), min(a.stop, b.stop))


def replay(backend, layer, placed, rows: slice, config) -> Replayed:
    """Recompute the updates a worker made of rows ``rows`` of its slice since the last sync,
    from the synced copy and the log (:mod:`.resident`).

    A row's update reads the stage's neighbours (an LRN's halo), whose updates read theirs: a
    step ``t`` before the end needs the rows ``t`` halos wider (within the slice; those beyond
    it are the logged halo's). So a few rows cost a few rows' work when the stage has no halo,
    and at most the slice's; ``rows`` = the slice is the whole slice's replay, the same
    operations in the same order as the worker's."""
    part, stage, kernels = placed.part, layer.stage, layer.kernels
    updates = [rows]  # the rows each logged step updates, last first
    for _ in range(len(placed.log) - 1):
        updates.append(_within(stage.widened(updates[-1], kernels), part))
    updates = updates[::-1] if placed.log else []
    held = _within(stage.widened(updates[0], kernels), part) if placed.log else rows
    offset = slice(held.start - part.start, held.stop - part.start)
    w, b, mw, mb, f, mf = (np.array(a[offset]) for a in placed.synced)
    started, whole = placed.synced_started, layer.wide(part)
    skip = part.start - whole.start  # the logged halo: the rows before the slice first
    outputs, logits = [], []
    head = layer.classes > 0
    for rows_now, e in zip(updates, placed.log, strict=True):
        wide = stage.widened(rows_now, kernels)
        before, after = part.start - wide.start, wide.stop - part.stop
        cut = (skip - max(before, 0), skip, skip + max(after, 0))
        ww, bb = _widen(e.hw, w, cut), _widen(e.hb, b, cut)
        own = slice(rows_now.start - wide.start, rows_now.stop - wide.start)
        bn = [_bn_rows(one, wide.start - whole.start, wide.stop - whole.start) for one in e.bn]
        y, run = stage_forward(backend, arrived(e.x), ww, bb, layer.sides, stage, own, bn)
        at = slice(rows.start - rows_now.start, rows.stop - rows_now.start)
        outputs.append(y[:, at])
        ff = _widen(e.hf, f, cut)
        if head and rows_now == part:
            logits.append(partial_logits(y, ff[own]))
        if head:  # the stage-output gradient from the logits' gradient, as the worker did
            rel = stage.grad_range(own, ww.shape[0])
            dy = stage_grad(e.dy, ff[rel], y.shape[2:])
            df = columns_grad(e.dy, y)
        else:
            grad = stage.grad_range(rows_now, kernels)
            first = whole.start + e.grad_start  # the logged gradient's first channel
            dy = e.dy[:, grad.start - first : grad.stop - first]
            rel = slice(grad.start - wide.start, grad.stop - wide.start)
        _, dw, db = stage_backward(backend, run, dy, rel, False)
        keep = slice(rows_now.start - held.start, rows_now.stop - held.start)
        w, b, mw, mb, f, mf = (np.array(a[keep]) for a in (w, b, mw, mb, f, mf))
        bw = sgd_update(w, dw, mw if started else None, config)
        if bw is not None:
            mw[...] = bw
        if layer.bias:  # without bias, b and mb stay zero as on the worker
            bm = sgd_update(b, db, mb if started else None, config)
            if bm is not None:
                mb[...] = bm
        if head:
            bf = sgd_update(f, df, mf if started else None, config)
            if bf is not None:
                mf[...] = bf
        started, held = True, rows_now
    return Replayed(rows, (w, b, mw, mb, f, mf), outputs, logits)


def _widen(halo: np.ndarray, held: np.ndarray, cut: tuple[int, int, int]) -> np.ndarray:
    """The widened rows: the logged halo's beyond the slice (``halo[cut[0]:cut[1]]`` before
    it, ``halo[cut[1]:cut[2]]`` after), the held ones within."""
    return np.concatenate([halo[cut[0] : cut[1]], held, halo[cut[1] : cut[2]]])


def _bn_rows(bn, start: int, stop: int):
    """Rows ``start:stop`` of a logged :class:`~hetconv.stages.BatchNormSlice`."""
    running = (bn.running_mean, bn.running_var)
    return dataclasses.replace(
        bn,
        weight=bn.weight[start:stop],
        bias=bn.bias[start:stop],
        running_mean=None if running[0] is None else running[0][start:stop],
        running_var=None if running[1] is None else running[1][start:stop],
    )


def as_received(array: np.ndarray, fmt) -> np.ndarray:
    """A copy of ``array`` as a worker receives it in wire format ``fmt`` (rounded when the
    format is 16-bit): what the replay log must keep to recompute the worker's update."""
    if fmt.exact:
        return np.array(array)
    return fmt.to_host(fmt.to_wire(array))


class _ResidentForward:
    """A resident fused stage's forward: workers get the input and their slice's halo."""

    phase = FORWARD

    def __init__(self, owner, ctx, layer, x, runs, synced, replica):
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
        # The stage's batch norms (:mod:`.fused`'s rules): each piece's batch statistics.
        self.batchnorm = list(layer.batchnorm)
        self.training = all(bn.training for bn in self.batchnorm)
        self.counts = [x.shape[0] * h * w for h, w in layer.stage.batchnorm_hw((ho, wo))]
        rows = 2 * len(self.batchnorm) if self.training else 0
        self.stats: dict[int, np.ndarray] = {}
        self._stats_rows = rows

    def _track(self, part: slice, stats: np.ndarray) -> None:
        """Move the running statistics of ``part`` by its rows of batch mean and variance."""
        if self.training:
            track_statistics(self.batchnorm, self.counts, part, stats)

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
            # a block left to the workers is kept as itself: computed if a replay reads it
            late = isinstance(self.x, BlockOutput)
            self.x_kept = self.x if late else as_received(self.x, fmt)
        bn = _batchnorm_slices(self.batchnorm, layer.wide(part))
        placed.pending = (self.x_kept, hw, hb, hf, tuple(bn))
        out = self._out(piece)
        stats = self.stats[piece.index] = np.empty((self._stats_rows, piece.size), np.float32)
        kwargs = {"out": out, "kernel_offset": layer.wide(part).start}
        if bn:
            kwargs |= {"batchnorm": bn, "stats_out": stats}
        bn_bytes = sum(a.nbytes for one in bn for a in _bn_arrays(one)) + stats.nbytes
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
            input_bytes(self.x, self.replica) + hw.nbytes + hb.nbytes + hf.nbytes + out.nbytes
            + bn_bytes,
        )  # fmt: skip

    def input_arrived(self) -> None:
        """``x`` holds the layer's input now (its calls started before it was computed,
        :meth:`~.cluster.Cluster.forward`): the replay log's copy of it is made again."""
        if self.replica is None:
            raise RuntimeError(f"{self.ctx.layer}: only a replicated block's output comes late")
        if self.x_kept is not None:  # float32: the workers computed it themselves
            self.x_kept[...] = self.x

    def check(self, piece: Piece, answer) -> None:
        what = f"resident stage forward {self.ctx.layer}"
        if not finite(self._out(piece)) and finite(self.x):
            raise _non_finite(piece, what)
        _check_rows(piece, what, self.stats[piece.index], self._stats_rows)

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
            self.owner.backend, arrived(self.x), layer.w[wide], layer.b[wide], layer.sides,
            layer.stage, own, _batchnorm_slices(self.batchnorm, wide),
        )  # fmt: skip
        self._track(part, batch_statistics_rows(run))
        self.y[:, part] = y
        if layer.classes:
            self._out(piece)[...] = partial_logits(y, layer.f[part])
        self.runs[layer.name, part.start, part.stop] = run
        if layer.classes:  # its backward needs the owned channels' output
            self.owner.maps[layer.name, part.start, part.stop] = y

    def accept(self, piece: Piece, answer) -> CallStats:
        if self.batchnorm:
            self._track(piece.part, self.stats[piece.index])
        placed = self.layer.placements.get(piece.node.name)
        if placed is not None and placed.pending is not None:  # kept for the sync's replay
            if self.layer.classes:
                placed.answer = np.array(self._out(piece))
            elif len(placed.watch):
                placed.answer = self.y[:, placed.watch]  # a copy
        return answer[1]

    def spot_sample(self, piece: Piece, answer, draw):
        """Sampled stage outputs next to the master's (:mod:`.spotcheck`), on a step whose
        slices were all placed or synced just before this forward, so the master's weights are
        the workers' exactly; none otherwise: the answers between syncs are compared at the
        next sync, by replay (:meth:`~.resident.ResidentKernels._audit`)."""
        if not self.synced or self.layer.classes:
            return []  # a split head's logits: compared at the next sync, replayed whole
        layer, fmt = self.layer, piece.node.client.wire_format
        sample = draw(*self.x.shape[:2])
        bn = _batchnorm_slices(self.batchnorm, slice(0, layer.kernels))  # every image's
        return stage_forward_sample(
            fmt, arrived(self.x), layer.w, layer.b, layer.sides, layer.stage, self.y, sample, bn
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

    def __init__(self, owner, ctx, layer, x, dy, need, runs, replica):
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
        # the stage's batch norms: their weight and bias gradients, filled piece by piece
        self.batchnorm = list(layer.batchnorm)
        self._dbn: dict[int, np.ndarray] = {}
        self._taken_back: dict[str, tuple[np.ndarray, ...]] = {}  # rows_of's slices
        for bn in self.batchnorm:
            bn.grads = {name: np.zeros_like(p) for name, p in bn.params.items()}

    def _take_dbn(self, part: slice, dbn: np.ndarray) -> None:
        for i, bn in enumerate(self.batchnorm):
            bn.grads["weight"][part], bn.grads["bias"][part] = dbn[2 * i], dbn[2 * i + 1]

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
        dbn = self._dbn[piece.index] = np.empty((2 * len(self.batchnorm), piece.size), np.float32)
        kwargs: dict = {"edges_out": (ew, eb, ef), "dbn_out": dbn}
        if head:
            kwargs["dz"] = dz
        if self.replica is not None:
            kwargs["replica"] = self.replica.request(piece.index)
            dx_bytes = self.replica.nbytes
        kwargs["answer_bytes"] = ew.nbytes + eb.nbytes + ef.nbytes + dbn.nbytes + dx_bytes
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
        what = f"resident stage backward {self.ctx.layer}"
        if not finite(ew, eb, dx, *through) and finite(self.x, given):
            raise _non_finite(piece, what)
        _check_rows(piece, what, self._dbn[piece.index], 2 * len(self.batchnorm))

    def compute_locally(self, piece: Piece) -> None:
        layer, part = self.layer, piece.part
        self.owner.recover(layer, piece.node.name)
        wide, grad = layer.wide(part), layer.stage.grad_range(part, layer.kernels)
        key = (layer.name, part.start, part.stop)
        run: StageRun | None = self.runs.pop(key, None)
        y = self.owner.maps.pop(key, None)
        own = slice(part.start - wide.start, part.stop - wide.start)
        if run is None or (layer.classes and y is None):  # the worker's forward ran there
            # (training: the same batch statistics; the running ones moved by them once, then)
            y, run = stage_forward(
                self.owner.backend, arrived(self.x), layer.w[wide], layer.b[wide], layer.sides,
                layer.stage, own, _batchnorm_slices(self.batchnorm, wide),
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
        self._take_dbn(part, batchnorm_grad_rows(run))
        if not lost_backward(self.replica, piece, dx):
            self._add_dx(dx)

    @property
    def covers_early(self) -> bool:
        """Whether a lost piece is computed as soon as it is lost (see PhaseRunner)."""
        return self.replica is not None and self.replica.split is not None

    def rows_of(self, calls):
        """``recompute(sender, image)`` for :meth:`~.split_step.SplitStep.check_rows`: worker
        ``sender``'s input-gradient rows of one image, as its slice computed them this step.
        The master's copy of the slice is the last sync's, so once the sender's backward has
        answered (its update made) the slice is fetched and taken back one step: ``w = w' + lr
        * mw'``, the SGD rule undone (``b`` and a split head's columns too), to float32
        round-off. None where that cannot be done: no momentum (the update is not undone from
        what is fetched), batch norm (statistics over the batch). A sender whose slice cannot
        be fetched raises its :class:`~.client.WorkerError` (its rows are not shown right)."""
        layer, config = self.layer, self.owner.sgd
        if self.batchnorm or not self.need_input_grad or not config.momentum:
            return None
        pieces = {p.node.client.address: (p, c) for p, c in calls}
        taken_back = self._taken_back  # per sender, fetched once a step whoever asks

        def recompute(sender: str, i: int) -> np.ndarray | None:
            piece, call = pieces.get(sender, (None, None))
            placed = layer.placements.get(piece.node.name) if piece is not None else None
            if placed is None or placed.pending is None:
                return None  # not a resident slice this step
            while not call.done():  # its update is made once it answers
                if any(c.failed() for _, c in calls):  # a peer lost: the master covers it
                    return None  # only once this check ends (waiting here would hold them all)
                time.sleep(0.01)
            if call.failed():
                return None  # lost in its own call: nothing to check
            if sender not in taken_back:
                taken_back[sender] = self._before_update(piece, placed)
            x, *halo, _ = placed.pending  # hw, hb, hf
            part = piece.part
            wide, grad = layer.wide(part), layer.stage.grad_range(part, layer.kernels)
            before = part.start - wide.start
            ww, bb, ff = (
                np.concatenate([h[:before], a, h[before:]])
                for h, a in zip(halo, taken_back[sender], strict=True)
            )
            own = slice(before, before + part.stop - part.start)
            y, run = stage_forward(
                self.owner.backend, x[i : i + 1], ww, bb, layer.sides, layer.stage, own
            )
            if layer.classes:  # the stage-output gradient from the logits', as the worker's
                rel = layer.stage.grad_range(own, ww.shape[0])
                dy = stage_grad(self.dy[i : i + 1], ff[rel], y.shape[2:])
            else:
                dy = as_received(self.dy[i : i + 1, grad], piece.node.client.wire_format)
                rel = slice(grad.start - wide.start, grad.stop - wide.start)
            dx, _, _ = stage_backward(self.owner.backend, run, dy, rel, True)
            return dx[0]

        return recompute

    def _before_update(self, piece: Piece, placed) -> tuple[np.ndarray, ...]:
        """(w, b, f) of ``piece``'s slice as this step's backward computed with them: fetched
        after its update (version + 1), the update undone."""
        owner, layer, part = self.owner, self.layer, piece.part
        outs = tuple(np.empty(a[part].shape, np.float32) for a in layer.arrays())
        nbytes = sum(a.nbytes for a in outs)
        (w, b, mw, mb, f, mf), stats = piece.node.client.fetch_kernels(
            owner.session, layer.name, placed.version + 1, outs, owner.deadline(piece.node, nbytes)
        )
        owner._count(layer.name, "fetched_bytes", stats.bytes_received)
        lr = np.float32(owner.sgd.lr)
        return w + lr * mw, (b + lr * mb) if layer.bias else b, f + lr * mf

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
            x, hw, hb, hf, bn = placed.pending
            if layer.classes:  # the logits' gradient, float32 whatever the wire
                dy = np.array(self.dy)  # a copy: the caller may reuse its array
            else:
                dy = as_received(self.dy[:, grad], piece.node.client.wire_format)
            start = grad.start - wide.start
            logged = _Logged(x, hw, hb, hf, dy, start, self.ctx.step, bn, placed.answer)
            placed.log.append(logged)
            placed.pending = placed.answer = None
        self._edges.append((part, ew, eb, self._ef[piece.index]))
        self._take_dbn(part, self._dbn[piece.index])
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


def _bn_arrays(bn) -> list[np.ndarray]:
    """The arrays a :class:`~hetconv.stages.BatchNormSlice` sends (running ones in evaluation)."""
    arrays = [bn.weight, bn.bias]
    return arrays if bn.training else [*arrays, bn.running_mean, bn.running_var]
