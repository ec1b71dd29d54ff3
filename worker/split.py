"""The worker's side of a replicated block split by images (:mod:`hetconv.split`).

A ReplicaForward that carries a :class:`~hetconv.proto.worker_pb2.SplitBlock` sends only this
worker's own images: the worker runs the block on them, keeps what the block's backward needs,
and sends its output on them to every other peer (PutPart, from a few sender threads, so the
call answers once the block is computed). A stage call that names the block waits here until
every peer's part has come (:meth:`SplitCalls.input_for`) and runs on the whole batch, in
image order. Its backward's input-gradient part covers every image: the worker sends each
other peer the rows of that peer's images, keeps them (FetchPart answers them to a master that
lost the peer), waits for every other peer's rows of its own images, sums them with its own in
peer order and back-propagates the sum through the block on its own images
(:meth:`SplitCalls.gradients`).

The master may be a peer too (``split_all``: the peer marked ``master``, with no address):
nothing is sent to it. It puts its own images' output and its rows of this worker's images like
any peer, and fetches (FetchPart) this worker's own images' output, once the block has run, and
the rows of its own images, as soon as the stage backward has them.

A part from a source the worker already has is ignored: the master resends a lost worker's
parts as that worker, from what it computed itself, and whichever comes first counts (they are
the same tensor, to float32 round-off). Parts may come before the worker's own ReplicaForward
of the step; a part of an older step than the one held is refused (FAILED_PRECONDITION), one of
a newer step replaces what was held.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from hetconv.calls import FETCH_PART, PUT_PART
from hetconv.errors import InvalidCall, MissingForward
from hetconv.formats import FLOAT32, answer_format
from hetconv.proto import worker_pb2 as pb
from hetconv.split import MAX_SAMPLE, part_sample, row_sample
from hetconv.worker.context import WorkerContext
from hetconv.worker.peers import PART_SEND, CallerGone, PeerLinks, PreparedPeers, WaitingCall

#: Peers a split may name (a LAN's laptops; far beyond any plan the master makes).
MAX_PEERS = 64
#: Seconds a stage call waits for its peers' parts when its own call has no deadline.
PART_WAIT = 600.0


class PartTimeout(MissingForward):
    """The peers' parts did not all come in time (FAILED_PRECONDITION)."""

    status = grpc.StatusCode.DEADLINE_EXCEEDED


@dataclass(frozen=True)
class SplitLayout:
    """Who computes the block on which images: ``peers`` (address, start, count) in image
    order, tiling the batch; this worker is ``node``; ``master``: the master's node, when it
    is a peer (it fetches its parts: none is sent to it)."""

    node: int
    peers: tuple[tuple[str, int, int], ...]
    master: int | None = None

    @classmethod
    def from_proto(cls, split: pb.SplitBlock) -> SplitLayout:
        peers = tuple((p.address, p.start, p.count) for p in split.peers)
        if not 2 <= len(peers) <= MAX_PEERS:
            raise InvalidCall(f"a split names {len(peers)} peers: 2 to {MAX_PEERS}")
        if split.node >= len(peers):
            raise InvalidCall(f"split node {split.node} is not one of its {len(peers)} peers")
        masters = [i for i, p in enumerate(split.peers) if p.master]
        if len(masters) > 1:
            raise InvalidCall(
                f"a split names {len(masters)} masters (peers {masters}): one at most"
            )
        if split.node in masters:
            raise InvalidCall(f"split node {split.node} is the master's, not this worker's")
        at = 0
        for i, (address, start, count) in enumerate(peers):
            if not address and i not in masters:
                raise InvalidCall(f"split peer {i} has no address")
            if start != at or count < (0 if i in masters else 1):
                raise InvalidCall(
                    f"split peer {i} has images {start}..{start + count}: the peers' images must "
                    f"tile the batch in order (expected from {at}, at least one but the "
                    "master's)"
                )
            at += count
        return cls(split.node, peers, masters[0] if masters else None)

    @property
    def batch(self) -> int:
        _, start, count = self.peers[-1]
        return start + count

    def images(self, node: int) -> slice:
        _, start, count = self.peers[node]
        return slice(start, start + count)

    @property
    def own(self) -> slice:
        return self.images(self.node)

    @property
    def others(self) -> list[int]:
        return [i for i in range(len(self.peers)) if i != self.node]

    @property
    def senders(self) -> list[int]:
        """The peers that compute the block on some images (a master may compute none)."""
        return [i for i, (_, _, count) in enumerate(self.peers) if count]


