"""One step of a replicated block split by images (:mod:`hetconv.split`): the master's part
of the exchange between the peers, and the cover of a peer that is lost."""

from __future__ import annotations

import math
import secrets
import threading
import time

import numpy as np

from hetconv.backends import Backend
from hetconv.replica import ReplicaBlock
from hetconv.split import MASTER, SplitPlan, part_sample, sampled_image
from hetconv.stages import stage_backward, stage_forward

from .call import Call
from .client import WorkerError
from .spotcheck import SpotCheckFailed


class SplitStep:
    """A step's block split by images among the workers (:mod:`hetconv.split`), as the master
    keeps it: the plan, the workers' clients, and what it covers for workers it loses.

    The master computes a lost worker's slice of the next layer itself, as always. With the
    block split that worker's peers also wait for its parts, so the master sends them, as that
    worker: forward its images' block output (:meth:`lost_forward`), backward its slice's
    input-gradient rows of their images (:meth:`lost_backward`), each as soon as the worker is
    known lost. The rows of a lost worker's images, which it would have summed and taken
    through the block, the master collects (:meth:`rows`): its own computation's, and what
    every worker that answered computed for them (FetchPart).

    With the master a peer (``split_all``, :data:`~hetconv.split.MASTER` in the plan) the
    master computes the block on its own images only (:meth:`forward_all`) and exchanges parts
    like a worker (:meth:`backward_all`); what it covers for lost workers it then takes through
    the block on their images itself (:meth:`finish_all`).
    """

    def __init__(self, plan: SplitPlan, clients: dict, session: int, step: int, block: str):
        self.plan, self.clients = plan, dict(clients)
        self.session, self.step, self.block = session, step, block
        self.lost: dict[int, np.ndarray | None] = {}  # node -> its slice's input gradient
        self.sent_bytes = 0  # what the master put into workers for lost ones
        # split_all: the master a peer
        self.data: ReplicaBlock | None = None  # the step's block (images, kernels)
        self.y: np.ndarray | None = None  # the block's output, every image, assembled here
        self.run = None  # the master's StageRun on its own images
        self.runs: dict[int, object] = {}  # node -> a StageRun computed here on its images
        self.dx: np.ndarray | None = None  # the master's own input-gradient part, every image
        self.fetched: set[int] = set()  # nodes whose rows of the master's images it summed
        self.exchanged_bytes = 0  # what the master put into and fetched from workers as a peer
        self.compute = {"forward": 0.0, "backward": 0.0}  # the master's block computation, s
        self.rows_put: set[int] = set()  # workers its own rows went to as its stage made them
        self.extra: np.ndarray | None = None  # pieces computed here outside the split: their dx
        self._pending: list[Call] = []  # puts the master does not wait for
        self.blamed: set[str] = set()  # workers whose parts were found wrong this step
        self.suspects: dict[str, str] = {}  # split_all: worker -> what of its output was wrong
        self.check_seconds = 0.0  # split_all: the master's recomputation of workers' images
        self.parts_seconds = 0.0  # the part and rows checks' (blame_parts)
        self._answered_at: dict[str, float] = {}  # worker -> when its stage forward answered
        self._next_ask = 0.0  # when to ask receivers what they lack next

    @property
    def with_master(self) -> bool:
        """Whether the master is one of the peers (``split_all``)."""
        return self.plan.master is not None

    def covers(self, address: str) -> bool:
        """Whether ``address`` computes part of the block this step."""
        return address in self.plan.addresses

    def _put(
        self, source: int, rows, gradient: bool, timeout: float, wait: bool = True, skip=()
    ) -> int:
        """``rows(address)`` put into every other worker of the plan (but the nodes in
        ``skip``), as node ``source``, in parallel; a worker that is gone too is no matter (it
        is lost in its own call). ``wait``: until every put has ended (else :meth:`settle`
        does). The bytes put."""
        calls, sent = [], 0
        for i, address in enumerate(self.plan.addresses):
            if i == source or i in self.lost or address == MASTER or i in skip:
                continue
            part = np.ascontiguousarray(rows(address))
            sent += part.nbytes
            calls.append(self._put_one(address, source, part, gradient, timeout))
        if not wait:
            self._pending.extend(calls)
            return sent
        for call in calls:
            try:
                call.result()
            except Exception:  # noqa: BLE001 (that worker's own call fails and loses it)
                pass
        return sent

    def _put_one(self, address: str, source: int, part, gradient: bool, timeout: float) -> Call:
        return Call(
            self.clients[address].put_part, self.session, self.step, self.block, source, part,
            gradient, timeout, self.plan.round,
        )  # fmt: skip

    def silent(self, calls: list, links: dict, per_image: int) -> dict[str, str]:
        """Peer address -> why it is silent: asked at most twice a second, each receiver whose
        stage call (``calls``: (address, call)) has not answered names the parts it lacks; a
        peer whose own stage call answered (it had its images' block output) :data:`PART_GRACE`
        seconds ago, plus four times its part's transfer (``links``: address -> bytes per
        second; ``per_image``: the block output's bytes per image), is silent when one lacks
        its part."""
        now = time.monotonic()
        for address, call in calls:
            if call.done() and not call.failed():
                self._answered_at.setdefault(address, now)
        if now < self._next_ask:
            return {}
        self._next_ask = now + 0.5
        silent = {}
        for receiver, call in calls:
            if call.done() or not self.covers(receiver):
                continue
            try:
                missing = self.clients[receiver].missing_parts(self.session, self.step, self.block)
            except Exception:  # noqa: BLE001 (that worker's own call fails and loses it)
                continue
            for node in missing:
                sender = self.plan.addresses[node] if node < len(self.plan.peers) else MASTER
                answered = self._answered_at.get(sender)
                if sender == MASTER or answered is None:
                    continue
                images = self.plan.images(sender)
                rate = min(links.get(sender, math.inf), links.get(receiver, math.inf))
                grace = PART_GRACE + 4 * (images.stop - images.start) * per_image / rate
                if now - answered > grace:
                    silent[sender] = (
                        f"it answered its stage forward {now - answered:.1f} s ago, but worker "
                        f"{receiver} never got its part: not re-admitted this run"
                    )
        return silent

    def check_parts(self, address: str, x: np.ndarray, timeout: float = 30.0) -> list[str]:
        """The workers whose parts worker ``address`` received differ from ``x`` (the block's
        output on every image, as the master has it) at a sample of places drawn now
        (:func:`~hetconv.split.part_sample`); [] when every part agrees. The master's own
        parts are not checked (it put them from ``x``)."""
        plan = self.plan
        seed = secrets.randbits(64)
        got = self.clients[address].fetch_samples(
            self.session, self.step, self.block, seed, PART_SAMPLE, timeout
        )
        senders = [(i, a) for i, (a, _, count) in enumerate(plan.peers) if count]
        if got.shape != (len(senders), PART_SAMPLE):
            raise WorkerError(address, f"a sample of the parts of shape {got.shape}")
        liars = []
        for row, (node, sender) in zip(got, senders, strict=True):
            if sender == MASTER or node in self.lost:
                continue
            want = part_sample(x[plan.images(sender)], seed, node, PART_SAMPLE)
            if np.abs(row - want).max() > PART_RTOL * np.abs(want).max():
                liars.append(sender)
        return liars

    def check_rows(self, address: str, recompute, timeout: float = 30.0) -> list[str]:
        """The workers whose input-gradient rows worker ``address`` received differ from the
        master's recomputation of one of its images, drawn now (``recompute(sender, image)``:
        that sender's rows of that image; None: it cannot), at a sample of places
        (:func:`~hetconv.split.row_sample`); [] when every one agrees. The master's own rows
        are not checked (it put them)."""
        plan = self.plan
        seed = secrets.randbits(64)
        got = self.clients[address].fetch_samples(
            self.session, self.step, self.block, seed, PART_SAMPLE, timeout, gradient=True
        )
        receiver = plan.node(address)
        others = [(i, a) for i, a in enumerate(plan.addresses) if i != receiver]
        if got.shape != (len(others), PART_SAMPLE):
            raise WorkerError(address, f"a sample of the rows of shape {got.shape}")
        images = plan.images(address)
        image = images.start + sampled_image(seed, images.stop - images.start)
        liars = []
        for row, (node, sender) in zip(got, others, strict=True):
            if sender == MASTER or node in self.lost:
                continue
            rows = _recomputed(recompute, sender, image)  # False: it would not show them
            if rows is None:
                continue
            want = part_sample(rows, seed, node, PART_SAMPLE) if rows is not False else None
            if want is None or np.abs(row - want).max() > PART_RTOL * np.abs(want).max():
                liars.append(sender)
        return liars

    def rows_first(self, timeout: float = 60.0) -> list[tuple[slice, object]]:
        """With the master a peer: for its own piece's stage backward
        (:func:`~hetconv.stages.stage_backward`'s ``rows_first``), each live worker's images,
        with what puts the master's input-gradient rows of them into that worker as soon as
        they are computed (the worker waits for them before its block backward)."""
        plan = self.plan

        def sender(address: str, node: int):
            def done(images: slice, rows: np.ndarray) -> None:
                # (the master's dx adds its own piece's last: the same sum, bit for bit)
                extra = self.extra
                part = np.ascontiguousarray(rows if extra is None else extra[images] + rows)
                self._pending.append(self._put_one(address, plan.master, part, True, timeout))
                self.exchanged_bytes += part.nbytes
                self.rows_put.add(node)

            return done

        return [
            (plan.images(address), sender(address, plan.node(address)))
            for address in plan.workers
            if plan.node(address) not in self.lost
        ]

    def outside(self, dx: np.ndarray) -> None:
        """The input gradient ``dx`` (every image) of a piece the master computed for a worker
        outside the split (lost before the block began: a step computed again after a catch):
        the master's own, so its rows of the workers' images go with the master's, also those
        put first (:meth:`rows_first`; such pieces are computed before the master's own)."""
        if self.rows_put:
            raise RuntimeError(
                f"{self.block}: a piece outside the split came after the master's rows went"
            )
        self.extra = np.array(dx) if self.extra is None else self.extra + dx

    def settle(self) -> None:
        """Wait for the puts not waited for (their failures are their workers' calls')."""
        pending, self._pending = self._pending, []
        for call in pending:
            try:
                call.result()
            except Exception:  # noqa: BLE001
                pass

    def lost_forward(self, address: str, y: np.ndarray, timeout: float = 60.0) -> None:
        """Worker ``address`` is lost in forward: its images' rows of the block output ``y``
        (the master's, every image) go to the others as it."""
        node = self.plan.node(address)
        self.lost.setdefault(node, None)
        self.sent_bytes += self._put(node, lambda _: y[self.plan.images(address)], False, timeout)

    def lost_backward(self, address: str, dx: np.ndarray, timeout: float = 60.0) -> None:
        """Worker ``address`` is lost in backward: its slice's input gradient ``dx`` (every
        image, computed here) goes to the others by their images, as it; the rows of lost
        workers' images stay for :meth:`rows`."""
        node = self.plan.node(address)
        self.lost[node] = dx
        self.sent_bytes += self._put(node, lambda a: dx[self.plan.images(a)], True, timeout)

    def rows(self, answered: list[str], timeout: float = 60.0) -> np.ndarray | None:
        """The input gradient the master back-propagates through its block for the lost
        workers' images: zero but on those images, where it is every lost slice's rows (as
        computed here) plus the rows each worker that ``answered`` computed for them. None when
        nothing was lost."""
        if not self.lost:
            return None
        dxs = self._lost_gradients(list(self.lost))
        total = np.zeros_like(dxs[0])
        for node in sorted(self.lost):
            images = self.plan.images(self.plan.addresses[node])
            self._add_lost_rows(total[images], node, dxs, answered, timeout)
        return total

    def _lost_gradients(self, nodes: list[int]) -> list[np.ndarray]:
        """The lost slices' input gradients (computed here), of ``nodes`` in that order."""
        dxs = [self.lost[node] for node in nodes]
        if any(dx is None for dx in dxs):
            raise RuntimeError(f"{self.block}: a worker lost in the split has no gradient here")
        return dxs

    def _add_lost_rows(self, rows: np.ndarray, node: int, dxs, answered, timeout: float):
        """Add into ``rows`` (lost node ``node``'s images' rows) what that node would have
        summed: every lost slice's rows of them (``dxs``), then each worker's that
        ``answered`` (FetchPart)."""
        images = self.plan.images(self.plan.addresses[node])
        for dx in dxs:
            rows += dx[images]
        for address in [a for a in answered if a in self.clients]:  # (a whole block's: none)
            part, _ = self.clients[address].fetch_part(
                self.session, self.step, self.block, node, timeout, round_=self.plan.round
            )
            rows += part

    # -- the master as a peer (split_all) ----------------------------------------------------

    def forward_all(self, backend: Backend, block: ReplicaBlock, started: dict, timeout: float):
        """The block's output on every image, assembled here: the master's own images computed
        here and put into every worker, each worker's own images' output fetched as soon as it
        has it (FetchPart). A worker whose ReplicaForward (``started``: address -> its
        :class:`~.call.Call`) fails, or whose output does not come, has its images computed
        here: its stage call then fails, and the master puts them into the others as it."""
        plan, k = self.plan, block.w.shape[0]
        self.data = block
        conv = block.shape
        y = np.empty((conv.n, k, *block.stage.output_hw(conv.out_hw)), np.float32)
        fetches = {}
        for address in plan.workers:
            node, rows = plan.node(address), y[plan.images(address)]
            fetches[address] = Call(
                self.clients[address].fetch_part, self.session, self.step, self.block, node,
                timeout, gradient=False, out=rows, round_=plan.round,
            )  # fmt: skip
        own = plan.images(MASTER)
        if own.stop > own.start:  # (--master-block none: it computes none of it)
            start = time.perf_counter()
            y[own], self.run = stage_forward(
                backend, block.x[own], block.w, block.b, block.sides, block.stage, slice(0, k)
            )
            self.compute["forward"] += time.perf_counter() - start
            self.exchanged_bytes += self._put(plan.master, lambda _: y[own], False, timeout, False)
        for address, call in fetches.items():
            if _answered(call, started.get(address)):
                self.exchanged_bytes += y[plan.images(address)].nbytes
                self._check_own(backend, block, y, address)
                continue
            node, images = plan.node(address), plan.images(address)
            start = time.perf_counter()
            y[images], self.runs[node] = stage_forward(
                backend, block.x[images], block.w, block.b, block.sides, block.stage,
                slice(0, k),
            )  # fmt: skip
            self.compute["forward"] += time.perf_counter() - start
        self.y = y
        return y

    def _check_own(self, backend: Backend, block: ReplicaBlock, y: np.ndarray, address: str):
        """One image of worker ``address``'s fetched block output ``y``, drawn now, computed
        here and compared: a worker that gave the master (and its peers alike) a wrong output
        is a suspect, lost by :func:`blame_parts` (the receivers' samples would agree)."""
        images = self.plan.images(address)
        i = images.start + secrets.randbelow(images.stop - images.start)
        start = time.perf_counter()
        want, _ = stage_forward(
            backend, block.x[i : i + 1], block.w, block.b, block.sides, block.stage,
            slice(0, block.w.shape[0]),
        )  # fmt: skip
        self.check_seconds += time.perf_counter() - start  # a check's, not the block's share
        if np.abs(y[i] - want[0]).max() > PART_RTOL * float(np.abs(want).max()):
            self.suspects[address] = f"its block output of image {i}"

    def backward_all(self, backend: Backend, dx: np.ndarray | None, timeout: float = 60.0):
        """The master's part of the block's kernel and bias gradients, as a peer: the rows of
        its input-gradient part ``dx`` (every image; None: zeros) for each worker's images put
        into it, the rows every worker computed for the master's images fetched and summed
        with its own in plan order, the sum taken through the block on its images. A worker
        lost before it gave its rows has them added by :meth:`finish_all`."""
        plan = self.plan
        self.dx = dx = np.zeros_like(self.y) if dx is None else dx
        own = plan.images(MASTER)
        live = [a for a in plan.workers if plan.node(a) not in self.lost]
        if own.stop == own.start:  # it computes none of the block: it only gives its rows
            live = []
        fetches = {
            a: Call(
                self.clients[a].fetch_part,
                self.session,
                self.step,
                self.block,
                plan.master,
                timeout,
                round_=plan.round,
            )
            for a in live
        }
        self.exchanged_bytes += self._put(
            plan.master, lambda a: dx[plan.images(a)], True, timeout, False, self.rows_put
        )
        g = np.array(dx[own])
        for address in live:  # in plan order: the same sum on every run
            try:
                part, _ = fetches[address].result()
            except Exception:  # noqa: BLE001 (lost: finish_all adds its slice's rows)
                continue
            g += part
            self.exchanged_bytes += part.nbytes
            self.fetched.add(plan.node(address))
        if self.run is None:
            return np.zeros_like(self.data.w), np.zeros_like(self.data.b)
        start = time.perf_counter()
        _, dw, db = stage_backward(backend, self.run, g, slice(0, self.data.w.shape[0]), False)
        self.compute["backward"] += time.perf_counter() - start
        return dw, db

    def finish_all(self, backend: Backend, answered: list[str], timeout: float = 60.0):
        """The block's kernel and bias gradients the lost workers' slices still owe, as
        (dw, db), or None when nothing was lost: their rows of the master's images it did not
        fetch from them, and every lost worker's images' whole gradient (its slice's rows
        computed here, the master's own, each worker's that ``answered``, fetched) through the
        block on those images (its forward run again here where the worker computed it)."""
        self.settle()
        if not self.lost:
            return None
        dxs = self._lost_gradients(sorted(self.lost))
        plan, block = self.plan, self.data
        k = block.w.shape[0]
        dw, db = np.zeros_like(block.w), np.zeros_like(block.b)

        def back(run, g) -> None:
            start = time.perf_counter()
            _, w, b = stage_backward(backend, run, g, slice(0, k), False)
            self.compute["backward"] += time.perf_counter() - start
            dw[...] += w
            db[...] += b

        own = plan.images(MASTER)
        owed = [dx[own] for node, dx in sorted(self.lost.items()) if node not in self.fetched]
        if owed and self.run is not None:
            back(self.run, np.sum(owed, axis=0, dtype=np.float32))
        for node in sorted(self.lost):
            images = plan.images(plan.addresses[node])
            g = np.array(self.dx[images])
            self._add_lost_rows(g, node, dxs, answered, timeout)
            run = self.runs.get(node)
            if run is None:
                _, run = stage_forward(
                    backend, block.x[images], block.w, block.b, block.sides, block.stage,
                    slice(0, k),
                )  # fmt: skip
            back(run, g)
        return dw, db


