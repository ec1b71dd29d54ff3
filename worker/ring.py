"""A worker's part of the ring exchange (:mod:`hetconv.ring`): RingPart, which files a chunk
another rank (or the master) put here, and :meth:`RingCalls.all_reduce`, which sums this
worker's gradient over its ring (sending on :class:`~hetconv.worker.peers.PeerLinks`' threads
with the worker's own token, each put with a deadline) for an ImagesStep.

A chunk goes in segments (the request's ``segment_bytes``, :func:`hetconv.ring.segments`),
each put on a sender thread as soon as it is ready (:data:`OUTSTANDING` at most in flight,
each a view of the vector, not a copy), while the ring takes the previous rank's next one.

A ring fails for this worker (:class:`RingFailed`) when a put to the next rank fails (the
ring's wait for a part ends at once then), a part does not come within the request's
``wait_seconds``, or any rank (or the master) says the step's ring failed (``abort``); it then
tells every other rank so, so none waits for what will not come, and the ImagesStep answers
its own gradient (the master sums the step itself).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections import deque
from concurrent import futures

import grpc
import numpy as np

from hetconv.backends.arrays import to_host
from hetconv.calls import RING_PART
from hetconv.errors import InvalidCall
from hetconv.formats import FLOAT32
from hetconv.proto import worker_pb2 as pb
from hetconv.ring import (
    MASTER_ROUND,
    MAX_RANKS,
    all_gather_doubling,
    all_reduce,
    all_to_all,
    bucket_chunks,
    buckets,
    doubling_rounds,
    join64,
    rounds,
    split64,
)
from hetconv.worker import sumlog
from hetconv.worker.context import WorkerContext
from hetconv.worker.peers import PeerLinks
from hetconv.worker.summesh import SumLinks, SumListener

#: Seconds a put of a chunk may take, at most (a peer no faster is failed).
PUT_SECONDS = 60.0
#: Seconds an abort put may take (best effort), and the threads that put them per session.
ABORT_SECONDS = 2.0
ABORT_THREADS = 8
#: Steps of a session whose parts are kept (older ones are dropped as a step's call arrives).
KEPT_STEPS = 2
#: Puts of one ring in flight at most (a further one waits for the oldest to end).
OUTSTANDING = 4


class RingFailed(Exception):
    """This step's ring cannot finish here: the reason."""


class RingLinks(PeerLinks):
    """:class:`~hetconv.worker.peers.PeerLinks` that put RingParts, and aborts on threads of
    their own (never queued behind parts put into a peer that does not answer)."""

    call = RING_PART

    def __init__(self, token: str | None = None):
        super().__init__(token)
        self.aborts = futures.ThreadPoolExecutor(ABORT_THREADS, thread_name_prefix="hetconv-abort")

    def close(self) -> None:
        self.aborts.shutdown(wait=False)
        super().close()


def part_request(
    session: int, step: int, rank: int, round_: int, abort: bool = False, segment: int = 0
):
    """A RingPart's header (its tensor added by the sender)."""
    ring = pb.ImagesRing(rank=rank, round=round_, abort=abort, segment=segment)
    return pb.ConvRequest(
        phase=RING_PART.phase, session=session, step=step, images=pb.ImagesStep(ring=ring)
    )


