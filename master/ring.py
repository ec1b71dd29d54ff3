"""The whole network split by images with the ring exchange (``hetconv train --split images
--exchange ring|auto``, :mod:`hetconv.ring`).

:class:`RingImageSplit` is an :class:`~.imagesplit.ImageSplit` whose workers keep the weights
and momentum (every parameter is resident: the training loop's optimizer skips them, and this
class updates the master's copy with the same :func:`~hetconv.optim.sgd_update`). Per step:

* each worker that gets images gets one ImagesStep with its place in the ring (the computing
  workers in node order): its images, and the weights and momentum buffers only where it
  does not hold the master's version (the first step, a worker that (re)joined, got no images
  for a while, or whose copy was in doubt);
* the master computes its own range meanwhile (where its images pay for its part:
  :func:`hetconv.ring.master_range_pays`; else none) and puts its gradient into rank 0, which
  adds it to its own first; the ring sums the gradients, bucket by bucket while backward runs;
  every worker applies the update and answers a digest of its weights (of a sample the master
  draws each step) and its chunk of the summed gradient, which the master joins to update its
  copy; a worker whose digest differs from the master's copy is re-placed next step;
* where a rank's chunk of the sum is missing (a worker lost mid-ring or after it, a part
  that never came), the step goes through the master instead (a worker's call that fails,
  its worker gone, makes the master tell every other worker at once that the step's ring
  failed: none waits out its wait for the lost one's parts): the workers whose ring failed
  answer their own gradient, the master computes the others' ranges itself, sums every
  range in node order and updates its copy; every worker is re-placed next step. No step is
  lost, and the step is the same to float32 round-off.

A network with batch norm trains only this way: its statistics are summed among the workers
mid-pass (:func:`hetconv.imagesplit.sync_batchnorm`), the master computes no range, and rank 0
answers the running statistics with the sum; where the ring fails, the master computes the
step's whole batch.

``auto`` picks the exchange the cost model finds faster for the measured links
(:func:`hetconv.ring.choose`); TLS keeps the exchange through the master (the ring's calls
between workers are plain gRPC, as the split block's). Spot checks check the ring by each
worker's sketches of its own gradient (:mod:`.ringcheck`): a sum that fails them is refused and
the step computed here.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from hetconv.calls import IMAGES_STEP, IMAGES_TENSORS
from hetconv.costmodel import SimCluster, SimNode
from hetconv.dataparallel import CollectiveCosts
from hetconv.formats import FLOAT32, PALETTE8
from hetconv.imagesplit import batch_loss, image_ranges, parameter_shapes, spec_json
from hetconv.proto import worker_pb2 as pb
from hetconv.ring import (
    AUTO,
    BUCKET_BYTES,
    MASTER,
    MAX_RANKS,
    OWN,
    RING,
    RING_ANSWER_VALUES,
    RING_SECONDS,
    SEGMENT_BYTES,
    SUMMED,
    buffer_name,
    check_exchange,
    choose,
    digest,
    digest_of_values,
    flat,
    master_link_bytes,
    master_range_pays,
    momentum_name,
    ring_exchange_seconds,
    unflat,
)

from .call import Call
from .client import CallStats, WorkerClient, WorkerError
from .imagesplit import ImageSplit
from .membership import MASTER as MASTER_NODE
from .membership import Node
from .ringcheck import check_pricing, check_ring, drawn_ranges, run_late
from .ringparts import (
    WAIT_FLOOR_S,
    abort_on_failure,
    abort_ring,
    compare_digests,
    master_sender,
    put_master,
    put_master_part,
    update_copy,
)

#: The share of the weights' blocks a step's digests cover (:func:`hetconv.ring.digest`): a
#: sample drawn anew each step.
DIGEST_SHARE = 1 / 8


def ring_step(
    client: WorkerClient,
    request: pb.ConvRequest,
    arrays,
    formats,
    timeout: float,
    names,
    answer: int,
) -> tuple[dict[str, np.ndarray] | None, np.ndarray, np.ndarray, int, bytes, CallStats]:
    """One worker's ImagesStep with a ring (``answer``: the bytes it answers, about): (the
    gradients it answered, None where empty; losses; hits; its outcome; the digest of its
    weights; the running statistics; its slice of the sum; the call's figures; where the
    worker's time beyond its passes went, :data:`~hetconv.ring.RING_SECONDS`)."""
    count = len(arrays[-1][1])
    expect = (*names, "losses", "hits", "ring", "buffers", "slice", "sums")
    got, stats = client._call(
        IMAGES_STEP, f"images step {request.step}", request, arrays, list(expect), {}, timeout,
        answer, formats,
    )  # fmt: skip
    losses, hits, ring = got["losses"], got["hits"], got["ring"]
    if losses.shape != (count,) or hits.shape != (count,) or not np.isfinite(losses).all():
        raise WorkerError(client.address, f"images step {request.step}: bad losses or hits")
    if ring.shape != (RING_ANSWER_VALUES,) or ring[0] not in (0, 1, 2):
        raise WorkerError(client.address, f"images step {request.step}: bad ring outcome")
    timed = ring[5 : 5 + len(RING_SECONDS)]
    seconds = dict(zip(RING_SECONDS, map(float, timed), strict=True))
    grads = {n: got[n] for n in names}
    empty = all(g.size == 0 for g in grads.values())
    for name, g in grads.items():
        if not empty and not np.isfinite(g).all():
            raise WorkerError(client.address, f"images step {request.step}: bad gradient {name}")
    if not np.isfinite(got["slice"]).all():
        raise WorkerError(client.address, f"images step {request.step}: bad slice of the sum")
    return None if empty else grads, losses, hits.astype(bool), int(ring[0]), \
        digest_of_values(ring[1:5]), got["buffers"], got["slice"], stats, seconds, \
        ring[5 + len(RING_SECONDS) :], got["sums"]  # fmt: skip