#: Values of each sender's part a receiver is asked for after its stage forward.
PART_SAMPLE = 64
#: The largest difference over the sample's scale between a part as a worker received it and
#: the master's block output: a bfloat16 wire's rounding (2**-7) and float32 round-off, with
#: room; a part scaled by 1.5 is off by a third of its values.
PART_RTOL = 1e-2


def blame_parts(job, piece, membership, spot_checks, calls=(), timeout: float = 30.0) -> bool:
    """Before a split block's receiver's stage forward answer is checked or used: ask the
    worker (``piece``'s) for a sample of every part it received, at places drawn now (the
    senders put their parts before, so none can know them), and compare it with the master's
    block output (``job.x``). Every sender whose part differs is lost and kept out for the run
    (:class:`~.spotcheck.SpotCheckFailed`; with spot checks on, the step is computed again), not
    the receiver, which computed on what it got, and the step is computed again without them.
    True when the answer was computed on a wrong part (it is then neither checked nor kept:
    the step is redone). Part of the spot checks: nothing is sampled with them off.

    Backward, on the steps spot checks are due: the input-gradient rows the receiver got, of
    one of its images, against the master's recomputation of each sender's rows of it
    (:func:`_rows_of`, the senders' pieces from ``calls``)."""
    block = getattr(job, "replica", None)  # forward: the ReplicaBlock; backward: its gradients
    split = getattr(block, "split", None)
    if split is None or not piece.index or spot_checks is None:
        return False
    for liar, what in list(split.suspects.items()):  # split_all: outputs it fetched, wrong
        _blame(split, membership, spot_checks, liar, f"{what}, fetched by the master,")
    if split.blamed:  # a part was wrong this step: the answers on it are redone, not checked
        return True
    address = piece.node.client.address
    if not split.covers(address):
        return False
    if not isinstance(block, ReplicaBlock):  # backward: the rows it got
        recompute = _rows_of(job, calls) if spot_checks.due else None
        if recompute is None:
            return False
        liars = _timed(split, spot_checks, split.check_rows, address, recompute, timeout)
        what = f"the input-gradient rows it put into worker {piece.node.name}"
        for liar in liars:
            _blame(split, membership, spot_checks, liar, what, "backward")
        return bool(liars)
    liars = _timed(split, spot_checks, split.check_parts, address, job.x, timeout)
    for liar in liars:
        what = f"the block output it put into worker {piece.node.name}"
        _blame(split, membership, spot_checks, liar, what)
    return bool(liars)


