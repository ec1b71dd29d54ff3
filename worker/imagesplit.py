"""The worker's part of the whole network split by images (:mod:`hetconv.imagesplit`):
ImagesStep.

A request brings the model (its spec as JSON, the images' shape, its seed), every parameter,
the worker's images and their labels (:data:`hetconv.calls.IMAGES_STEP`). The worker builds
the model on its backend once per session (kept in the memory budget while the spec, shape and
seed stay the same; a new request's parameters are copied in), runs forward, the loss and
backward on its images (:func:`hetconv.imagesplit.images_gradients`) and answers every
parameter's gradient, each image's loss and whether it was a hit. What the request implies is
checked before its tensors arrive (:func:`check_request`): a spec the worker cannot build, a
network with batch norm (but with a ring), parameters that are not the model's (names, order,
sizes), images outside the batch, and passes that would not fit the worker's limit per
request.

With a ring (:mod:`hetconv.ring`, the request's ``ring``), the worker keeps the weights, the
momentum buffers and the buffers (placed by the request that sets ``place``; afterwards only the
images come), sums its gradient over the ring (:mod:`hetconv.worker.ring`), applies the update
and answers a digest of its state (or of a sample the master drew) and its chunk of the sum
(rank 0 the running statistics too); the sum runs bucket by bucket during backward where the
request sets ``bucket_bytes`` (:class:`~hetconv.worker.ring.BucketRing`); batch norm
layers sum their statistics over the ring mid-pass (:func:`hetconv.imagesplit.sync_batchnorm`).
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from hetconv.backends.arrays import to_host
from hetconv.calls import IMAGES_STEP, IMAGES_TENSORS, images_step_names
from hetconv.conv import LocalConv
from hetconv.cutsplit import BACKWARD, FORWARD, WHOLE
from hetconv.errors import InvalidCall, RequestTooLarge
from hetconv.formats import FLOAT32
from hetconv.imagesplit import (
    backward_hooks,
    images_gradients,
    parameter_shapes,
    refuse_batchnorm,
)
from hetconv.model import Model
from hetconv.optim import SGDConfig, sgd_update
from hetconv.proto import worker_pb2 as pb
from hetconv.ring import (
    DONE,
    MASTER_ROUND,
    OWN,
    RING_ANSWER_VALUES,
    ROUNDS_PER_SUM,
    SKETCH_VALUES,
    SUMMED,
    buffer_name,
    chunk_bounds,
    digest,
    digest_values,
    flat,
    momentum_name,
    own64,
    split64,
    unflat,
)
from hetconv.ringcheck import SUMS, sketch_answer, sums_digest
from hetconv.spec import check_spec, walk_spec
from hetconv.wire import WireTensor
from hetconv.worker import cutsplit
from hetconv.worker.context import WorkerContext
from hetconv.worker.ring import RingFailed

#: Bytes the passes hold per value of every layer's output per image: the output, what
#: backward keeps of it and its gradient, float32, with room for temporaries.
PASS_BYTES_PER_VALUE = 4 * 4
#: The memory budget's key of a session's model.
_KEY = ("images model", 0)


@functools.lru_cache(maxsize=16)
def _network(spec_json: str, input_shape: tuple[int, ...], batchnorm: bool = False,
             cut: bool = False):  # fmt: skip
    """(spec, parameter shapes by name, output values per image, buffer shapes by name, output
    shape) of a request's model; InvalidCall naming what is wrong with it. Batch norm only
    where ``batchnorm`` (a ring: its statistics summed among the workers); an output other
    than logits only where ``cut`` (a network's first part, :mod:`hetconv.cutsplit`)."""
    try:
        spec = json.loads(spec_json)
        if not isinstance(spec, list) or not all(isinstance(e, dict) for e in spec):
            raise ValueError("the spec is not a list of layer objects")
        check_spec(spec)
        if not batchnorm:
            refuse_batchnorm(spec)
        shapes, values = parameter_shapes(spec, input_shape)
        layers = list(walk_spec(spec, input_shape))
        buffers = {
            buffer_name(f"{ly.name}.{key}"): shape
            for ly in layers
            if ly.kind == "batchnorm"
            for key, shape in (("running_mean", ly.input_shape[:1]),
                               ("running_var", ly.input_shape[:1]), ("num_batches_tracked", ()))
        }  # fmt: skip
        output = layers[-1].output_shape if spec else input_shape
        if len(output) != 1 and not cut:
            raise ValueError(f"the model's output is {output}, not logits (classes,)")
    except (ValueError, TypeError, KeyError) as e:  # json.JSONDecodeError is a ValueError
        raise InvalidCall(f"images step: {e}") from None
    return spec, shapes, values, buffers, tuple(output)


def _description(request: pb.ConvRequest):
    d = request.images
    shape = tuple(int(v) for v in d.input_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise InvalidCall(f"input_shape {list(shape)} must be 3 positive sizes (C, H, W)")
    if d.batch < 1:
        raise InvalidCall("the batch holds no image")
    return d, shape


def check_request(
    request: pb.ConvRequest,
    tensors: list[WireTensor],
    max_bytes: int,
    device_bytes: int | None = None,
) -> int:
    """Check an ImagesStep request's header before its tensors arrive; returns the bytes its
    passes will hold in host memory (for the memory budget).

    ``device_bytes``: on a device backend, the device memory one call may use: the passes
    are held there (the model is kept on the device), so they are checked against it instead
    of ``max_bytes``, and hold nothing of the host's budget.

    Raises:
        InvalidCall: the model, the parameters or the images are not what the call needs.
        RequestTooLarge: the passes would hold more than ``max_bytes`` (``device_bytes``).
    """
    d, shape = _description(request)
    ring = d.ring if d.HasField("ring") else None
    if d.cut_phase and ring is None:
        raise InvalidCall("a cut network's step needs a ring (its first part's gradient is "
                          "summed among the workers)")  # fmt: skip
    _, shapes, values, buffers, output = _network(d.spec_json, shape, ring is not None,
                                                  d.cut_phase != WHOLE)  # fmt: skip
    if d.cut_phase == BACKWARD:
        return cutsplit.check_backward(request, tensors, output)
    if d.cut_phase not in (WHOLE, FORWARD):
        raise InvalidCall(f"cut_phase {d.cut_phase} is none of 0, 1, 2")
    names = [t.name for t in tensors]
    allowed = request_names(shapes, ring, list(buffers))
    if names not in allowed:
        raise InvalidCall(f"tensors {names} sent, expected {allowed[0]} for this model")
    for t in tensors[:-2]:
        name = t.name.removeprefix(momentum_name(""))
        want = buffers[name] if name in buffers else shapes[name]
        if tuple(t.shape) != want or t.format is not FLOAT32:
            raise InvalidCall(f"{t.name} is {t.format.label} {t.shape}, expected float32 {want}")
    x, labels = tensors[-2].shape, tensors[-1].shape
    count = x[0] if x else 0
    if len(x) != 4 or tuple(x[1:]) != shape or count < 1:
        raise InvalidCall(f"x has shape {x}, expected (count >= 1, {', '.join(map(str, shape))})")
    if labels != (count,) or tensors[-1].format is not FLOAT32:
        raise InvalidCall(f"labels are {tensors[-1].format.label} {labels}, expected float32 "
                          f"({count},)")  # fmt: skip
    if d.first + count > d.batch:
        raise InvalidCall(f"images {d.first} .. {d.first + count} are not within a batch of "
                          f"{d.batch}")  # fmt: skip
    parameters = sum(math.prod(s) for s in shapes.values())
    held = PASS_BYTES_PER_VALUE * values * count + 2 * FLOAT32.nbytes((parameters,))
    where = f"this worker's limit of {max_bytes} bytes per request"
    if device_bytes is not None:
        where = f"the {device_bytes} bytes one call may use of this worker's device"
    if held > (max_bytes if device_bytes is None else device_bytes):
        raise RequestTooLarge(
            f"the passes on {count} images would hold {held} bytes: beyond {where}"
        )
    return held if device_bytes is None else 0


def request_names(shapes, ring, buffers=()) -> list[list[str]]:
    """The tensor names an ImagesStep request may carry: every parameter, then the images and
    labels; with a ring (:mod:`hetconv.ring`), only the images and labels, or where it places
    the weights, every parameter, with or without every momentum buffer, then every buffer
    (batch norm's running statistics), before them."""
    names, _ = images_step_names(shapes)
    if ring is None:
        return [list(names)]
    if not ring.place:
        return [list(IMAGES_TENSORS)]
    momenta = [momentum_name(n) for n in shapes]
    return [[*shapes, *buffers, *IMAGES_TENSORS],
            [*shapes, *momenta, *buffers, *IMAGES_TENSORS]]  # fmt: skip


@dataclass
class _Kept:
    """A session's model, kept between steps; with a ring, the version of its weights (the
    updates applied; None: not placed, or in doubt) and the momentum buffers."""

    step: int
    key: tuple
    model: Model
    version: int | None = None
    momentum: dict[str, np.ndarray] | None = None
    sketch: np.ndarray | None = None  # the step's sketches of its own gradient, where asked
    cut: object = None  # a cut network's FORWARD, kept for its BACKWARD (worker.cutsplit)

    @property
    def held_bytes(self) -> int:
        momenta = sum(a.nbytes for a in (self.momentum or {}).values())
        return sum(a.nbytes for a in self.model.state().values()) + momenta


class ImagesCalls:
    """ImagesStep's core on a :class:`~hetconv.worker.context.WorkerContext`."""

    def __init__(self, context: WorkerContext):
        self.context = context

    def _kept(self, request: pb.ConvRequest, spec, shape) -> _Kept:
        """The session's model for this spec, shape and seed (built once, kept)."""
        ctx, d = self.context, request.images
        key = (d.spec_json, shape, d.seed)
        kept = ctx.budget.saved(request.session, _KEY)
        if kept is None or kept.key != key:
            model = Model(spec, input_shape=shape, seed=d.seed, executor=LocalConv(ctx.backend))
            if ctx.backend.on_device:  # kept there: each step's passes run on the device
                with ctx.backend.scope():
                    model.place(ctx.backend.to_device)
            kept = _Kept(request.step, key, model)
        kept.step = request.step
        ctx.keep(request, _KEY, kept)
        return kept

    def _model(self, request: pb.ConvRequest, spec, shape) -> Model:
        return self._kept(request, spec, shape).model

    def step(self, messages: Iterator):
        ctx = self.context
        request, arrays, receive = ctx.receive(messages, IMAGES_STEP)
        d, shape = _description(request)
        spec = _network(d.spec_json, shape, d.HasField("ring"), d.cut_phase != WHOLE)[0]
        if d.cut_phase:
            return self._cut_step(request, spec, shape, arrays, receive)
        *parameters, x, labels = arrays
        if not all(np.isfinite(p).all() for p in parameters) or not np.isfinite(x).all():
            raise InvalidCall("a parameter or x holds NaN or Inf")
        if d.HasField("ring"):
            kept = self._kept(request, spec, shape)
            return self._ring_step(request, kept, parameters, x, labels, receive)
        model = self._model(request, spec, shape)
        classes = _classes(model, labels)
        names = [h.name for h in request.tensors[: len(parameters)]]
        backend = ctx.backend
        start = time.perf_counter()

        def work():
            own = model.parameters()
            with backend.scope():
                _copy_in(backend, [own[name] for name in names], parameters)
                model.train()
                out = images_gradients(model, backend.to_device(x), backend.to_device(classes),
                                       d.first, d.batch, int(request.step),
                                       copy=not backend.on_device)  # fmt: skip
                if backend.on_device:  # the answer down at once
                    grads, losses, hits = out
                    *values, losses, hits = _down(backend, [*map(grads.get, names), losses,
                                                            hits.astype(np.float32)])  # fmt: skip
                    out = dict(zip(names, values, strict=True)), losses, hits
                backend.synchronize()
            return out

        grads, losses, hits = ctx.run(work)
        tensors = [(name, grads[name], FLOAT32) for name in names]
        tensors += [("losses", losses, FLOAT32), ("hits", hits.astype(np.float32), FLOAT32)]
        return tensors, time.perf_counter() - start, receive

    def _cut_step(self, request: pb.ConvRequest, spec, shape, arrays, receive):
        """A cut network's FORWARD or BACKWARD (:mod:`hetconv.worker.cutsplit`)."""
        if not all(np.isfinite(a).all() for a in arrays):
            raise InvalidCall("a parameter, x or dy holds NaN or Inf")
        kept = self._kept(request, spec, shape)
        if request.images.cut_phase == BACKWARD:
            tensors, compute = cutsplit.backward(self, request, kept, arrays[0])
        else:
            *parameters, x, _ = arrays
            sums = functools.partial(_BatchNormSums, self.context, request)
            tensors, compute = cutsplit.forward(self, request, kept, parameters, x, sums)
        return tensors, compute, receive

    def place_or_check(self, request: pb.ConvRequest, kept: _Kept, parameters) -> None:
        """Place the weights a ring request carries, or check the version held."""
        ring = request.images.ring
        if ring.place:
            placed = [h.name for h in request.tensors[: len(parameters)]]
            _place(kept, placed, parameters, self.context.backend)
            kept.version = int(ring.version)
        elif kept.version != ring.version:
            raise InvalidCall(f"this worker holds weights of version {kept.version}, the step "
                              f"needs {ring.version}: they must be placed")  # fmt: skip

    def _ring_step(self, request: pb.ConvRequest, kept: _Kept, parameters, x, labels, receive):
        """An ImagesStep with a ring (:mod:`hetconv.ring`): place the weights the request
        carries (or check the version held), compute this worker's gradient, sum it over the
        ring and apply the SGD update; answer the sum where asked (else empty gradients), or,
        where the ring failed, this worker's own gradient (the weights left in doubt)."""
        ctx, d, ring = self.context, request.images, request.images.ring
        model = kept.model
        classes = _classes(model, labels)
        names = list(model.parameters())
        backend = ctx.backend
        ctx.ring.begin(request.session, int(request.step))
        self.place_or_check(request, kept, parameters)
        start = time.perf_counter()
        seconds = dict.fromkeys(("batchnorm", "ring", "update", "digest"), 0.0)
        reduce = _BatchNormSums(ctx, request, seconds)
        overlap = None  # the gradient's buckets summed while backward runs

        def work():
            nonlocal overlap
            model.train()
            if ring.bucket_bytes:
                shapes = [p.shape for p in model.parameters().values()]
                overlap = ctx.ring.buckets(request, shapes, ring.rank == 0 and ring.master_part)
                kept.momentum = kept.momentum or {}  # each bucket's update, once it is summed
                overlap.summed = functools.partial(_apply_bucket, request, kept, names, backend)
            with backend.scope(), backward_hooks(model, overlap):  # the model's own gradients
                grads, losses, hits = images_gradients(
                    model, backend.to_device(x), backend.to_device(classes), d.first, d.batch,
                    int(request.step), reduce, copy=False,
                )  # fmt: skip
                if backend.on_device:  # the gradients cross for the ring's sum, after this
                    losses, hits = _down(backend, [losses, hits.astype(np.float32)])
                backend.synchronize()
            return grads, losses, hits

        kept.version = None  # in doubt until updated
        try:
            grads, losses, hits = ctx.run(work)
        except RingFailed:  # a batch norm sum: no gradient of the whole batch's statistics
            if overlap is not None:
                overlap.cancel()
            grads = {n: np.zeros(0, np.float32) for n in names}
            losses, hits = np.zeros(len(x), np.float32), np.zeros(len(x), bool)
            outcome, piece = OWN, np.zeros(0, np.float32)
            compute = time.perf_counter() - start
        except BaseException:  # the passes failed: the ring's thread ends too
            if overlap is not None:
                overlap.cancel()
            raise
        else:
            # What the images cost, not the ring after it (which waits for the master's part
            # and the slowest rank): the master shares the images by it.
            compute = time.perf_counter() - start
            outcome, grads, piece = self._sum_and_update(request, kept, names, grads, overlap,
                                                         seconds)  # fmt: skip
        tensors = [(name, grads[name], FLOAT32) for name in names]
        ring_values, buffers = self._ring_values(request, model, outcome, seconds)
        sums = np.zeros(0, np.float32)
        if outcome != OWN and kept.sketch is not None:  # of its own gradient, by the sum's seed
            ring_values[-SKETCH_VALUES:] = kept.sketch
            sums = reduce.answer(ring_values[-SKETCH_VALUES:])
        tensors += [("losses", losses, FLOAT32), ("hits", hits.astype(np.float32), FLOAT32),
                    ("ring", ring_values, FLOAT32), ("buffers", buffers, FLOAT32),
                    ("slice", piece, FLOAT32), ("sums", sums, FLOAT32)]  # fmt: skip
        return tensors, compute, receive

    def _ring_values(self, request: pb.ConvRequest, model: Model, outcome: int, seconds):
        """(the answer's ring values: the outcome, the digest of the weights but where the
        worker answers its own gradient, and where the step's time beyond compute went;
        the running statistics where rank 0 answers the sum, else empty)."""
        ring = request.images.ring
        values, buffers = np.zeros(RING_ANSWER_VALUES, np.float32), np.zeros(0, np.float32)
        values[0] = outcome
        if outcome != OWN:  # a sample of the weights where the master drew one
            began = time.perf_counter()
            share = ring.digest_share if ring.digest_seed else 1.0
            state = _state(model, self.context.backend)
            values[1:5] = digest_values(digest(state, ring.digest_seed, share))
            seconds["digest"] = time.perf_counter() - began
            if outcome == SUMMED and ring.rank == 0:  # the running statistics: rank 0's
                buffers = state[-1]
        values[5 : 5 + len(seconds)] = list(seconds.values())
        return values, buffers

    def _sum_and_update(self, request: pb.ConvRequest, kept: _Kept, names, grads, overlap=None,
                        seconds=None):  # fmt: skip
        """(outcome, the gradients to answer, the slice of the sum to answer): the ring's sum
        applied to the kept weights (the sum ``overlap``, a
        :class:`~hetconv.worker.ring.BucketRing`, ran during backward); ``seconds``' ``ring``
        and ``update`` take the time the sum and the update took after the passes."""
        ring = request.images.ring
        seconds = {} if seconds is None else seconds
        began = time.perf_counter()
        kept.sketch = None
        try:
            if overlap is not None:
                vector = overlap.finish([grads[n] for n in names])  # (down: those not given)
                seconds["ring"] = time.perf_counter() - began
                if overlap.own is not None:
                    kept.sketch = sketch_answer(overlap.own, vector)
                return self._update(request, kept, names, vector, overlap.applied, seconds)
        except RingFailed:
            return OWN, _fresh(grads), np.zeros(0, np.float32)
        own = _host_vector(self.context.backend, [grads[n] for n in names])
        mine = own.copy() if ring.sketch else None  # the ring sums ``own`` in place
        try:
            vector = own  # a fresh vector: summed in place
            if ring.rank == 0 and ring.master_part:
                theirs = self.context.ring.master_part(request)
                if theirs.shape != own.shape:
                    raise RingFailed(f"the master's part has {theirs.size} values, not {own.size}")
                vector = theirs + own  # the master's range first, as the nodes are ordered
            self.context.ring.all_reduce(request, vector)
        except RingFailed:
            if ring.rank == 0 and ring.master_part:
                self.context.ring.abort(request)
            return OWN, _fresh(grads), np.zeros(0, np.float32)
        seconds["ring"] = time.perf_counter() - began
        if mine is not None:
            kept.sketch = sketch_answer(mine, vector)
        return self._update(request, kept, names, vector, (), seconds)

    def _update(self, request: pb.ConvRequest, kept: _Kept, names, vector: np.ndarray,
                applied=frozenset(), seconds=None):  # fmt: skip
        """(outcome, the gradients to answer, the slice of the sum to answer): the summed
        ``vector`` applied to the kept weights (but the parameters ``applied`` already, by
        index); with ``sum_slice``, this rank's chunk of it alone (the master joins the ranks'
        chunks: its link takes them all at once)."""
        ring = request.images.ring
        began = time.perf_counter()
        params, backend = kept.model.parameters(), self.context.backend
        shapes = [params[n].shape for n in names]
        summed = unflat(vector, shapes)  # on a device: there in one upload
        there = unflat(backend.to_device(vector), shapes) if backend.on_device else summed
        _apply(request, kept, names, there, set(range(len(names))) - set(applied), backend)
        kept.version = int(ring.version) + 1
        if seconds is not None:
            seconds["update"] = time.perf_counter() - began
        empty = {n: np.zeros(0, np.float32) for n in names}
        if ring.answer_sum and ring.sum_slice:  # a view: the vector is this step's own
            a, b = chunk_bounds(vector.size, len(ring.peers))[ring.rank]
            return SUMMED, empty, vector[a:b]
        if ring.answer_sum:
            return SUMMED, dict(zip(names, summed, strict=True)), np.zeros(0, np.float32)
        return DONE, empty, np.zeros(0, np.float32)


class _BatchNormSums:
    """``reduce`` of a ring step's batch norm layers (:func:`hetconv.imagesplit.sync_batchnorm`):
    each sum over the ring, float64, its time in ``seconds["batchnorm"]``; where the request
    asks for sketches (spot checks: :mod:`hetconv.ringcheck`), each sum's part here and total
    kept for the answer (:meth:`answer`)."""

    def __init__(self, context: WorkerContext, request: pb.ConvRequest, seconds: dict):
        self.context, self.request, self.seconds = context, request, seconds
        self.meanwhile = None  # work to fill a sum's wait (the kernel gradients left for later)
        self.rounds = iter(range(1, MASTER_ROUND // ROUNDS_PER_SUM))
        self.keep = request.images.ring.sketch
        self.parts: list[np.ndarray] = []
        self.totals: list[np.ndarray] = []

    def __call__(self, v):
        began = time.perf_counter()  # (from a device: its few values down and up)
        backend = self.context.backend
        filled = [0.0]  # the work done meanwhile is not the sum's

        def meanwhile():
            start = time.perf_counter()
            self.meanwhile()
            filled[0] = time.perf_counter() - start

        try:
            offset = next(self.rounds) * ROUNDS_PER_SUM
            work = meanwhile if self.meanwhile is not None else None
            if len(self.request.images.ring.peers) == 1 and not self.keep:
                if work is not None:  # a ring of one: its own sum, where its values are
                    work()
                return own64(v)
            host = backend.to_host(v)
            summed = self.context.ring.sum64(self.request, host, offset, work)
            if self.keep:
                self.parts.append(np.asarray(host, np.float64))
                self.totals.append(summed)
            return backend.to_device(summed)
        finally:
            self.seconds["batchnorm"] += time.perf_counter() - began - filled[0]

    def answer(self, sketch: np.ndarray) -> np.ndarray:
        """Its parts of the sums (:func:`~hetconv.ring.split64`: exact float32 pieces), and the
        digest of the totals it took set in its ``sketch`` values; empty where none."""
        if not self.parts:
            return np.zeros(0, np.float32)
        sketch[SUMS] = sums_digest(np.concatenate(self.totals))
        return split64(np.concatenate(self.parts))


def _apply(request: pb.ConvRequest, kept: _Kept, names, gradients, which, backend) -> None:
    """The SGD update of the parameters ``which`` (indices into ``names``) with their summed
    ``gradients`` (every parameter's, in order), applied to the kept weights and momentum
    where ``backend`` keeps them (a host gradient sent there first)."""
    ring = request.images.ring
    sgd = SGDConfig(lr=ring.lr, momentum=ring.momentum, weight_decay=ring.weight_decay)
    params = kept.model.parameters()
    if kept.momentum is None:
        kept.momentum = {}
    with backend.scope():  # (the ring's thread too)
        for i in sorted(which):
            gradient, held = backend.to_device(gradients[i]), kept.momentum.get(names[i])
            buf = sgd_update(params[names[i]], gradient, held, sgd)
            if buf is not None:
                kept.momentum[names[i]] = buf


def _apply_bucket(request, kept: _Kept, names, backend, vector: np.ndarray, which) -> None:
    """A bucket's update as soon as its ring has summed it (in the ring's thread, while
    backward goes on: its parameters' layers are done with them this step)."""
    shapes = [p.shape for p in kept.model.parameters().values()]
    _apply(request, kept, names, unflat(vector, shapes), which, backend)


def _place(kept: _Kept, names: list[str], arrays: list[np.ndarray], backend) -> None:
    """The weights, momentum buffers and buffers a request places, by their names, where
    ``backend`` keeps them."""
    params, buffers = kept.model.parameters(), kept.model.buffers()
    kept.momentum = {}
    put = backend.to_device
    with backend.scope():
        for name, value in zip(names, arrays, strict=True):
            if name.startswith(momentum_name("")):
                kept.momentum[name.removeprefix(momentum_name(""))] = put(
                    np.array(value, np.float32)
                )
            elif name.startswith(buffer_name("")):
                buffers[name.removeprefix(buffer_name(""))][...] = put(value)
            else:
                params[name][...] = put(value)


def _copy_in(backend, targets: list, values: list[np.ndarray]) -> None:
    """Host ``values`` into the model's arrays ``targets`` (on a device: in one upload)."""
    if backend.on_device:
        values = unflat(backend.to_device(flat(values)), [v.shape for v in values])
    for target, value in zip(targets, values, strict=True):
        target[...] = value


def _host_vector(backend, arrays: list) -> np.ndarray:
    """``arrays`` (the backend's), in order, as one fresh float32 host vector: from a
    device, joined there and downloaded at once."""
    if not backend.on_device:
        return flat(arrays)
    with backend.scope():
        joined = backend.xp.concatenate([a.astype(np.float32, copy=False).ravel() for a in arrays])
        return backend.to_host(joined)


def _down(backend, arrays: list) -> list[np.ndarray]:
    """Device ``arrays`` as float32 host arrays of their shapes, in one download (views of
    one vector)."""
    return unflat(_host_vector(backend, arrays), [a.shape for a in arrays])


def _fresh(grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The gradients the model holds, as fresh host arrays (answered where the ring failed)."""
    return {name: np.array(to_host(g), np.float32) for name, g in grads.items()}


def _state(model: Model, backend) -> list[np.ndarray]:
    """What a worker's digest covers, on the host: every parameter, then every buffer (as one
    float32 vector); from a device in one download."""
    params, buffers = list(model.parameters().values()), list(model.buffers().values())
    if not backend.on_device:
        return [*params, flat(buffers)]
    vector = _host_vector(backend, [*params, *buffers])
    size = sum(p.size for p in params)
    return [*unflat(vector[:size], [p.shape for p in params]), vector[size:]]


def _classes(model: Model, labels: np.ndarray) -> np.ndarray:
    classes = labels.astype(np.int64)
    count = model.output_shape[0]
    if not (classes == labels).all() or classes.min() < 0 or classes.max() >= count:
        raise InvalidCall(f"labels must be class indices in 0 .. {count - 1}")
    return classes


__all__ = ["ImagesCalls", "check_request"]
