"""The worker's part of the whole network split by images (:mod:`hetconv.imagesplit`):
ImagesStep.

A request brings the model (its spec as JSON, the images' shape, its seed), every parameter,
the worker's images and their labels (:data:`hetconv.calls.IMAGES_STEP`). The worker builds
the model on its backend once per session (kept in the memory budget while the spec, shape and
seed stay the same; a new request's parameters are copied in), runs forward, the loss and
backward on its images (:func:`hetconv.imagesplit.images_gradients`) and answers every
parameter's gradient, each image's loss and whether it was a hit. What the request implies is
checked before its tensors arrive (:func:`check_request`): a spec the worker cannot build, a
network with batch norm, parameters that are not the model's (names, order, sizes), images
outside the batch, and passes that would not fit the worker's limit per request.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from hetconv.calls import IMAGES_STEP, images_step_names
from hetconv.conv import LocalConv
from hetconv.errors import InvalidCall, RequestTooLarge
from hetconv.formats import FLOAT32
from hetconv.imagesplit import images_gradients, parameter_shapes, refuse_batchnorm
from hetconv.model import Model
from hetconv.proto import worker_pb2 as pb
from hetconv.spec import check_spec, walk_spec
from hetconv.wire import WireTensor
from hetconv.worker.context import WorkerContext

#: Bytes the passes hold per value of every layer's output per image: the output, what
#: backward keeps of it and its gradient, float32, with room for temporaries.
PASS_BYTES_PER_VALUE = 4 * 4
#: The memory budget's key of a session's model.
_KEY = ("images model", 0)


@functools.lru_cache(maxsize=16)
def _network(spec_json: str, input_shape: tuple[int, ...]):
    """(spec, parameter shapes by name, output values per image) of a request's model;
    InvalidCall naming what is wrong with it."""
    try:
        spec = json.loads(spec_json)
        if not isinstance(spec, list) or not all(isinstance(e, dict) for e in spec):
            raise ValueError("the spec is not a list of layer objects")
        check_spec(spec)
        refuse_batchnorm(spec)
        shapes, values = parameter_shapes(spec, input_shape)
        output = list(walk_spec(spec, input_shape))[-1].output_shape if spec else input_shape
        if len(output) != 1:
            raise ValueError(f"the model's output is {output}, not logits (classes,)")
    except (ValueError, TypeError, KeyError) as e:  # json.JSONDecodeError is a ValueError
        raise InvalidCall(f"images step: {e}") from None
    return spec, shapes, values


def _description(request: pb.ConvRequest):
    d = request.images
    shape = tuple(int(v) for v in d.input_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise InvalidCall(f"input_shape {list(shape)} must be 3 positive sizes (C, H, W)")
    if d.batch < 1:
        raise InvalidCall("the batch holds no image")
    return d, shape


def check_request(request: pb.ConvRequest, tensors: list[WireTensor], max_bytes: int) -> int:
    """Check an ImagesStep request's header before its tensors arrive; returns the bytes its
    passes will hold (for the memory budget).

    Raises:
        InvalidCall: the model, the parameters or the images are not what the call needs.
        RequestTooLarge: the passes would hold more than ``max_bytes``.
    """
    d, shape = _description(request)
    _, shapes, values = _network(d.spec_json, shape)
    names = [t.name for t in tensors]
    expected, _ = images_step_names(shapes)
    if names != list(expected):
        raise InvalidCall(f"tensors {names} sent, expected {list(expected)} for this model")
    for t in tensors[:-2]:
        if tuple(t.shape) != shapes[t.name] or t.format is not FLOAT32:
            raise InvalidCall(
                f"{t.name} is {t.format.label} {t.shape}, expected float32 {shapes[t.name]}"
            )
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
    if held > max_bytes:
        raise RequestTooLarge(
            f"the passes on {count} images would hold {held} bytes: beyond this worker's limit "
            f"of {max_bytes} bytes per request"
        )
    return held


@dataclass
class _Kept:
    """A session's model, kept between steps."""

    step: int
    key: tuple
    model: Model

    @property
    def held_bytes(self) -> int:
        return sum(a.nbytes for a in self.model.state().values())


class ImagesCalls:
    """ImagesStep's core on a :class:`~hetconv.worker.context.WorkerContext`."""

    def __init__(self, context: WorkerContext):
        self.context = context

    def _model(self, request: pb.ConvRequest, spec, shape) -> Model:
        """The session's model for this spec, shape and seed (built once, kept)."""
        ctx, d = self.context, request.images
        key = (d.spec_json, shape, d.seed)
        kept = ctx.budget.saved(request.session, _KEY)
        if kept is None or kept.key != key:
            model = Model(spec, input_shape=shape, seed=d.seed, executor=LocalConv(ctx.backend))
            kept = _Kept(request.step, key, model)
        kept.step = request.step
        ctx.keep(request, _KEY, kept)
        return kept.model

    def step(self, messages: Iterator):
        ctx = self.context
        request, arrays, receive = ctx.receive(messages, IMAGES_STEP)
        d, shape = _description(request)
        spec, _, _ = _network(d.spec_json, shape)
        *parameters, x, labels = arrays
        if not all(np.isfinite(p).all() for p in parameters) or not np.isfinite(x).all():
            raise InvalidCall("a parameter or x holds NaN or Inf")
        model = self._model(request, spec, shape)
        spec_classes = model.output_shape[0]
        classes = labels.astype(np.int64)
        if not (classes == labels).all() or classes.min() < 0 or classes.max() >= spec_classes:
            raise InvalidCall(f"labels must be class indices in 0 .. {spec_classes - 1}")
        names = [h.name for h in request.tensors[: len(parameters)]]
        start = time.perf_counter()

        def work():
            own = model.parameters()
            for name, value in zip(names, parameters, strict=True):
                own[name][...] = value
            model.train()
            out = images_gradients(model, x, classes, d.first, d.batch, int(request.step))
            ctx.backend.synchronize()
            return out

        grads, losses, hits = ctx.run(work)
        tensors = [(name, grads[name], FLOAT32) for name in names]
        tensors += [("losses", losses, FLOAT32), ("hits", hits.astype(np.float32), FLOAT32)]
        return tensors, time.perf_counter() - start, receive


__all__ = ["ImagesCalls", "check_request"]
