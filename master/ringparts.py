"""The master's own gradient put into rank 0 of the ring (:mod:`.ring`), whole or bucket by
bucket while its backward runs.

Where the master computes a range of the images, rank 0 adds the master's gradient to its own
before the ring sums it. Put whole, after the master's backward, it held back the ring's first
bucket until the master's range was done: paper-150-800 batch 64 on the scaled testbed, the
workers' buckets waited for the master's 14 MB, sent after its 0.94 s range. With buckets
(the request's ``bucket_bytes``), :class:`MasterBuckets` puts each bucket's values as backward
gives them (:func:`hetconv.imagesplit.backward_hooks`), each a ``RingPart`` of the master's
round whose ``segment`` is the bucket's index (:func:`hetconv.ring.buckets`: the same buckets
on every node), on a thread of its own; rank 0's ring takes each bucket's part before that
bucket (:class:`hetconv.worker.ring.BucketRing`). The sum is the same bit for bit: each value
is added in the same order.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from hetconv.calls import RING_PART
from hetconv.optim import sgd_update
from hetconv.proto import worker_pb2 as pb
from hetconv.ring import MASTER_ROUND, OWN, RING, buckets, flat

from .call import Call
from .client import WorkerClient, WorkerError

#: Seconds a worker waits for one part of the ring at least (and a put of the master's part
#: may take beyond its transfer's deadline).
WAIT_FLOOR_S = 5.0


def put_master_part(
    client: WorkerClient, session: int, step: int, vector, timeout: float, segment: int = 0
) -> None:
    """Put the master's gradient (flat; or bucket ``segment`` of it) into rank 0."""
    request = pb.ConvRequest(
        phase=RING_PART.phase, session=session, step=step,
        images=pb.ImagesStep(ring=pb.ImagesRing(round=MASTER_ROUND, segment=segment)),
    )  # fmt: skip
    client._call(RING_PART, f"ring part of step {step}", request, [("p", vector)], [], {},
                 timeout, 0)  # fmt: skip