def joined_sum(model, ring, answers: dict, slices: bool) -> dict | None:
    """The ring's sum by parameter from the workers' ``answers`` (as ``_ring_answer`` gives
    them): rank 0's, or (``slices``) every rank's chunk joined in rank order; None where the
    ring did not finish or a chunk is missing (a worker lost after it): the step then goes
    through the master."""
    got = [answers[node.name] for node, _, _ in ring]
    if not got or got[0] is None or got[0][3] != SUMMED:
        return None
    if not slices:
        return got[0][0]
    if any(a is None or a[3] != SUMMED for a in got):
        return None
    params = model.parameters()
    vector = np.concatenate([a[6] for a in got])
    if vector.size != sum(p.size for p in params.values()):
        return None
    return dict(zip(params, unflat(vector, [p.shape for p in params.values()]), strict=True))


def _sum_ports(ring) -> list[int]:
    """The ring's workers' sum ports (:mod:`hetconv.worker.summesh`), in rank order; none
    where any worker lacks one (its parts then go as RingPart calls)."""
    ports = [node.sum_port for node, _, _ in ring]
    return ports if all(ports) else []


class RingImageSplit(ImageSplit):
    """An :class:`~.imagesplit.ImageSplit` that sums the gradients by a ring among the
    workers where :attr:`exchange` (``auto``: where the cost model finds it faster) says so."""

    exchange = AUTO
    #: Bytes of the gradient's buckets the workers sum while backward runs (0: the whole
    #: gradient after backward).
    bucket_bytes = BUCKET_BYTES
    #: Bytes of the segments each chunk of the ring goes in (0: whole chunks).
    segment_bytes = SEGMENT_BYTES
    #: The share of the weights' blocks each step's digests cover (1: every value).
    digest_share = DIGEST_SHARE
    #: Each rank answers its chunk of the sum (the master's link takes them at once), not
    #: rank 0 the whole sum after the others are done.
    sum_slices = True

    def __init__(self, addresses: Sequence[str], backend="cpu", config=None):
        super().__init__(addresses, backend, config)
        check_exchange(self.exchange)
        self._draws = np.random.default_rng()  # the digests' samples: unknown in advance
        self._digest_seed = 0
        self._used: str | None = None  # the exchange chosen, once the model is known
        self._why = ""
        self._sgd = None
        self._version = 0  # updates applied to the master's copy
        self._placed: dict[str, int] = {}  # worker -> the version it holds
        self._momentum: dict[str, np.ndarray] = {}
        self._batchnorm = False  # the network has batch norm: synchronised over the ring
        self._log = None  # the console, until the exchange is said there
        self._late = None  # a drawn step's spot check run during the next (master/ringcheck.py)
        self._model = None

    # -- the exchange ----------------------------------------------------------------------

    def _fixed_seconds(self, nodes) -> list[float]:
        """With the ring every worker waits for the same sums after computing, and rank 0
        for the master's part first: the master's gradient crossing rank 0's link is the one
        cost beside the images (a worker's wait counted as its own would hand the master
        more images, and the workers a longer wait)."""
        if self._used != RING:
            return super()._fixed_seconds(nodes)
        workers = [n for n in nodes if not n.is_master]
        rank0 = workers[0] if workers else None
        part = self._parameter_bytes / rank0.link_bytes_per_second if rank0 else 0.0
        return [part + (rank0.link_latency if rank0 else 0.0) if n.is_master else 0.0
                for n in nodes]  # fmt: skip

    def _ranges(self, batch: int):
        """As the split by images cuts them; with the ring, the master's range left out (0
        images: it puts nothing into rank 0, and the workers' ring runs during their
        backward) where the cost model predicts the step shorter so
        (:func:`hetconv.ring.master_range_pays`, from the measured figures)."""
        ranges = super()._ranges(batch)
        self._master_choice = {}
        nodes = [n for n, _ in ranges]
        if (self._used != RING or self._batchnorm or self.config.deterministic
                or not self._seconds or len(nodes) < 2 or not nodes[0].is_master):  # fmt: skip
            return ranges
        mean = float(np.mean(list(self._seconds.values())))
        seconds = [self._seconds.get(n.name, mean) for n in nodes]
        # the workers computing this step (a lost one has no range: its figures would not
        # match theirs)
        workers = replace(self._sim_cluster(nodes[1:]), master_compute=False)
        nbytes, segment = self._parameter_bytes, self.segment_bytes
        after = ring_exchange_seconds(workers, nbytes, segment_bytes=segment)

        def during(images) -> float:  # as the simulator counts it: DDP's buckets' model
            if not self.bucket_bytes:
                return after
            from hetconv.imagecost import ring_hidden_seconds

            return after - ring_hidden_seconds(
                workers, json.loads(self._spec), sum(images), 0.0, CollectiveCosts(),
                seconds[1:], list(images), tuple(self._input[0]), nbytes, kernels_first=True,
            )  # fmt: skip

        part = self._fixed_seconds(nodes)[0]
        check = check_pricing(self.spot_checks, seconds[0], len(nodes) - 1)
        pays, with_s, without_s = master_range_pays(batch, seconds, part, after, during, check,
                                                    overlapped=bool(self.bucket_bytes))  # fmt: skip
        self._master_choice = {"master_range_pays": pays,
                               "predicted_with_master_s": round(with_s, 4),
                               "predicted_without_master_s": round(without_s, 4)}  # fmt: skip
        if pays:
            return ranges
        cut = image_ranges(batch, seconds[1:])
        return [(nodes[0], (0, 0)), *zip(nodes[1:], cut, strict=True)]

    def prepare(self, layers, batch: int, log=None) -> None:
        self._log = log
        super().prepare(layers, batch, log)

    def _resolve(self) -> str:
        """The exchange this run uses (chosen once, when the model is known), said on the
        console."""
        if self._used is None:
            self._choose()
        if self._log is not None:
            how = "by a ring among the workers" if self._used == RING else "through the master"
            print(f"gradients summed {how} ({self._why})", file=self._log)
            self._log = None  # said once
        return self._used

    def _choose(self) -> None:
        if self.exchange == MASTER:
            self._used, self._why = MASTER, "--exchange master"
        elif self.config.tls_ca is not None:
            if self.exchange == RING:
                raise ValueError(
                    "--exchange ring sends gradients worker to worker over plain gRPC, which "
                    "TLS (--tls-ca) would not cover; use --exchange master"
                )
            self._used, self._why = MASTER, "TLS: the ring's calls between workers are plain"
        elif self.exchange == RING:
            self._used, self._why = RING, "--exchange ring"
        else:
            self._used, seconds = choose(self._sim_cluster(), self._parameter_bytes)
            self._why = (f"the cost model for the measured links: through the master "
                         f"{seconds[MASTER]:.3f} s, ring {seconds[RING]:.3f} s")  # fmt: skip

    def _sim_cluster(self, workers: list[Node] | None = None) -> SimCluster:
        """The cost model's cluster of the master and ``workers`` (default: every worker
        connected, lost ones too; a step's ranges pass the workers computing)."""
        if workers is None:
            workers = [n for n in self.nodes[1:] if n.client is not None]
        links = [n.link_bytes_per_second for n in workers]
        fastest = max((b for b in links if math.isfinite(b)), default=math.inf)
        made = [SimNode(n.name, 1.0, bytes_per_s=n.link_bytes_per_second, rtt_s=n.link_latency)
                for n in workers]  # fmt: skip
        return SimCluster(
            master=SimNode(self.nodes[0].name, 1.0, bytes_per_s=fastest), workers=tuple(made),
            fabric=self.planner.network, medium_bytes_per_s=fastest,
            master_compute=self.config.master_compute,
        )  # fmt: skip

    def _take_spec(self, spec, input_shape) -> None:
        """As the split by images takes it; batch norm too where the ring sums its statistics
        among the workers mid-pass (not with the exchange through the master)."""
        try:
            super()._take_spec(spec, input_shape)
            return
        except ValueError as e:
            if self.exchange == MASTER:
                raise ValueError(f"{e}, or sum them among the workers: --exchange ring") \
                    from None  # fmt: skip
            if self.config.tls_ca is not None:
                raise
        self._spec = spec_json(spec)
        shapes, _ = parameter_shapes(spec, input_shape)
        self._parameter_bytes = sum(FLOAT32.nbytes(shape) for shape in shapes.values())
        self._batchnorm = True
        self._used, self._why = (
            RING,
            "batch norm: its statistics summed among the workers, the master computing no images",
        )

    def _computing(self) -> list[Node]:
        """With batch norm, the workers only (the master sums nothing mid-pass), or the master
        alone where none is active."""
        nodes = super()._computing()
        workers = [n for n in nodes if not n.is_master]
        return workers if self._batchnorm and workers else nodes

    # -- the resident parameters (the training loop's side) --------------------------------

    def resident_parameters(self) -> list[str]:
        """Every parameter, with the ring: the workers and this class update them."""
        if self._spec is None or self._resolve() != RING:
            return []
        import json

        from hetconv.imagesplit import parameter_shapes

        return list(parameter_shapes(json.loads(self._spec), self._input[0])[0])

    def attach_optimizer(self, sgd) -> None:
        self._sgd = sgd

    def complete(self) -> None:
        """The last step's spot check, where it was deferred (batch norm)."""
        if getattr(self, "_late", None) is not None:
            run_late(self, self._model)

    def gather_resident(self) -> dict:
        """The momentum buffers (the master's copy of the weights is the model's own)."""
        self.complete()
        return {k: np.array(v) for k, v in self._momentum.items()}

    def load_resident_momentum(self, momentum: dict) -> None:
        self._late = None  # a resumed run's weights are the checkpoint's
        self._momentum = {k: np.array(v, np.float32) for k, v in momentum.items()}
        self._placed.clear()  # every worker gets the resumed weights

    # -- a step ----------------------------------------------------------------------------

    def train_batch(self, model, x: np.ndarray, labels: np.ndarray, step: int):
        if self._spec is None:
            self.check_model(model)
        self._say_split()
        if self._resolve() != RING:
            self._ring_record = {"exchange": MASTER}
            return super().train_batch(model, x, labels, step)
        self._part_bytes = 0
        if self._sgd is None:
            raise RuntimeError("the ring updates the weights: attach_optimizer first")
        batch = len(x)
        cut = self._ranges(batch)
        if not self.config.deterministic:
            self._retry_idle(cut)
        ranges = [(node, first, count) for node, (first, count) in cut if count]
        ring = [r for r in ranges if not r[0].is_master]
        if len(ring) > MAX_RANKS:
            raise RuntimeError(f"{len(ring)} workers: a ring holds at most {MAX_RANKS}")
        master = next((r for r in ranges if r[0].is_master), None)
        calls = self._ring_calls(model, x, labels, step, ring, master is not None)
        self._model = model
        rolled_back = run_late(self, model)  # the last step's check, while these compute
        if rolled_back:  # they compute from the refused sum's weights: this step is here too
            for node, _, _ in ring:
                abort_ring(node.client, self.session, step)
        parts: dict[str, tuple] = {}
        if master is not None:  # the master's own range, while the workers compute
            node, first, count = master
            sender = master_sender(self, model, ring, step)  # its part, bucket by bucket
            parts[node.name] = self._local(model, x, labels, first, count, batch, step, sender)
            self._record[node.name] = {"images": count, "seconds": parts[node.name][3]}
            if ring:
                self._part_bytes = put_master(self, model, parts[node.name][0], ring[0][0],
                                              step, sender)  # fmt: skip
        drawn = drawn_ranges(self, model, x, labels, step, ring)  # while the workers compute
        abort_on_failure(calls, ring, self.session, step)
        answers = {r[0].name: self._ring_answer(r, calls, ring, step) for r in ring}
        self._answered = time.perf_counter()  # the sum joined and the copy updated after it
        summed = None if rolled_back else joined_sum(model, ring, answers, self.sum_slices)
        if summed is not None and self.spot_checks is not None:
            summed = check_ring(self, model, x, labels, step, ring, answers, summed,
                                parts.get(MASTER_NODE), drawn)  # fmt: skip
        exchange = RING if summed is not None else MASTER
        if self._batchnorm:  # the workers' running statistics, or the whole batch here
            whole = parts.get(MASTER_NODE)  # the master alone: it computed the whole batch
            return self._batchnorm_step(model, x, labels, step, ring, answers, summed, whole)
        for node, first, count in ring:  # the master's: the same images, the same weights
            got = answers[node.name]
            if got is not None and (exchange == RING or got[3] == OWN):
                parts[node.name] = got
            else:  # lost (its losses), or no own gradient for a step through the master
                parts[node.name] = self._local(model, x, labels, first, count, batch, step)
                self._record[node.name].update(covered_by=MASTER_NODE, seconds=0.0)
        if exchange == RING:
            self._set_gradients(model, [summed])
        else:
            self._set_gradients(model, [parts[n.name][0] for n, _, _ in ranges])
        self._update(model, model.gradients(), answers, exchange)
        for node, _, count in ranges:
            figures = self._record[node.name]
            if "covered_by" not in figures:
                self._measured_record(node, count, figures)
        ordered = [parts[node.name] for node, _, _ in ranges]
        return batch_loss([p[1] for p in ordered], batch), np.concatenate([p[2] for p in ordered])

    def _batchnorm_step(self, model, x, labels, step, ring, answers, summed, whole=None):
        """A step of a network with batch norm, the master computing no range: the ring's sum
        (``summed``) and rank 0's running statistics; or, where the ring failed (a node's
        statistics missing from a sum), the whole batch computed here."""
        batch = len(x)
        if summed is not None and all(answers.values()):
            exchange = RING
            buffers = model.buffers()
            values = unflat(answers[ring[0][0].name][5], [b.shape for b in buffers.values()])
            for target, value in zip(buffers.values(), values, strict=True):
                target[...] = value
            self._set_gradients(model, [summed])
            parts = [answers[n.name] for n, _, _ in ring]
        else:  # a worker lost: its images' losses need the whole batch's statistics too
            exchange = MASTER
            parts = [whole or self._local(model, x, labels, 0, batch, batch, step)]
            self._set_gradients(model, [parts[0][0]])
            for node, _, _ in ring:
                self._record[node.name].update(covered_by=MASTER_NODE, seconds=0.0)
        self._update(model, model.gradients(), answers, exchange)
        for node, _, count in ring:
            figures = self._record[node.name]
            if "covered_by" not in figures:
                self._measured_record(node, count, figures)
        return batch_loss([p[1] for p in parts], batch), np.concatenate([p[2] for p in parts])

    def _ring_calls(self, model, x, labels, step, ring, master_part: bool) -> dict[str, Call]:
        parameters = model.parameters()
        names = tuple(parameters)
        peers = [node.client.address for node, _, _ in ring]
        wait = max(WAIT_FLOOR_S, max((self._deadline(n, c, 0) for n, _, c in ring), default=0))
        sampled = self.digest_share < 1
        self._digest_seed = int(self._draws.integers(1, 2**63)) if sampled else 0
        calls = {}
        for rank, (node, first, count) in enumerate(ring):
            place = self._placed.get(node.name) != self._version
            sgd = self._sgd
            request = pb.ConvRequest(
                phase=IMAGES_STEP.phase, session=self.session, step=step,
                images=pb.ImagesStep(
                    spec_json=self._spec, input_shape=model.input_shape, seed=model.seed,
                    first=first, batch=len(x),
                    ring=pb.ImagesRing(
                        peers=peers, rank=rank, version=self._version, place=place, lr=sgd.lr,
                        momentum=sgd.momentum, weight_decay=sgd.weight_decay,
                        master_part=master_part and rank == 0, wait_seconds=wait,
                        answer_sum=rank == 0 or self.sum_slices, sum_slice=self.sum_slices,
                        bucket_bytes=self.bucket_bytes, segment_bytes=self.segment_bytes,
                        digest_seed=self._digest_seed, digest_share=self.digest_share,
                        sum_ports=_sum_ports(ring), sketch=self.spot_checks is not None,
                    ),
                ),
            )  # fmt: skip
            xs, ys = x[first : first + count], labels[first : first + count].astype(np.float32)
            fits = PALETTE8.nbytes(xs.shape) < FLOAT32.nbytes(xs.shape)
            arrays, formats = [], []
            if place:
                arrays += list(parameters.items())
                if self._momentum:
                    arrays += [(momentum_name(k), self._momentum[k]) for k in names]
                arrays += [(buffer_name(k), np.asarray(v, np.float32))
                           for k, v in model.buffers().items()]  # fmt: skip
                formats += [FLOAT32] * len(arrays)
            arrays += list(zip(IMAGES_TENSORS, (xs, ys), strict=True))
            formats += [PALETTE8.prepared(xs) if fits else FLOAT32, FLOAT32]
            timeout = self._deadline(node, count, xs.nbytes) + 3 * wait
            share = 1 / len(ring) if self.sum_slices else rank == 0
            answer = int(self._parameter_bytes * share) + 8 * count + 20
            calls[node.name] = Call(ring_step, node.client, request, arrays, formats, timeout,
                                    names, answer)  # fmt: skip
            self._record[node.name] = {"images": count, "placed": place}
        return calls

    def _ring_answer(self, at, calls, ring, step: int) -> tuple | None:
        """A worker's answer as (gradients or None, losses, hits, outcome, digest); None, the
        worker lost, when its call failed (the others told so: none waits on it)."""
        node, _, count = at
        try:
            got = calls[node.name].result()
            grads, losses, hits, outcome, d, buffers, piece, stats, seconds, sketch, sums = got
        except WorkerError as e:
            self._lost(node, e, calls, ring, step)
            return None
        self._record[node.name].update(
            seconds=stats.compute_seconds, wall_seconds=stats.wall_seconds,
            bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received, outcome=outcome,
            **{k: round(v, 4) for k, v in seconds.items()},
        )  # fmt: skip
        return grads, losses, hits, outcome, d, buffers, piece, sketch, sums

    def _lost(self, node: Node, error: WorkerError, calls: dict, ring, step: int) -> None:
        """``node``'s call failed: lost, and the others told the step's ring failed."""
        self.membership.lose(node, error)
        self._placed.pop(node.name, None)
        for other, _, _ in ring:
            if other is not node and not calls[other.name].done():
                abort_ring(other.client, self.session, step)

    def _update(self, model, gradient: dict, answers: dict, exchange: str) -> None:
        """The master's copy updated as every worker's is; each worker's digest compared."""
        params = model.parameters()
        update_copy(params, params, gradient, self._momentum, self._sgd)
        self._version += 1
        state = [*params.values(), flat(list(model.buffers().values()))]
        mine = digest(state, self._digest_seed, self.digest_share)
        after = time.perf_counter() - self._answered  # set as the answers came
        self._ring_record = {
            "exchange": exchange, "digest": mine.hex(), "master_part_bytes": self._part_bytes,
            "master_update_seconds": round(after, 4), **getattr(self, "_master_choice", {}),
        }  # fmt: skip
        compare_digests(self, answers, exchange, mine, lambda got: (got[3], got[4]))

    # -- records ---------------------------------------------------------------------------

    def end_step(self) -> dict:
        out = super().end_step()
        out.update(getattr(self, "_ring_record", {}))
        return out

    def plan_record(self) -> dict:
        record = super().plan_record()
        used = self._resolve() if self._spec is not None else self.exchange
        workers = sum(1 for n, (_, c) in self._ranges(self._batch) if c and not n.is_master)
        record.update(
            exchange=used, exchange_why=self._why,
            master_link_bytes=master_link_bytes(self._parameter_bytes, workers, used),
        )  # fmt: skip
        return record


def image_split_class(exchange: str) -> type[ImageSplit]:
    """The cluster class of ``--split images --exchange EXCHANGE``."""
    check_exchange(exchange)
    return type("RingImageSplit", (RingImageSplit,), {"exchange": exchange})


__all__ = [
    "RingImageSplit",
    "abort_on_failure",
    "abort_ring",
    "image_split_class",
    "joined_sum",
    "put_master_part",
    "ring_step",
]