class RingCalls:
    """RingPart's core and the ring exchange of a session's steps."""

    def __init__(self, context: WorkerContext):
        self.context = context
        self.token: str | None = None
        self.tls = False
        # (session, step, round, segment) -> the part
        self._parts: dict[tuple[int, int, int, int], np.ndarray] = {}
        self._aborted: set[tuple[int, int]] = set()
        self._put_failed: dict[tuple[int, int], str] = {}  # (session, step) -> why
        self._told: set[tuple[int, int]] = set()  # (session, step): aborts sent
        self._latest: dict[int, int] = {}  # session -> the latest step its master called
        self._links: dict[int, RingLinks] = {}  # session -> its senders, oldest first
        self._changed = threading.Condition()
        self._mesh = SumLinks()  # the ring's parts to the peers' sum ports
        self._listener: SumListener | None = None  # this worker's sum port

    def use(self, token: str | None, tls: bool) -> None:
        """Reach peers with ``token`` (the worker's own); a worker serving TLS refuses the
        ring (its peers would need a CA it does not have: not built)."""
        self.close()
        self.token, self.tls = token, tls
        self._mesh = SumLinks(token)

    @property
    def sum_frames(self) -> int:
        """Parts filed from this worker's sum port since it opened."""
        return self._listener.frames if self._listener is not None else 0

    def listen(self, host: str, port: int = 0) -> int:
        """Open this worker's sum port on ``host`` (:mod:`hetconv.worker.summesh`; ``port``
        0: a free one) and answer it; 0 (none) for a worker serving TLS."""
        if self.tls:
            return 0
        if self._listener is None:
            self._listener = SumListener(host.strip("[]"), self.file, self.token, port)
        return self._listener.port

    def _session_links(self, session: int) -> RingLinks:
        """``session``'s senders; at most the worker's sessions' worth are kept."""
        with self._changed:
            links = self._links.pop(session, None) or RingLinks(self.token)
            self._links[session] = links  # the most recent last
            old = list(self._links)[: max(0, len(self._links) - self.context.config.sessions)]
            gone = [self._links.pop(s) for s in old]
        for link in gone:
            link.close()
        return links

    def put(self, messages):
        """RingPart: file the chunk (or the abort) for the step's ring."""
        request, arrays, receive = self.context.receive(messages, RING_PART)
        ring = request.images.ring
        key = (request.session, int(request.step))
        if ring.abort:
            with self._changed:
                self._aborted.add(key)
                self._changed.notify_all()
            return [], 0.0, receive
        if len(arrays) != 1 or arrays[0].ndim != 1 or request.tensors[0].dtype != pb.FLOAT32:
            raise InvalidCall("a ring part is one float32 vector p")
        self.file(*key, int(ring.round), int(ring.segment), arrays[0])
        return [], 0.0, receive

    def file(self, session: int, step: int, round_: int, segment: int, part: np.ndarray) -> None:
        """File a part another rank put here (a RingPart, or a frame on the sum port) where
        its ring waits for it; InvalidCall where it is not finite, comes for a step more than
        one ahead of the session's, or the parts would pass the memory budget."""
        if not np.isfinite(part).all():
            raise InvalidCall("the ring part holds NaN or Inf")
        if sumlog.enabled():
            sumlog.filed(session, step, round_, time.time())
        with self._changed:
            latest = self._latest.get(session)
            if latest is not None and step > latest + 1:
                raise InvalidCall(f"a ring part of step {step}: session "
                                  f"{session} is at step {latest} here")  # fmt: skip
            held = sum(a.nbytes for a in self._parts.values()) + part.nbytes
            self.context.budget.hold("ring parts", held, "the ring's parts", session)
            self._parts.setdefault((session, step, round_, segment), part)
            self._changed.notify_all()

    def begin(self, session: int, step: int) -> None:
        """A step's ImagesStep came: drop what older steps of the session left here."""
        with self._changed:
            self._latest[session] = max(step, self._latest.get(session, step))
            for k in [k for k in self._parts if k[0] == session and k[1] + KEPT_STEPS <= step]:
                del self._parts[k]
            self._aborted = {k for k in self._aborted if k[0] != session or k[1] >= step}
            for k in [k for k in self._put_failed if k[0] == session and k[1] < step]:
                del self._put_failed[k]
            self._told = {k for k in self._told if k[0] != session or k[1] >= step}

    def _receive(self, session: int, step: int, part: tuple[int, int], wait: float):
        """The part (round, segment) of the step's ring, once it came; RingFailed where it
        does not come within ``wait`` seconds, a put of this rank's failed, or the ring was
        aborted."""
        deadline = time.monotonic() + wait
        key = (session, step, *part)
        with self._changed:
            while key not in self._parts:
                if (session, step) in self._aborted:
                    raise RingFailed("another rank said the ring failed")
                if (session, step) in self._put_failed:
                    raise RingFailed(self._put_failed[(session, step)])
                left = deadline - time.monotonic()
                if left <= 0:
                    round_, segment = part
                    what = "the master's part" if round_ == MASTER_ROUND else f"round {round_}"
                    what += f" (segment {segment})" if segment else ""
                    raise RingFailed(f"{what} did not come within {wait:.1f} s")
                self._changed.wait(left)
            return self._parts.pop(key)

    def master_part(self, request: pb.ConvRequest, bucket: int = 0) -> np.ndarray:
        """The master's gradient, put into rank 0 (waited for): whole, or (a ring by
        buckets) bucket ``bucket``'s values, put as the master's backward gave them
        (:mod:`hetconv.master.ringparts`)."""
        ring = request.images.ring
        step = int(request.step)
        return self._receive(request.session, step, (MASTER_ROUND, bucket), ring.wait_seconds)

    def all_reduce(
        self, request: pb.ConvRequest, vector: np.ndarray, offset: int = 0, bounds=None
    ) -> np.ndarray:
        """Sum ``vector`` over the request's ring (in place), its parts' rounds counted from
        ``offset`` (each sum of a step its own: :data:`~hetconv.ring.ROUNDS_PER_SUM`), over
        ``bounds`` (default: even chunks), each chunk in segments of the request's
        ``segment_bytes``; RingFailed saying why not."""
        ring = request.images.ring
        values = int(ring.segment_bytes) // 4
        return self._run(request, offset, lambda *io: all_reduce(vector, *io, bounds, values),
                         mesh=self._meshed(ring))  # fmt: skip

    @staticmethod
    def _meshed(ring: pb.ImagesRing) -> bool:
        """Whether the ring's parts go to the peers' sum ports (every peer has one)."""
        return len(ring.sum_ports) == len(ring.peers) and all(ring.sum_ports)

    def buckets(self, request: pb.ConvRequest, shapes, master_part: bool) -> BucketRing:
        """A :class:`BucketRing` of this step's gradient (``shapes``: each parameter's)."""
        return BucketRing(self, request, shapes, master_part)

    def sum64(
        self, request: pb.ConvRequest, values: np.ndarray, offset: int, meanwhile=None
    ) -> np.ndarray:
        """The float64 sum of ``values`` over the ring, in rank order (every rank's, gathered
        in the fewest puts: :func:`~hetconv.ring.all_to_all` in one round where it puts no
        more than :func:`~hetconv.ring.all_gather_doubling`, else the latter; the same sum on
        each), its rounds from ``offset``; RingFailed saying why not. ``meanwhile`` (a
        function, or None): called once this rank's first parts are out, before it waits
        for any (work that fills the wait)."""
        ring = request.images.ring
        ranks = len(ring.peers)
        mesh = self._meshed(ring)
        gather = all_to_all if ranks - 1 <= doubling_rounds(ranks) else all_gather_doubling
        began = time.time()
        summed = join64(self._run(request, offset, lambda *io: gather(split64(values), *io),
                                  mesh=mesh, meanwhile=meanwhile))  # fmt: skip
        sumlog.summed(request.session, int(request.step), offset, ring.rank, began, time.time())
        return summed

    def _run(
        self, request: pb.ConvRequest, offset: int, algorithm, mesh: bool = False,
        meanwhile=None,
    ):  # fmt: skip
        """``algorithm(rank, ranks, send, receive)`` over the request's ring (``send``'s parts
        go to the next rank, or to the rank ``to``); ``mesh``: each part written to the
        peer's sum port from this thread (:mod:`hetconv.worker.summesh`), else put as a
        RingPart on a sender thread; ``meanwhile``: called before the first wait."""
        ring = request.images.ring
        session, step, rank, peers = request.session, int(request.step), ring.rank, ring.peers
        if self.tls:
            raise InvalidCall("a worker serving TLS does not ring (its peers' calls are plain)")
        if not 0 < len(peers) <= MAX_RANKS or rank >= len(peers):
            raise InvalidCall(f"rank {rank} of a ring of {len(peers)}: at most {MAX_RANKS}")
        links = self._session_links(session)
        timeout = min(PUT_SECONDS, max(ring.wait_seconds, 1.0))
        pending: deque[tuple[futures.Future, str]] = deque()  # each put and where it went

        def why(e: BaseException, address: str) -> str:
            code = e.code().name if isinstance(e, grpc.RpcError) else type(e).__name__
            return f"the put to {address} failed: {code}"

        def ended(address: str, future: futures.Future) -> None:  # a failed put ends the waits
            e = future.exception()
            with self._changed:
                if e is not None:
                    self._put_failed.setdefault((session, step), why(e, address))
                self._changed.notify_all()

        def settle(put: tuple[futures.Future, str]) -> None:  # through, or the ring aborted
            future, address = put
            with self._changed:
                while not future.done():
                    if (session, step) in self._aborted:
                        raise RingFailed("another rank said the ring failed")
                    self._changed.wait(1.0)
            try:
                future.result()
            except grpc.RpcError as e:
                raise RingFailed(why(e, address)) from None

        def send(round_: int, segment: int, part: np.ndarray, to: int | None = None) -> None:
            to = (rank + 1) % len(peers) if to is None else to
            if mesh and self._mesh.usable(peers[to], ring.sum_ports[to]):
                try:
                    self._mesh.send(peers[to], ring.sum_ports[to], session, step,
                                    offset + round_, segment, part)  # fmt: skip
                    return
                except OSError:  # its sum port unreachable: as RingPart calls from now on
                    pass
            while len(pending) >= OUTSTANDING:
                settle(pending.popleft())
            address = peers[to]
            head = part_request(session, step, rank, offset + round_, segment=segment)
            try:
                future = links.put_later(address, head, part, FLOAT32, timeout)
            except RuntimeError:  # its links closed (the worker stops, or the session went)
                raise RingFailed(f"the put to {address} failed: its links closed") from None
            pending.append((future, address))
            future.add_done_callback(functools.partial(ended, address))

        def receive(round_: int, segment: int) -> np.ndarray:
            nonlocal meanwhile
            if meanwhile is not None:  # this rank's parts out: its own work first
                meanwhile, work = None, meanwhile
                work()
            return self._receive(session, step, (offset + round_, segment), ring.wait_seconds)

        try:
            summed = algorithm(rank, len(peers), send, receive)
            while pending:  # the parts are views of the sum: every put through first
                settle(pending.popleft())
            return summed
        except (RingFailed, ValueError) as e:
            self.abort(request)
            raise RingFailed(str(e)) from None

    def abort(self, request: pb.ConvRequest) -> None:
        """Tell every other rank the step's ring failed (best effort, on abort threads)."""
        ring = request.images.ring
        links = self._session_links(request.session)
        key = (request.session, int(request.step))
        with self._changed:
            self._aborted.add(key)
            self._changed.notify_all()
            if key in self._told:
                return
            self._told.add(key)
        for i, address in enumerate(ring.peers):
            if i != ring.rank:
                head = part_request(request.session, int(request.step), ring.rank, 0, True)
                links.aborts.submit(_quiet_put, links, address, head, ABORT_SECONDS)

    def close(self) -> None:
        with self._changed:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
        self._mesh.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None


