"""A network cut in two (``hetconv train --split LAYER=images``, :mod:`hetconv.cutsplit`): the
first part split by images among the workers with the ring, the rest on the master.

:class:`CutSplit` is a :class:`~.ring.RingImageSplit` whose workers keep only the first part
(its spec is what they build), which every step runs in two calls per worker:

* FORWARD: each worker its range of the batch (the master computes none: batch norm's sums
  run among the workers), the weights placed where it does not hold the master's version;
  it answers the first part's output on its images;
* the master joins the outputs in image order and runs the rest of the network, the loss and
  the rest's backward on the whole batch (its own layers, this process's engine);
* BACKWARD: each worker the rows of its images of the gradient at the cut; it back-propagates
  them, the workers sum the first part's gradient by the ring and each applies the update;
  rank 0 answers the sum (and the first part's running statistics), which updates the master's
  copy; each worker's digest of its weights is compared with the copy's.

The rest's parameters are the training loop's, as on one machine; the first part's are
resident (the workers' and this class's). Nothing lost: where a FORWARD fails (a worker gone,
a sum that could not finish) the master computes the first part itself on the whole batch,
and where a BACKWARD does, it computes the first part's forward and backward on the whole batch
with the same gradient at the cut; every worker is placed again the next step. The step is
the same either way, to float32 round-off. Not with TLS (the ring's calls between workers are
plain gRPC) nor spot checks (not built for the cut).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hetconv.calls import IMAGES_STEP
from hetconv.cutsplit import BACKWARD, FORWARD, cut_after, cut_spec
from hetconv.formats import FLOAT32, PALETTE8
from hetconv.imagesplit import parameter_shapes, spec_json
from hetconv.layers import Conv2d, Dropout, softmax_cross_entropy
from hetconv.model import Model
from hetconv.proto import worker_pb2 as pb
from hetconv.ring import (
    OWN,
    RING,
    RING_ANSWER_VALUES,
    RING_SECONDS,
    SUMMED,
    buffer_name,
    digest,
    digest_of_values,
    flat,
    momentum_name,
    unflat,
)
from hetconv.spec import walk_spec

from .call import Call
from .client import WorkerClient, WorkerError
from .membership import MASTER as MASTER_NODE
from .ring import RingImageSplit, _sum_ports, abort_on_failure
from .ringparts import WAIT_FLOOR_S, compare_digests, update_copy

#: What FORWARD answers; what BACKWARD answers after the first part's gradients.
FORWARD_ANSWER, BACKWARD_ANSWER = ("y", "ring"), ("ring", "buffers", "slice")


def cut_call(client: WorkerClient, request, arrays, formats, timeout: float, names, answer: int):
    """One worker's FORWARD or BACKWARD: (the answer's tensors by name, the outcome, where
    its time beyond compute went, the digest of its weights, the call's figures)."""
    phase = request.images.cut_phase
    expect = FORWARD_ANSWER if phase == FORWARD else (*names, *BACKWARD_ANSWER)
    label = f"cut {'forward' if phase == FORWARD else 'backward'} of step {request.step}"
    got, stats = client._call(IMAGES_STEP, label, request, arrays, list(expect), {}, timeout,
                              answer, formats)  # fmt: skip
    ring = got["ring"]
    if ring.shape != (RING_ANSWER_VALUES,) or ring[0] not in (0, 1, 2):
        raise WorkerError(client.address, f"{label}: bad ring outcome")
    for name, value in got.items():
        if not np.isfinite(value).all():
            raise WorkerError(client.address, f"{label}: {name} holds NaN or Inf")
    seconds = dict(zip(RING_SECONDS, map(float, ring[5 : 5 + len(RING_SECONDS)]), strict=True))
    return got, int(ring[0]), seconds, digest_of_values(ring[1:5]), stats