class MasterBuckets:
    """The master's gradient put into rank 0 bucket by bucket as its backward gives each
    parameter's (:meth:`ready`), in the buckets' order, on a thread; a put that fails ends the
    puts (rank 0's ring then fails, and the step goes through the master)."""

    def __init__(self, client: WorkerClient, session: int, step: int, shapes, ranks: int,
                 bucket_bytes: int, deadline) -> None:  # fmt: skip
        sizes = [math.prod(s) for s in shapes]
        self._ends = np.cumsum([0, *sizes]).tolist()
        self.vector = np.zeros(self._ends[-1], np.float32)
        self._buckets = buckets(sizes, ranks, max(1, bucket_bytes // 4))
        self._ready = [False] * len(sizes)
        self._client, self._session, self._step, self._deadline = client, session, step, deadline
        self._changed = threading.Condition()
        self.failed = False
        self._thread = threading.Thread(target=self._run, name="hetconv-master-part", daemon=True)
        self._thread.start()

    def ready(self, index: int, gradient: np.ndarray) -> None:
        a, b = self._ends[index], self._ends[index + 1]
        self.vector[a:b] = np.asarray(gradient, np.float32).reshape(-1)
        with self._changed:
            self._ready[index] = True
            self._changed.notify_all()

    def finish(self, gradients) -> None:
        """Every parameter's gradient (``gradients``, in order) given, each bucket put (or
        the puts ended by a failure)."""
        for i, g in enumerate(gradients):
            if not self._ready[i]:
                self.ready(i, g)
        self._thread.join()

    def _run(self) -> None:
        for k, (start, stop) in enumerate(self._buckets):
            covered = [i for i in range(len(self._ready))
                       if start <= self._ends[i] and self._ends[i + 1] <= stop]  # fmt: skip
            with self._changed:
                self._changed.wait_for(lambda c=covered: all(self._ready[i] for i in c))
            part = self.vector[start:stop]
            try:
                put_master_part(self._client, self._session, self._step, part,
                                self._deadline(part.nbytes), segment=k)  # fmt: skip
            except WorkerError:
                self.failed = True  # rank 0 waits for it in vain: its ring fails
                return


def master_sender(split, model, ring, step: int) -> MasterBuckets | None:
    """The master's part put bucket by bucket into rank 0 (``ring``'s first worker), where
    the ring runs by buckets; None: put whole after its range (:func:`put_master`)."""
    if not ring or not split.bucket_bytes:
        return None
    rank0 = ring[0][0]
    shapes = [p.shape for p in model.parameters().values()]

    def deadline(nbytes: int) -> float:
        return split.config.transfer_deadline(rank0, nbytes) + WAIT_FLOOR_S

    return MasterBuckets(rank0.client, split.session, step, shapes, len(ring),
                         split.bucket_bytes, deadline)  # fmt: skip


def put_master(split, model, grads: dict, rank0, step: int, sender: MasterBuckets | None) -> int:
    """The master's gradient into rank 0: the rest of its buckets (``sender``), or whole;
    the bytes put."""
    ordered = [grads[k] for k in model.parameters()]
    if sender is not None:
        sender.finish(ordered)
        return sender.vector.nbytes
    vector = flat(ordered)
    try:
        deadline = split.config.transfer_deadline(rank0, vector.nbytes) + WAIT_FLOOR_S
        put_master_part(rank0.client, split.session, step, vector, deadline)
    except WorkerError:
        pass  # rank 0 waits for it in vain: its ring fails, the step goes through here
    return vector.nbytes


def abort_ring(client: WorkerClient, session: int, step: int) -> None:
    """Tell a worker this step's ring failed (best effort)."""
    request = pb.ConvRequest(
        phase=RING_PART.phase, session=session, step=step,
        images=pb.ImagesStep(ring=pb.ImagesRing(abort=True)),
    )  # fmt: skip
    try:
        client._call(RING_PART, f"ring abort of step {step}", request, [], [], {}, 2.0, 0)
    except WorkerError:
        pass


def abort_on_failure(calls: dict[str, Call], ring, session: int, step: int) -> None:
    """Wait until every call has ended or one has failed; once one failed (its worker gone
    mid-step), tell every other worker still computing that this step's ring failed: one
    waiting for the lost worker's part (batch norm's sums, a round of the gradient's) stops
    now instead of at its wait's end."""
    ended = threading.Event()
    for call in calls.values():
        call.notify(ended)
    while not any(call.failed() for call in calls.values()):
        if all(call.done() for call in calls.values()):
            return
        ended.wait()
        ended.clear()
    for node, _, _ in ring:
        if not calls[node.name].done():
            abort_ring(node.client, session, step)


def update_copy(params: dict, names, gradient: dict, momentum: dict, sgd) -> None:
    """The master's copy of the parameters ``names`` updated as every ring worker updates its
    own (:func:`~hetconv.optim.sgd_update`, the momentum buffers kept in ``momentum``)."""
    for name in names:
        buf = sgd_update(params[name], gradient[name], momentum.get(name), sgd)
        if buf is not None:
            momentum[name] = buf


def compare_digests(cluster, answers: dict, exchange: str, mine: bytes, outcome_digest) -> None:
    """Each ring worker's digest of its weights (``outcome_digest(answer)``: its outcome and
    digest) against the master's copy's (``mine``): where equal it holds the copy's version;
    otherwise, or where the step did not update it by the ring, it is placed again."""
    for name, got in answers.items():
        cluster._placed.pop(name, None)
        if got is None or exchange != RING:
            continue  # not updated by the ring: placed again
        outcome, theirs = outcome_digest(got)
        if outcome == OWN:
            continue
        cluster._record[name]["digest"] = theirs.hex()
        if theirs == mine:
            cluster._placed[name] = cluster._version
        else:  # a fault: its copy is not the master's
            cluster._record[name]["weights_differ"] = True
            cluster._events.emit("weights_differ", name, action="placed again next step")


__all__ = [
    "compare_digests",
    "update_copy",
    "abort_on_failure",
    "abort_ring",
    "WAIT_FLOOR_S",
    "MasterBuckets",
    "master_sender",
    "put_master",
    "put_master_part",
]