@dataclass
class _Step:
    """One (session, block)'s split step: what came, what was sent."""

    step: int
    round: int
    layout: SplitLayout | None = None
    run: object = None  # the block's StageRun on this worker's images
    outputs: dict[int, np.ndarray] = field(default_factory=dict)  # source -> its images' output
    gradients: dict[int, np.ndarray] = field(default_factory=dict)  # source -> rows of mine
    sent: dict[int, np.ndarray] = field(default_factory=dict)  # node -> my rows of its images
    y: np.ndarray | None = None  # the whole batch's output, once assembled
    done: bool = False  # this worker's backward of the step has run
    backward: bool = False  # this worker's stage backward of the step has begun

    @property
    def nbytes(self) -> int:
        held = [*self.outputs.values(), *self.gradients.values(), *self.sent.values()]
        return sum(a.nbytes for a in held) + (self.y.nbytes if self.y is not None else 0)


class SplitCalls:
    """PutPart and FetchPart, and the split block's hooks for ReplicaForward and the stage
    calls, on a :class:`~hetconv.worker.context.WorkerContext`."""

    def __init__(self, context: WorkerContext, token: str | None = None):
        self.context = context
        self.token = token
        self._links: dict[int, PeerLinks] = {}  # session -> its senders, oldest first
        self._steps: dict[tuple[int, str], _Step] = {}
        self._latest: dict[int, int] = {}  # session -> the latest step its master called
        self.prepared = PreparedPeers(4 * context.config.sessions)
        self._busy: set[tuple[int, str, int]] = set()  # ReplicaForwards computing here
        self._changed = threading.Condition()
        self.tls = False

    def use(self, token: str | None, tls: bool) -> None:
        """Reach peers with ``token`` (the worker's own); a worker serving TLS refuses to
        split (its peers would need a CA it does not have: not built)."""
        self.close()
        self.token, self.tls = token, tls

    def links(self, session: int) -> PeerLinks:
        """``session``'s senders: a peer that never takes its parts holds only those (their
        puts end at :data:`PART_SEND`); at most the worker's sessions' worth are kept."""
        with self._changed:
            links = self._links.pop(session, None) or PeerLinks(self.token)
            self._links[session] = links  # the most recent last
            old = list(self._links)[: max(0, len(self._links) - self.context.config.sessions)]
            gone = [self._links.pop(s) for s in old]
        for links_ in gone:
            links_.close()
        return links

    def called(self, session: int, step: int) -> None:
        """The master called this worker at ``step`` of ``session``: parts may name at most
        the next step (:meth:`_take`)."""
        with self._changed:
            self._latest.pop(session, None)
            self._latest[session] = max(step, self._latest.get(session, step))
            while len(self._latest) > 4 * self.context.config.sessions:
                del self._latest[next(iter(self._latest))]

    def computing(self, request: pb.ConvRequest) -> object:
        """A context: block ``request.layer`` of this step is computed here meanwhile (a
        FetchPart waiting for it is not idle)."""
        split, key = self, (request.session, request.layer, request.step)

        class _Computing:
            def __enter__(self):
                with split._changed:
                    split._busy.add(key)

            def __exit__(self, *_):
                with split._changed:
                    split._busy.discard(key)
                    split._changed.notify_all()

        self.called(request.session, request.step)
        return _Computing()

    # -- the step's record ------------------------------------------------------------------

    def _record(self, session: int, layer: str, step: int, round_: int) -> _Step:
        """The record of (session, block) at ``step`` and ``round_``, made (replacing an older
        one) when there is none; a call of an older step or round is refused, but for a record
        only peers' parts made (a part naming a step ahead: it goes). Under ``_changed``."""
        key = (session, layer)
        held = self._steps.get(key)
        if held is not None and held.layout is None and (held.step, held.round) > (step, round_):
            held = None
        if held is not None and (held.step, held.round) > (step, round_):
            raise MissingForward(
                f"block {layer!r} step {step} round {round_}: this worker is at step "
                f"{held.step} round {held.round} of it already"
            )
        if held is None or (held.step, held.round) < (step, round_):
            held = self._steps[key] = _Step(step, round_)
            self._limit()
        return held

    def _limit(self) -> None:
        """At most the worker's sessions' worth of split records: the oldest go."""
        while len(self._steps) > 2 * self.context.config.sessions:
            del self._steps[next(iter(self._steps))]

    def _held_bytes(self) -> int:
        return sum(s.nbytes for s in self._steps.values())

    def _take(self, request: pb.ConvRequest, part: np.ndarray, gradient: bool) -> None:
        """File a part that came (PutPart), first one per source counting."""
        source = request.part.source
        if source >= MAX_PEERS:
            raise InvalidCall(f"part source {source}: a split has at most {MAX_PEERS} peers")
        if not np.isfinite(part).all():
            raise InvalidCall("the part holds NaN or Inf")
        with self._changed:
            latest = self._latest.get(request.session)
            if latest is not None and request.step > latest + 1:
                raise InvalidCall(
                    f"a part of step {request.step}: session {request.session} is at step "
                    f"{latest} here, and a part may be at most one step ahead"
                )
            record = self._record(request.session, request.layer, request.step, request.part.round)
            layout = record.layout
            if layout is not None:
                _check_part(layout, source, part, gradient, record)
            # held in the worker's one memory budget: refused (RESOURCE_EXHAUSTED) when over it
            held = self._held_bytes() + part.nbytes
            self.context.budget.hold("split parts", held, "the split's parts", request.session)
            into = record.gradients if gradient else record.outputs
            into.setdefault(source, part)
            self._changed.notify_all()

    # -- the calls --------------------------------------------------------------------------

    def put(self, messages):
        request, (p,), receive = self.context.receive(messages, PUT_PART)
        self._take(request, p, request.part.gradient)
        return [], 0.0, receive

    def fetch(self, messages):
        request, _, receive = self.context.receive(messages, FETCH_PART)
        if request.part.sample:
            return [("p", self._sampled(request), FLOAT32)], 0.0, receive
        if request.part.missing:
            return [("p", self._missing(request), FLOAT32)], 0.0, receive
        source = request.part.source
        if not request.part.gradient or self._for_master(request):
            part = self._fetch_waiting(request, source)
            return [("p", part, answer_format(request.answer_dtype))], 0.0, receive
        with self._changed:
            record = self._steps.get((request.session, request.layer))
            if record is None or not _at(record, request) or not record.done:
                have = "nothing" if record is None else f"step {record.step}"
                raise MissingForward(
                    f"no backward of split block {request.layer!r} at step {request.step} "
                    f"has run here (have {have})"
                )
            part = record.sent.get(request.part.source)
        if part is None:
            raise InvalidCall(f"node {request.part.source} is not another peer of this split")
        fmt = answer_format(request.answer_dtype)
        return [("p", part, fmt)], 0.0, receive

    def _sampled(self, request: pb.ConvRequest) -> np.ndarray:
        """A FetchPart ``sample``: that many values of every sender's block output as it came
        here (this worker's own included), at places drawn from ``sample_seed``
        (:func:`~hetconv.split.part_sample`), one row per sender in peer order; once every
        part has come. With ``gradient``: of every other peer's input-gradient rows of this
        worker's images, one image's (:func:`~hetconv.split.row_sample`)."""
        count = request.part.sample
        if count > MAX_SAMPLE:
            raise InvalidCall(f"a sample of {count} values per part: at most {MAX_SAMPLE}")
        if request.part.gradient:
            return self._sampled_rows(request, count)

        def missing(record: _Step) -> list[str]:
            return [f"node {i}" for i in record.layout.senders if i not in record.outputs]

        record = self._wait(request, request.layer, missing, "a sample of the parts", bool)
        seed = request.part.sample_seed
        with self._changed:
            parts = [(i, record.outputs[i]) for i in record.layout.senders]
        return np.stack([part_sample(part, seed, i, count) for i, part in parts])

    def _sampled_rows(self, request: pb.ConvRequest, count: int) -> np.ndarray:
        """A FetchPart ``sample`` of the rows every other peer put here, in peer order."""

        def missing(record: _Step) -> list[str]:
            return [f"node {i}'s rows" for i in record.layout.others if i not in record.gradients]

        record = self._wait(request, request.layer, missing, "a sample of the rows", bool)
        seed = request.part.sample_seed
        with self._changed:
            rows = [(i, record.gradients[i]) for i in record.layout.others]
        return np.stack([row_sample(part, seed, i, count) for i, part in rows])

    def _missing(self, request: pb.ConvRequest) -> np.ndarray:
        """A FetchPart ``missing``: the senders whose block output of the request's step has
        not come here yet, at once (none when this worker has no split of it)."""
        with self._changed:
            record = self._steps.get((request.session, request.layer))
            if record is None or record.step != request.step or record.layout is None:
                return np.zeros(0, np.float32)
            gone = [i for i in record.layout.senders if i not in record.outputs]
        return np.array(gone, np.float32)

    def _for_master(self, request: pb.ConvRequest) -> bool:
        """Whether a FetchPart asks for the rows of the master's images (it is a peer)."""
        with self._changed:
            record = self._steps.get((request.session, request.layer))
            layout = record.layout if record is not None else None
            return layout is not None and layout.master == request.part.source

    def _fetch_waiting(self, request: pb.ConvRequest, source: int) -> np.ndarray:
        """What a FetchPart the master makes as a peer asks, once this worker has it: node
        ``source``'s images' block output, or (gradient) this worker's rows of the master's
        images."""
        gradient = request.part.gradient
        if source >= MAX_PEERS:
            raise InvalidCall(f"part source {source}: a split has at most {MAX_PEERS} peers")

        def missing(record: _Step) -> list[str]:
            if source >= len(record.layout.peers):
                raise InvalidCall(
                    f"part source {source}: the split has {len(record.layout.peers)} peers"
                )
            held = record.sent if gradient else record.outputs
            return [] if source in held else [f"node {source}'s part"]

        def idle(record: _Step | None) -> bool:  # nothing it waits for is computed here
            if gradient:
                return record is None or not record.backward
            return (request.session, request.layer, request.step) not in self._busy

        what = "the master's rows" if gradient else "the block output"
        record = self._wait(request, request.layer, missing, f"a fetch of {what}", idle)
        with self._changed:
            return record.sent[source] if gradient else record.outputs[source]

    # -- ReplicaForward ---------------------------------------------------------------------

    def forward(self, request: pb.ConvRequest, x: np.ndarray, run, y: np.ndarray) -> None:
        """A split ReplicaForward's end: ``y`` (the block's output on this worker's images,
        ``x``) kept with ``run``, and sent to every other peer."""
        if self.tls:
            raise InvalidCall(
                "this worker serves TLS, and a split block's peers talk plain gRPC (not built): "
                "replicate the block whole"
            )
        layout = SplitLayout.from_proto(request.split)
        named = [a for i, (a, _, _) in enumerate(layout.peers) if i != layout.master]
        self.prepared.admit(request.session, named, request.split.prepare)
        own = layout.own
        if x.shape[0] != own.stop - own.start:
            raise InvalidCall(
                f"x holds {x.shape[0]} images; this worker's part of the split is "
                f"{own.stop - own.start}"
            )
        with self._changed:
            record = self._record(request.session, request.layer, request.step, request.split.round)
            if record.layout is not None and record.layout != layout:
                raise InvalidCall("the split's peers changed within a round")
            for source, part in list(record.outputs.items()):  # parts that came early
                try:
                    _check_part(layout, source, part, False, record)
                except InvalidCall:
                    del record.outputs[source]
            record.layout, record.run = layout, run
            record.outputs[layout.node] = y
            self._changed.notify_all()
        self._send(request, layout, lambda node: y, False, request.split.round)

    def _send(self, request, layout: SplitLayout, rows, gradient: bool, round_: int, nodes=None):
        """Put ``rows(node)`` into each other peer (``nodes``: only those), from the sender
        threads."""
        fmt = answer_format(request.answer_dtype)
        for node in layout.others if nodes is None else nodes:
            if node == layout.master:  # it fetches what it needs
                continue
            part = pb.ConvRequest(
                phase=PUT_PART.phase, session=request.session, step=request.step,
                layer=request.layer if not gradient else request.replica_layer,
                part=pb.TensorPart(source=layout.node, gradient=gradient, round=round_),
            )  # fmt: skip
            address = layout.peers[node][0]
            # A failed send is no matter here: the master loses that peer in its own call
            # and covers it (hetconv.split).
            self.links(request.session).put_later(address, part, rows(node), fmt, PART_SEND)

    # -- the stage calls' hooks -------------------------------------------------------------

    def _wait(self, request: pb.ConvRequest, block: str, ready, what: str, idle=None) -> _Step:
        """The record of ``block`` at the request's step once ``ready(record)`` names nothing
        missing. The wait ends with its call: when the caller cancels or its deadline passes,
        at :data:`PART_WAIT`, and, while ``idle(record)`` (nothing it waits for is computed
        here), at the worker's idle timeout (:mod:`hetconv.worker.idle`); it holds no call slot
        meanwhile."""
        caller = WaitingCall(self.context, self._changed)
        deadline = time.monotonic() + caller.time_left(PART_WAIT)
        # A call that only waits here gives its call slot back meanwhile (--max-calls).
        with self.context.budget.waiting(), self._changed:
            try:
                while True:
                    record = self._steps.get((request.session, block))
                    if record is not None and _at(record, request) and record.layout:
                        missing = ready(record)
                        if not missing:
                            return record
                    elif record is not None and _past(record, request):
                        raise MissingForward(
                            f"split block {block!r} moved on to step {record.step} round "
                            f"{record.round}"
                        )
                    else:
                        missing = ["this worker's own ReplicaForward"]
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise PartTimeout(
                            f"{what} of split block {block!r} step {request.step}: still "
                            f"waiting for {', '.join(map(str, missing))} after "
                            f"{caller.waited():.0f} s"
                        )
                    caller.check(idle is not None and idle(record))
                    self._changed.wait(min(left, 1.0))
            finally:
                caller.check(False, raising=False)

    def is_split(self, request: pb.ConvRequest) -> bool:
        """Whether the block a stage call names is split here at the call's step."""
        with self._changed:
            record = self._steps.get((request.session, request.replica_layer))
            return record is not None and record.step == request.step and record.run is not None

    def input_for(self, request: pb.ConvRequest) -> np.ndarray:
        """The whole batch's block output, once every peer's part has come."""

        def missing(record: _Step) -> list[str]:
            return [f"node {i}" for i in record.layout.senders if i not in record.outputs]

        record = self._wait(request, request.replica_layer, missing, "the stage forward")
        with self._changed:
            if record.y is None:
                parts = [record.outputs[i] for i in record.layout.senders]
                record.y = np.concatenate(parts)
            return record.y

    def rows_first(self, request: pb.ConvRequest) -> list[tuple[slice, object]]:
        """For a stage backward naming a block split here: the other peers' images, each
        with what sends their input-gradient rows as soon as the stage's backward has them
        (:func:`~hetconv.stages.stage_backward`'s ``rows_first``), so the exchange runs beside
        the kernel gradients; [] when the block is not split."""
        if not self.is_split(request):
            return []
        with self._changed:
            record = self._steps[(request.session, request.replica_layer)]
            layout = record.layout
            record.backward = True

        def sender(node: int):
            def done(images: slice, rows: np.ndarray) -> None:
                part = np.ascontiguousarray(rows)
                with self._changed:
                    record.sent[node] = part
                self._send(request, layout, lambda _: part, True, record.round, [node])

            return done

        return [
            (layout.images(node), sender(node)) for node in layout.others if node in layout.senders
        ]

    def gradients(self, request: pb.ConvRequest, dx: np.ndarray, back) -> tuple:
        """(rw, rb): the input-gradient part ``dx`` (every image) sent on to the peers by their
        images, the peers' rows of this worker's images summed with its own, and that sum back
        through the block on its own images (``back(run, g)``)."""
        block = request.replica_layer
        with self._changed:
            record = self._steps.get((request.session, block))
            layout = record.layout
            if dx.shape != (layout.batch, *record.run.out_shape[1:]):
                raise InvalidCall(f"input gradient {dx.shape} does not match the split block")
            unsent = [node for node in layout.others if node not in record.sent]
            for node in unsent:  # not sent as the backward computed them (rows_first)
                record.sent[node] = np.ascontiguousarray(dx[layout.images(node)])
        self._send(request, layout, lambda node: record.sent[node], True, record.round, unsent)

        def missing(record: _Step) -> list[str]:
            return [f"node {i}" for i in record.layout.others if i not in record.gradients]

        record = self._wait(request, block, missing, "the stage backward")
        g = np.array(dx[layout.own])
        for node in layout.others:  # in peer order: the same sum on every run
            g += record.gradients[node]
        rw, rb = back(record.run, g)
        with self._changed:
            record.done = True
            self._changed.notify_all()
        return rw, rb

    def close(self) -> None:
        with self._changed:
            links, self._links = list(self._links.values()), {}
        for each in links:
            each.close()