def _rows_of(job, calls):
    """``recompute(sender, image)`` for :meth:`SplitStep.check_rows`: worker ``sender``'s
    piece of a fused stage's backward (``job``, sent kernels) on one image, its input gradient
    of that image; None where one image cannot be recomputed alone (batch norm: statistics
    over the batch). Resident kernels: the job's own (the slice fetched after its update and
    taken back a step, :meth:`~.resident_jobs._ResidentBackward.rows_of`)."""
    resident = getattr(job, "rows_of", None)
    if resident is not None:
        return resident(calls)
    ranges = getattr(job, "_ranges", None)
    if ranges is None or getattr(job, "batchnorm", ()) or not job.need_input_grad:
        return None
    pieces = {p.node.client.address: p for p, _ in calls}

    def recompute(sender: str, i: int) -> np.ndarray | None:
        piece = pieces.get(sender)
        if piece is None:
            return None
        (wide, grad), part = ranges(piece), piece.part
        own = slice(part.start - wide.start, part.stop - wide.start)
        _, run = stage_forward(
            job.backend, job.x[i : i + 1], job.w[wide], job.b[wide], job.sides, job.stage, own
        )
        rel = slice(grad.start - wide.start, grad.stop - wide.start)
        dy = np.ascontiguousarray(job.dy[i : i + 1, grad])
        dx, _, _ = stage_backward(job.backend, run, dy, rel, True)
        return dx[0]

    return recompute


