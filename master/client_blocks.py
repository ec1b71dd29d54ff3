"""The calls of a replicated block (:mod:`hetconv.replica`) and a block split by images
(:mod:`hetconv.split`): run the block on the worker ahead of the next layer's stage calls, and put
or fetch a split block's parts. A mixin of :class:`~hetconv.master.client.WorkerClient`.
"""

from __future__ import annotations

import dataclasses
import time

import grpc
import numpy as np

from hetconv.calls import FETCH_PART, PUT_PART, REPLICA_FORWARD
from hetconv.formats import FLOAT32, answer_dtype
from hetconv.master.client_connection import CallStats
from hetconv.proto import worker_pb2 as pb
from hetconv.replica import ReplicaBlock
from hetconv.split import SplitPlan
from hetconv.stages import ops_to_proto

_EMPTY_INPUT = np.empty((0, 0, 0, 0), np.float32)  # x of a call whose input the worker has


class BlockCalls:
    """ReplicaForward, PutPart and FetchPart, over the client's :meth:`_call`."""

    def replica_forward(
        self,
        session: int,
        step: int,
        block: ReplicaBlock,
        timeout: float = 600.0,
        split: SplitPlan | None = None,
    ) -> CallStats:
        """Have the worker run the replicated ``block`` on the step's images and keep its
        output for the next layer's stage calls of ``step`` (:mod:`hetconv.replica`).

        ``split``: the block split by images (:mod:`hetconv.split`): only this worker's images
        travel, and the worker exchanges its output with the plan's other peers."""
        request = pb.ConvRequest(
            phase=REPLICA_FORWARD.phase, session=session, step=step, layer=block.layer,
            padding=block.sides,
            stage=pb.StageDescription(
                ops=ops_to_proto(block.stage), own_start=0, own_count=block.w.shape[0]
            ),
        )  # fmt: skip
        x, x_format = block.x, block.x_format
        named = None
        if split is not None:
            request.split.CopyFrom(split.request_for(self.address))
            # the session's peers on the worker: prepared anew when the split gains a worker
            prepared = getattr(self, "_prepared", {})
            named = frozenset(p.address for p in request.split.peers if not p.master)
            request.split.prepare = not named <= prepared.get(session, frozenset())
            images = split.images(self.address)
            rows = getattr(x_format, "rows", None)  # a prepared palette8 encoding of the batch
            if rows is not None:  # this worker's rows of it
                x, x_format = rows(images)
            else:
                x = block.x[images]
        arrays = list(zip(REPLICA_FORWARD.request_names, (x, block.w, block.b), strict=True))
        formats = [x_format, FLOAT32, FLOAT32]  # the images: palette8 where they fit
        _, stats = self._call(
            REPLICA_FORWARD, f"replica forward {block.layer}", request, arrays, [], {}, timeout, 0,
            formats,
        )  # fmt: skip
        if named is not None and request.split.prepare:
            self._prepared = {session: named}  # what the worker now holds for the session
        return stats

    def _replicate(self, request, session, step, x, replica, timeout):
        """With a replicated block: run it on the worker (or wait for the ReplicaForward the
        master started ahead, ``replica.started``), name it in ``request``; returns the
        ReplicaForward's figures and the ``x`` to send (empty). A call started ahead counts
        only the wait for it as wall time: the rest ran beside the master's own work."""
        if replica is None:
            return CallStats(), x
        pending = replica.started.pop(self.address, None)
        if pending is None:
            before = self.replica_forward(session, step, replica, timeout)
        else:
            waited = time.perf_counter()
            before = pending.result()  # its WorkerError, if it failed
            before = dataclasses.replace(before, wall_seconds=time.perf_counter() - waited)
        request.replica_layer = replica.layer
        return before, _EMPTY_INPUT

    def put_part(
        self,
        session: int,
        step: int,
        block: str,
        source: int,
        part: np.ndarray,
        gradient: bool,
        timeout: float = 600.0,
        round_: int = 0,
    ) -> CallStats:
        """Put a split block's ``part`` into the worker as node ``source`` (:mod:`hetconv.split`):
        the master resends a lost worker's output (``gradient`` False) or its input-gradient
        rows of this worker's images, from what it computed itself; ``round_``: the split's
        (:attr:`~hetconv.split.SplitPlan.round`). A block output goes as float32, as the
        workers' own do between them, so every node's stage input is the same float32 block
        output (a 16-bit one would differ from the master's: max-pool choices flip, and the
        checks would blame honest workers); gradient rows go in the wire format."""
        request = pb.ConvRequest(
            phase=PUT_PART.phase, session=session, step=step, layer=block,
            part=pb.TensorPart(source=source, gradient=gradient, round=round_),
        )  # fmt: skip
        fmt = self.wire_format if gradient else FLOAT32
        _, stats = self._call(
            PUT_PART, f"put part {block}", request, [("p", part)], [], {}, timeout, 0, [fmt]
        )
        return stats

    def fetch_part(
        self,
        session: int,
        step: int,
        block: str,
        source: int,
        timeout: float = 600.0,
        gradient: bool = True,
        out: np.ndarray | None = None,
        round_: int = 0,
    ) -> tuple[np.ndarray, CallStats]:
        """The input-gradient rows of node ``source``'s images the worker computed in its
        backward of ``step`` (sent to that node: one the master lost, or the master itself as
        a peer, ``split_all``); ``gradient`` False: node ``source``'s images' block output the
        worker holds (its own, for the master as a peer), written into ``out`` when given.
        ``round_``: of that split only (:attr:`~hetconv.split.SplitPlan.round`; a step computed
        again is a new round), 0: the step's latest. A block output comes as float32 (what the
        worker and its peers compute on; :meth:`put_part`), rows in the wire format."""
        request = pb.ConvRequest(
            phase=FETCH_PART.phase, session=session, step=step, layer=block,
            answer_dtype=answer_dtype(self.wire_format if gradient else FLOAT32),
            part=pb.TensorPart(source=source, gradient=gradient, round=round_),
        )  # fmt: skip
        into = {"p": out} if out is not None else {}
        got, stats = self._call(
            FETCH_PART, f"fetch part {block}", request, [], ["p"], into, timeout,
            out.nbytes if out is not None else 0,
        )  # fmt: skip
        return got["p"], stats

    def missing_parts(self, session: int, step: int, block: str, timeout: float = 10.0):
        """The nodes of split block ``block`` at ``step`` whose block output has not come to
        the worker yet (plan indices), answered at once."""
        request = pb.ConvRequest(
            phase=FETCH_PART.phase, session=session, step=step, layer=block,
            part=pb.TensorPart(missing=True),
        )  # fmt: skip
        got, _ = self._call(
            FETCH_PART, f"missing parts {block}", request, [], ["p"], {}, timeout, 0,
        )  # fmt: skip
        return [int(v) for v in got["p"]]

    def reach_peers(self, peers, timeout: float = 2.0) -> dict[str, str]:
        """Address -> why, of the ``peers`` (other workers, at the addresses this master uses)
        the worker cannot reach (a Describe from it to each, within ``timeout`` seconds, all
        at once: :func:`hetconv.worker.peers.reach_peers`). A worker too old to check answers
        none.

        Raises:
            WorkerError: the worker did not answer (or refused the check: a bad address)."""
        request = pb.DescribeRequest(peers=list(peers), peer_timeout=timeout)
        try:
            d = self._describe(request, timeout=timeout + 10.0, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(e, "peer reach check") from None
        return dict(zip(d.unreachable, d.unreachable_why, strict=False))

    def fetch_samples(
        self,
        session: int,
        step: int,
        block: str,
        seed: int,
        count: int,
        timeout: float = 60.0,
        gradient: bool = False,
    ) -> np.ndarray:
        """``count`` values of every sender's part of split block ``block`` at ``step`` as the
        worker received them, at places drawn from ``seed``
        (:func:`~hetconv.split.part_sample`): one row per sender of the split, in plan order
        (float32). The master compares them with its own block output: a peer that put wrong
        values into the others is the one blamed. ``gradient``: of the input-gradient rows
        every other peer put into it, one image's (:func:`~hetconv.split.row_sample`)."""
        request = pb.ConvRequest(
            phase=FETCH_PART.phase, session=session, step=step, layer=block,
            part=pb.TensorPart(sample=count, sample_seed=seed, gradient=gradient),
        )  # fmt: skip
        got, _ = self._call(
            FETCH_PART, f"sample parts {block}", request, [], ["p"], {}, timeout, 0,
        )  # fmt: skip
        return got["p"]