class CutSplit(RingImageSplit):
    """A :class:`~.ring.RingImageSplit` of the network's first part, up to ``layer``'s block
    (see the module's docstring); the rest on the master."""

    exchange = RING
    bucket_bytes = 0  # the first part's gradient summed after its backward
    sum_slices = False  # rank 0 answers the whole sum
    layer = ""  # the convolution whose block ends the first part (cut_split_class sets it)

    def __init__(self, addresses: Sequence[str], backend="cpu", config=None):
        super().__init__(addresses, backend, config)
        if not self.layer:
            raise ValueError("a cut network names its cut: use cut_split_class(layer)")
        self.spot_checks = None  # not built for a cut network (the console says so)
        self._first_names: list[str] = []  # the first part's parameters, in order
        self._buffer_names: list[str] = []  # and its buffers
        self._parts: tuple[Model, Model] | None = None  # (first part, rest) on the master
        self._shape: tuple[int, ...] = ()  # the first part's output per image

    # -- the network ------------------------------------------------------------------------

    def _take_spec(self, spec, input_shape) -> None:
        if self.config.tls_ca is not None:
            raise ValueError(f"--split {self.layer}=images sums the first part's gradient "
                             "worker to worker over plain gRPC, which TLS (--tls-ca) would not "
                             "cover")  # fmt: skip
        last = cut_after(spec, self.layer)
        first, _ = cut_spec(spec, last)
        self._spec = spec_json(first)
        shapes, _ = parameter_shapes(first, input_shape)
        self._first_names = list(shapes)
        layers = list(walk_spec(first, tuple(input_shape)))
        self._buffer_names = [
            f"{ly.name}.{key}"
            for ly in layers
            if ly.kind == "batchnorm"
            for key in ("running_mean", "running_var", "num_batches_tracked")
        ]
        self._shape = tuple(layers[-1].output_shape)
        self._parameter_bytes = sum(FLOAT32.nbytes(s) for s in shapes.values())
        self._batchnorm = True  # the master computes no range of the first part
        self._used = RING
        self._why = (f"the network cut after {self.layer}'s block: its first part split by "
                     "images, the rest on the master")  # fmt: skip

    def _say_split(self) -> None:
        log, self._console = self._console, None
        if log is not None:
            parts = ", ".join(f"{n.name} {c}" for (n, (_, c)) in self._ranges(self._batch) if c)
            print(f"split at {self.layer}'s block: the workers run the network up to it on "
                  f"their images ({parts} of {self._batch} per step), the master the rest on "
                  "the whole batch (no spot checks: not built for a cut network)",
                  file=log)  # fmt: skip

    def resident_parameters(self) -> list[str]:
        return list(self._first_names) if self._spec is not None else []

    def _parts_of(self, model) -> tuple[Model, Model]:
        """The first part and the rest as models of their own whose layers hold the model's
        own parameters and buffers (the same arrays), built once."""
        if self._parts is None:
            last = cut_after(model.spec, self.layer)
            first, rest = cut_spec(model.spec, last)
            self._parts = (_aliased(first, model.input_shape, model, self),
                           _aliased(rest, self._shape, model, self))  # fmt: skip
        return self._parts

    # -- a step ------------------------------------------------------------------------------

    def train_batch(self, model, x: np.ndarray, labels: np.ndarray, step: int):
        if self._spec is None:
            self.check_model(model)
        self._say_split()
        if self._sgd is None:
            raise RuntimeError("the ring updates the weights: attach_optimizer first")
        first, rest = self._parts_of(model)
        first.train(model.training)
        rest.train(model.training)
        batch = len(x)
        ring = [(n, a, c) for n, (a, c) in self._ranges(batch) if c and not n.is_master]
        y = self._forward(model, x, step, ring) if ring else None
        local = y is None
        if local:  # no worker, or one failed: the first part here, on the whole batch
            y = first.forward(x, step=step)
        logits = rest.forward(y, step=step)
        loss, grad, hits = softmax_cross_entropy(logits, labels)
        dy = rest.backward(grad)
        _take_grads(rest, model)
        answers = {} if local else self._backward(model, dy, step, ring)
        summed = None if local else _rank0_sum(answers, ring, self._first_names)
        if summed is None:  # the first part's gradient here (its forward again if not here)
            if not local:
                first.forward(x, step=step)
            first.backward(dy)
            _take_grads(first, model)
            summed = {n: np.array(g) for n, g in model.gradients().items()
                      if n in self._first_names}  # fmt: skip
            exchange = "master"
        else:
            exchange = RING
            buffers = answers[ring[0][0].name][0]["buffers"]
            _set_buffers(model, self._buffer_names, buffers)
        self._update_first(model, summed, answers, exchange)
        for node, _, count in ring:
            figures = self._record.get(node.name, {})
            if "covered_by" not in figures and "seconds" in figures:
                self._measured_record(node, count, figures)
        return loss, hits

    def _forward(self, model, x, step: int, ring) -> np.ndarray | None:
        """The workers' FORWARDs: the first part's output in image order; None where one
        failed (each failed worker lost, the others told the ring failed)."""
        calls = self._calls(FORWARD, model, x, step, ring)
        answers = self._answers(calls, ring, step)
        if any(a is None or a[1] == OWN for a in answers.values()):
            self._placed.clear()
            return None
        parts = [answers[n.name][0]["y"] for n, _, _ in ring]
        if any(p.shape != (c, *self._shape) for p, (_, _, c) in zip(parts, ring, strict=True)):
            self._placed.clear()
            return None
        return np.concatenate(parts)

    def _backward(self, model, dy: np.ndarray, step: int, ring) -> dict:
        calls = self._calls(BACKWARD, model, dy, step, ring)
        return self._answers(calls, ring, step)

    def _calls(self, phase: int, model, x, step: int, ring) -> dict[str, Call]:
        """Each ring worker's FORWARD (its images) or BACKWARD (its rows of the gradient at
        the cut ``x``)."""
        parameters = model.parameters()
        peers = [node.client.address for node, _, _ in ring]
        wait = max(WAIT_FLOOR_S, max((self._deadline(n, c, 0) for n, _, c in ring), default=0))
        calls = {}
        for rank, (node, first, count) in enumerate(ring):
            place = phase == FORWARD and self._placed.get(node.name) != self._version
            sgd = self._sgd
            request = pb.ConvRequest(
                phase=IMAGES_STEP.phase, session=self.session, step=step,
                images=pb.ImagesStep(
                    spec_json=self._spec, input_shape=model.input_shape, seed=model.seed,
                    first=first, batch=len(x), cut_phase=phase,
                    ring=pb.ImagesRing(
                        peers=peers, rank=rank, version=self._version, place=place, lr=sgd.lr,
                        momentum=sgd.momentum, weight_decay=sgd.weight_decay,
                        wait_seconds=wait, answer_sum=rank == 0,
                        segment_bytes=self.segment_bytes, sum_ports=_sum_ports(ring),
                    ),
                ),
            )  # fmt: skip
            rows = x[first : first + count]
            arrays, formats = [], []
            if place:
                arrays += [(n, parameters[n]) for n in self._first_names]
                if self._momentum:
                    arrays += [(momentum_name(n), self._momentum[n]) for n in self._first_names]
                state = model.buffers()
                arrays += [(buffer_name(n), np.asarray(state[n], np.float32))
                           for n in self._buffer_names]  # fmt: skip
                formats += [FLOAT32] * len(arrays)
            if phase == FORWARD:
                fits = PALETTE8.nbytes(rows.shape) < FLOAT32.nbytes(rows.shape)
                arrays += [("x", rows), ("labels", np.zeros(count, np.float32))]
                formats += [PALETTE8.prepared(rows) if fits else FLOAT32, FLOAT32]
                answer = FLOAT32.nbytes((count, *self._shape)) + 64
            else:
                arrays, formats = [("dy", np.ascontiguousarray(rows))], [FLOAT32]
                answer = (self._parameter_bytes if rank == 0 else 0) + 64
            timeout = self._deadline(node, count, rows.nbytes) + 3 * wait
            calls[node.name] = Call(cut_call, node.client, request, arrays, formats, timeout,
                                    tuple(self._first_names), answer)  # fmt: skip
            if phase == FORWARD:
                self._record[node.name] = {"images": count, "placed": place}
        return calls

    def _answers(self, calls: dict[str, Call], ring, step: int) -> dict:
        """Each worker's answer (None where its call failed: it is lost); the time it took."""
        abort_on_failure(calls, ring, self.session, step)
        answers = {}
        for node, _, _ in ring:
            try:
                got, outcome, seconds, d, stats = calls[node.name].result()
            except WorkerError as e:
                self._lost(node, e, calls, ring, step)
                answers[node.name] = None
                self._record.setdefault(node.name, {}).update(covered_by=MASTER_NODE,
                                                              seconds=0.0)  # fmt: skip
                continue
            answers[node.name] = (got, outcome, d)
            figures = self._record.setdefault(node.name, {})
            figures["seconds"] = figures.get("seconds", 0.0) + stats.compute_seconds
            figures["wall_seconds"] = figures.get("wall_seconds", 0.0) + stats.wall_seconds
            for key in ("bytes_sent", "bytes_received"):
                figures[key] = figures.get(key, 0) + getattr(stats, key)
            figures["batchnorm_seconds"] = (figures.get("batchnorm_seconds", 0.0)
                                            + seconds["batchnorm_seconds"])  # fmt: skip
            figures["outcome"] = outcome
        return answers

    def _update_first(self, model, gradient: dict, answers: dict, exchange: str) -> None:
        """The master's copy of the first part updated as every worker's is; each worker's
        digest compared with it."""
        params = model.parameters()
        update_copy(params, self._first_names, gradient, self._momentum, self._sgd)
        self._version += 1
        state = model.buffers()
        values = [params[n] for n in self._first_names]
        mine = digest([*values, flat([np.asarray(state[n], np.float32)
                                      for n in self._buffer_names])])  # fmt: skip
        self._ring_record = {"exchange": exchange, "digest": mine.hex(), "cut": self.layer}
        compare_digests(self, answers, exchange, mine, lambda got: (got[1], got[2]))

    def plan_record(self) -> dict:
        record = super().plan_record()
        record.update(cut=self.layer, cut_output=list(self._shape))
        return record