def _timed(split: SplitStep, spot_checks, check, *args) -> list[str]:
    """``check(*args)``, its seconds counted in the spot checks' and the split's part checks'
    (the trace's ``replica_split`` record: a step with no spot check due makes them too)."""
    start = time.perf_counter()
    try:
        return check(*args)
    finally:
        seconds = time.perf_counter() - start
        spot_checks.seconds += seconds
        split.parts_seconds += seconds


def _recomputed(recompute, sender: str, image: int):
    """``recompute(sender, image)``, or False when the sender failed to show what it needs
    (a :class:`~.client.WorkerError` of its own)."""
    try:
        return recompute(sender, image)
    except WorkerError as e:
        if e.address != sender:
            raise
        return False


def _blame(
    split: SplitStep, membership, spot_checks, liar: str, what: str, phase: str = "forward"
) -> None:
    """Worker ``liar`` is lost and kept out (once a step); the step is computed again."""
    if liar in split.blamed:
        return
    split.blamed.add(liar)
    node = next(n for n in membership.nodes if n.client is not None and n.client.address == liar)
    error = SpotCheckFailed(
        node.name,
        f"{phase} {split.block}: {what} differs from the master's by more than {PART_RTOL:g} "
        "of its scale: finite but wrong; not re-admitted this run",
    )
    membership.lose(node, error)
    spot_checks.caught.append(node.name)