def _check_part(layout: SplitLayout, source: int, part, gradient: bool, record) -> None:
    if source >= len(layout.peers) or source == layout.node:
        raise InvalidCall(
            f"part source {source}: this worker is node {layout.node} of "
            f"{len(layout.peers)} in the split"
        )
    rows = layout.images(layout.node if gradient else source)
    count = rows.stop - rows.start
    if part.ndim != 4 or part.shape[0] != count:
        raise InvalidCall(f"part {part.shape} from node {source}: expected {count} images' rows")
    if record.run is not None:
        want = (count, *record.run.out_shape[1:])
        if part.shape != want:
            raise InvalidCall(f"part {part.shape} from node {source}: expected {want}")


def _at(record: _Step, request: pb.ConvRequest) -> bool:
    """Whether ``record`` is of the request's step and of its part's round (0: any: a stage
    call comes after its own ReplicaForward of the round)."""
    wanted = request.part.round
    return record.step == request.step and (not wanted or record.round == wanted)


def _past(record: _Step, request: pb.ConvRequest) -> bool:
    """Whether ``record`` is of a later step, or a later round of the step, than asked."""
    wanted = request.part.round
    return record.step > request.step or (
        record.step == request.step and bool(wanted) and record.round > wanted
    )


__all__ = ["MAX_PEERS", "PART_WAIT", "CallerGone", "PartTimeout", "SplitCalls", "SplitLayout"]