def cut_split_class(layer: str) -> type[CutSplit]:
    """The cluster class of ``--split LAYER=images``."""
    return type("CutSplit", (CutSplit,), {"layer": layer})


def _aliased(spec, input_shape, model, executor) -> Model:
    """A model of ``spec`` (a part of ``model``'s, its layers named as there) whose layers hold
    ``model``'s own parameters and buffers, and draw its dropout masks; every convolution
    computes its input gradient (the rest's first one too: the cut's gradient)."""
    part = Model(spec, input_shape=tuple(input_shape), seed=model.seed, executor=executor)
    whole = {layer.name: layer for layer in model.layers}
    for layer in part.layers:
        own = whole.get(layer.name)
        if own is None:  # the rest's identity before a residual block (cutsplit.cut_spec)
            continue
        layer.params, layer.buffers = own.params, own.buffers
        if isinstance(layer, Conv2d):
            layer._zero_bias = own._zero_bias
            layer.need_input_grad = True
        if isinstance(layer, Dropout):
            layer.seed = own.seed
    return part


def _take_grads(part: Model, model) -> None:
    """``part``'s gradients as ``model``'s layers' own."""
    whole = {layer.name: layer for layer in model.layers}
    for layer in part.layers:
        if layer.params:
            whole[layer.name].grads = layer.grads


def _rank0_sum(answers: dict, ring, names: list[str]) -> dict | None:
    """The ring's sum of the first part's gradient, rank 0's answer; None where any worker's
    BACKWARD failed or the ring did not sum."""
    if not ring or any(answers.get(n.name) is None for n, _, _ in ring):
        return None
    got, outcome, _ = answers[ring[0][0].name]
    if outcome != SUMMED or any(got[n].size == 0 for n in names):
        return None
    return {n: got[n] for n in names}


def _set_buffers(model, names: list[str], vector: np.ndarray) -> None:
    """The first part's running statistics from rank 0's answer (one float32 vector)."""
    state = model.buffers()
    shapes = [np.shape(state[n]) for n in names]
    if vector.size != sum(int(np.prod(s)) for s in shapes):
        return
    for name, value in zip(names, unflat(vector, shapes), strict=True):
        state[name][...] = value


__all__ = ["CutSplit", "cut_call", "cut_split_class"]