#: Seconds a receiver may still lack a peer's part after that peer's own stage forward answered
#: (its parts were on their way before) before the peer is taken for silent, beyond four times
#: the part's transfer over the slower of their measured links.
PART_GRACE = 0.5


class SilentPeer(WorkerError):
    """A peer had its images' block output (its own stage forward answered), but a receiver
    never got it: it is lost and kept out for the run (its receivers would wait for it at
    every step)."""

    keep_out = True


def silent_peers(job, calls) -> list:
    """While the master waits for a split block's stage forward answers (``calls``: (piece,
    call)): the pieces of peers whose part some receiver still lacks :data:`PART_GRACE`
    seconds after their own stage forward answered, each with its :class:`SilentPeer` error;
    the master covers them (it puts their parts into the others as them), not the
    receivers."""
    block = getattr(job, "replica", None)
    split = block.split if isinstance(block, ReplicaBlock) else None
    if split is None:
        return []
    links = {p.node.client.address: p.node.link_bytes_per_second for p, _ in calls}
    receivers = [(p.node.client.address, c) for p, c in calls]
    silent = split.silent(receivers, links, job.x[0].nbytes)
    return [
        (piece, SilentPeer(piece.node.name, f"forward {split.block}: {silent[address]}"))
        for piece, _ in calls
        if (address := piece.node.client.address) in silent
    ]


def _answered(call: Call, replica: Call | None) -> bool:
    """Whether ``call`` (a fetch of a worker's block output) answered; False as soon as the
    worker's ReplicaForward (``replica``) failed."""
    ended = threading.Event()
    call.notify(ended)
    if replica is not None:
        replica.notify(ended)
    while True:
        ended.clear()
        if call.done():
            return not call.failed()
        if replica is not None and replica.failed():
            return False
        ended.wait(0.5)