class _Cancelled(Exception):
    """The step's passes failed before their gradient was whole."""


class BucketRing:
    """A worker's gradient summed over its ring bucket by bucket (:func:`hetconv.ring.buckets`,
    of the request's ``bucket_bytes``) on a thread of its own while backward goes on: a bucket
    once backward has given every one of its parameters' gradients (:meth:`ready`), in the
    order backward fills them. Each value keeps its chunk of the whole vector's ring
    (:func:`hetconv.ring.bucket_chunks`), so it is summed in the same order, and the sum is
    the one :meth:`RingCalls.all_reduce` gives the whole vector, bit for bit; rank 0 adds the
    master's part to each bucket first, as to the whole vector."""

    def __init__(self, calls: RingCalls, request: pb.ConvRequest, shapes, master_part: bool):
        ring = request.images.ring
        self._calls, self._request, self._master = calls, request, master_part
        sizes = [math.prod(s) for s in shapes]
        self._ends = np.cumsum([0, *sizes]).tolist()
        self.vector = np.zeros(self._ends[-1], np.float32)
        #: This worker's own gradient, kept as each bucket's ring begins (where the request
        #: asks for its sketches, :mod:`hetconv.ringcheck`; else None).
        self.own = np.empty_like(self.vector) if ring.sketch else None
        self._ranks = len(ring.peers)
        self._buckets = buckets(sizes, self._ranks, max(1, ring.bucket_bytes // 4))
        self._ready = [False] * len(sizes)
        self._ended = self._cancelled = False
        self._error: Exception | None = None
        self._changed = threading.Condition()
        #: Buckets whose ring began before backward ended (the overlap).
        self.early = 0
        #: ``summed(vector, indices)``, called in the thread as each bucket is summed (the
        #: parameters it holds, by index); those it returned from are :attr:`applied`.
        self.summed = None
        self.applied: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="hetconv-ring", daemon=True)
        self._thread.start()

    def ready(self, index: int, gradient: np.ndarray) -> None:
        """Parameter ``index``'s gradient is whole: copied in (from a device array, downloaded);
        its bucket may go."""
        a, b = self._ends[index], self._ends[index + 1]
        self.vector[a:b] = np.asarray(to_host(gradient), np.float32).reshape(-1)
        with self._changed:
            self._ready[index] = True
            self._changed.notify_all()

    def finish(self, gradients) -> np.ndarray:
        """The summed vector, once every bucket's ring has run (``gradients``: every
        parameter's, in order, for those backward did not give); RingFailed saying why not."""
        for i, g in enumerate(gradients):
            if not self._ready[i]:
                self.ready(i, g)
        with self._changed:
            self._ended = True
        self._thread.join()
        if self._error is not None:
            raise RingFailed(str(self._error))
        return self.vector

    def cancel(self) -> None:
        """The passes failed: no gradient comes; the thread ends (the step's ring aborted:
        no rank waits for this one)."""
        self._calls.abort(self._request)
        with self._changed:
            self._cancelled = True
            self._changed.notify_all()
        self._thread.join()

    def _covered(self, start: int, stop: int) -> list[int]:
        """The parameters (by index) within values ``start .. stop``."""
        return [i for i in range(len(self._ready))
                if start <= self._ends[i] and self._ends[i + 1] <= stop]  # fmt: skip

    def _wait(self, start: int, stop: int) -> None:
        covered = self._covered(start, stop)
        with self._changed:
            while not all(self._ready[i] for i in covered):
                if self._cancelled:
                    raise _Cancelled("the passes failed")
                self._changed.wait()
            if not self._ended:
                self.early += 1

    def _run(self) -> None:
        try:
            for k, (start, stop) in enumerate(self._buckets):
                self._wait(start, stop)
                part = self.vector[start:stop]
                if self.own is not None:
                    self.own[start:stop] = part
                if self._master:  # the master's range first, as the nodes are ordered
                    theirs = self._calls.master_part(self._request, k)
                    if theirs.shape != part.shape:
                        raise RingFailed(f"the master's part of bucket {k} has {theirs.size} "
                                         f"values, not {part.size}")  # fmt: skip
                    part[...] = theirs + part
                bounds = bucket_chunks((start, stop), self.vector.size, self._ranks)
                self._calls.all_reduce(self._request, part, k * rounds(self._ranks), bounds)
                if self.summed is not None:
                    held = self._covered(start, stop)
                    self.summed(self.vector, held)
                    self.applied.update(held)
        except Exception as e:  # noqa: BLE001 - any failure here fails the step's ring
            self._error = e
            self._calls.abort(self._request)


def _quiet_put(links: RingLinks, address: str, head: pb.ConvRequest, timeout: float) -> None:
    """An abort: a RingPart without a tensor; failures are no matter."""
    _, _, bundle = links._stubs(address)
    try:
        from hetconv.wire import Bundle

        bundle(Bundle(pb.ConvMessage(header=head), []), timeout=timeout, metadata=links._metadata)
    except grpc.RpcError:
        pass


__all__ = ["BucketRing", "RingCalls", "RingFailed", "RingLinks", "part_request"]
