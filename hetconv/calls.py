"""The calls a worker serves: every RPC of ``hetconv.v1.ConvWorker`` and what each one carries.

One table, read by the worker's service (its handlers and request checks), the master's client
(its stubs, the tensors it sends and those it expects back) and the cost model (the bytes a call
moves)::

    call       request tensors      answer tensors
    Forward    x, w, b              y
    Backward   dy                   dw, db, and dx when the request sets need_input_grad
    Echo       any, named freely    the same, unchanged
    StageForward   x, w, b, bn      y: the stage's output of the owned kernels, stats
    StageBackward  dy               dw, db, dbn of the owned kernels, and dx when asked
    PlaceKernels   w, b, mw, mb, f, mf  (nothing): the worker now holds that slice (resident)
    FetchKernels   (nothing)        w, b, mw, mb, f, mf of the slice the worker holds
    ResidentStageForward   x, hw, hb, hf, bn    y, as StageForward (own kernels from the
                                            worker's slice), or with a split head z; stats
    ResidentStageBackward  dy, dz       ew, eb, ef: the updated edge kernels, dbn, and dx when
                                        asked
    ReplicaForward x, w, b          (nothing): the worker keeps the replicated block's output
    PutPart    p                    (nothing): a part of a split block's output or gradient
    FetchPart  (nothing)            p: the gradient part a worker sent a lost one
    ImagesStep     every parameter (named as the model names them), x, labels
                                    every parameter's gradient (as sent), losses, hits: the
                                    whole network on the worker's images (:data:`IMAGES_STEP`)
    RingPart   p                    (nothing): a chunk of a ring exchange's gradient
                                    (:data:`RING_PART`)
    Describe   (DescribeRequest -> DeviceDescription)
    Probe      (ProbeRequest -> ProbeResult)

Each tensor's shape follows from the call's geometry (:mod:`hetconv.callshapes`).

Activations and their gradients (``x``, ``y``, ``dy``, ``dx``) travel in the call's *wire
format* (:mod:`hetconv.formats`: float32, or a 16-bit one the master chose); kernels and their
gradients (``w``, ``b``, ``dw``, ``db``) always travel as float32, so the weights the master
keeps stay exact. :attr:`TensorRule.activation` says which is which.

Each convolution call has two RPCs: the streamed one (``Forward``: a header, then 1 MiB chunks)
and the one-message one (``ForwardBundle``) for small tensors. :data:`METHODS` holds every RPC
with its gRPC path, streaming kinds and (de)serializers; ``tests/test_wire.py`` checks it
against the proto's service.

Also here, as both ends depend on it: :data:`SERVICE_NAME`, and :data:`READY`, the line a worker
process prints when it serves (a launcher waits for it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from hetconv.backends import ConvShape
from hetconv.callshapes import (
    ResidentStageShape,
    Shape,
    SliceShape,
    StageShape,
    bias_shape,
    call_shape,
    edge_bias_shape,
    edge_head_shape,
    edge_kernel_shape,
    halo_bias_shape,
    halo_head_shape,
    halo_kernel_shape,
    head_rows_shape,  # noqa: F401 (kept importable from here)
    input_shape,
    kernel_shape,
    map_shape,
    part_shape,
    replica_bias_shape,
    replica_kernel_shape,
    resident_bn_shape,
    resident_dbn_shape,
    resident_grad_shape,
    resident_input_shape,
    resident_logits_shape,
    resident_output_shape,
    resident_replica_bias_shape,
    resident_replica_kernel_shape,
    resident_sent_input_shape,
    resident_stats_shape,
    slice_bias_shape,
    slice_head_shape,
    slice_kernel_shape,
    stage_bias_shape,
    stage_bn_shape,
    stage_db_shape,
    stage_dbn_shape,
    stage_dw_shape,
    stage_grad_shape,
    stage_input_shape,
    stage_kernel_shape,
    stage_output_shape,
    stage_sent_input_shape,
    stage_stats_shape,
)
from hetconv.formats import FLOAT32, TensorFormat
from hetconv.proto import worker_pb2 as pb
from hetconv.wire import (
    deserialize_bundle,
    deserialize_message,
    serialize_bundle,
    serialize_message,
)

#: The gRPC service of a worker, ``hetconv.v1.ConvWorker``.
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ConvWorker"].full_name
#: A worker process prints this, then its ``HOST:PORT``, once it serves.
READY = "hetconv worker ready on"


def _names_replica(shape) -> bool:
    """Whether a call's geometry names a replicated block (its stage's ``replica``)."""
    stage = shape.stage if isinstance(shape, ResidentStageShape) else shape
    return isinstance(stage, StageShape) and stage.replica is not None


@dataclass(frozen=True)
class TensorRule:
    """One tensor of a call: its name, how its shape follows from the call's geometry,
    whether it travels only when the request asks for the input gradient, only when the call
    names a replicated block (``replica_only``; then the input gradient does not travel),
    and whether it is an activation (or its gradient), which travels in the call's wire
    format; others (kernels and their gradients) always travel as float32."""

    name: str
    shape: Callable[[Any], Shape]  # of a ConvShape, or a StageShape for stage calls
    input_grad_only: bool = False
    activation: bool = False
    replica_only: bool = False

    def sent(self, need_input_grad: bool, replica: bool) -> bool:
        """Whether this answer tensor travels in a call with these settings."""
        if self.replica_only:
            return replica
        return not self.input_grad_only or (need_input_grad and not replica)

    def format(self, fmt: TensorFormat) -> TensorFormat:
        """This tensor's format in a call whose wire format is ``fmt``."""
        return fmt if self.activation else FLOAT32


#: gRPC's handler factory for each (request streaming, response streaming) kind of method.
HANDLER_FACTORIES: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}
#: The ``grpc.Channel`` method that makes a stub of each kind.
_STUB_FACTORIES = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}


@dataclass(frozen=True)
class Method:
    """One RPC as gRPC sees it: its name, streaming kinds and (de)serializers."""

    name: str
    request_streaming: bool
    response_streaming: bool
    serialize_request: Callable
    deserialize_request: Callable
    serialize_response: Callable
    deserialize_response: Callable

    @property
    def path(self) -> str:
        """``/hetconv.v1.ConvWorker/<name>``, what a channel calls."""
        return f"/{SERVICE_NAME}/{self.name}"

    @property
    def kinds(self) -> tuple[bool, bool]:
        """(request streaming, response streaming)."""
        return self.request_streaming, self.response_streaming

    def handler(self, behaviour: Callable) -> grpc.RpcMethodHandler:
        """The server's handler of this RPC, running ``behaviour``."""
        return HANDLER_FACTORIES[self.kinds](
            behaviour,
            request_deserializer=self.deserialize_request,
            response_serializer=self.serialize_response,
        )

    def stub(self, channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
        """The client's callable of this RPC on ``channel``."""
        return getattr(channel, _STUB_FACTORIES[self.kinds])(
            self.path,
            request_serializer=self.serialize_request,
            response_deserializer=self.deserialize_response,
        )


def _unary(name: str, request: type, response: type) -> Method:
    return Method(
        name, False, False,
        request.SerializeToString, request.FromString,
        response.SerializeToString, response.FromString,
    )  # fmt: skip


def _streamed(name: str) -> Method:
    codec = (serialize_message, deserialize_message)
    return Method(name, True, True, *codec, *codec)


def _bundled(name: str) -> Method:
    codec = (serialize_bundle, deserialize_bundle)
    return Method(name, False, False, *codec, *codec)


@dataclass(frozen=True)
class UnaryCall:
    """A call without tensors: one protobuf message each way."""

    name: str
    request: type
    response: type

    @functools.cached_property
    def method(self) -> Method:
        return _unary(self.name, self.request, self.response)


@dataclass(frozen=True)
class ConvCall:
    """A call that carries tensors, through its two RPCs.

    Args:
        name: the streamed RPC; the one-message RPC is ``<name>Bundle``.
        phase: the ``Phase`` its request header must carry.
        request: the tensors of its request, in order; None: any, named freely (Echo).
        answer: the tensors of its answer, in order; None: the request's, unchanged (Echo).
    """

    name: str
    phase: int
    request: tuple[TensorRule, ...] | None
    answer: tuple[TensorRule, ...] | None

    @functools.cached_property
    def stream(self) -> Method:
        return _streamed(self.name)

    @functools.cached_property
    def bundle(self) -> Method:
        return _bundled(f"{self.name}Bundle")

    def _answer(self, need_input_grad: bool, replica: bool = False) -> tuple[TensorRule, ...]:
        if self.answer is None:
            raise ValueError(f"{self.name} answers with the tensors its request sent")
        return tuple(t for t in self.answer if t.sent(need_input_grad, replica))

    def _request(self) -> tuple[TensorRule, ...]:
        if self.request is None:
            raise ValueError(f"{self.name} carries whatever tensors its request names")
        return self.request

    @functools.cached_property
    def request_names(self) -> tuple[str, ...] | None:
        """The request's tensor names in order; None when any are allowed (Echo)."""
        return None if self.request is None else tuple(t.name for t in self.request)

    def answer_names(self, need_input_grad: bool = False, replica: bool = False) -> tuple[str, ...]:
        """The answer's tensor names in order (``replica``: the call names a replicated
        block)."""
        return tuple(t.name for t in self._answer(need_input_grad, replica))

    def request_shapes(self, shape: ConvShape) -> dict[str, Shape]:
        """The request's tensor shapes for a call of geometry ``shape``, by name, in order."""
        return {t.name: t.shape(shape) for t in self._request()}

    def answer_shapes(self, shape: ConvShape, need_input_grad: bool = False) -> dict[str, Shape]:
        """The answer's tensor shapes for a call of geometry ``shape``, by name, in order."""
        return {
            t.name: t.shape(shape) for t in self._answer(need_input_grad, _names_replica(shape))
        }

    def request_formats(self, fmt: TensorFormat = FLOAT32) -> dict[str, TensorFormat]:
        """The request's tensor formats, by name, for a call in wire format ``fmt``."""
        return {t.name: t.format(fmt) for t in self._request()}

    def answer_formats(
        self, need_input_grad: bool = False, fmt: TensorFormat = FLOAT32, replica: bool = False
    ) -> dict[str, TensorFormat]:
        """The answer's tensor formats, by name, for a call in wire format ``fmt``."""
        return {t.name: t.format(fmt) for t in self._answer(need_input_grad, replica)}

    def request_headers(
        self, shape: ConvShape, fmt: TensorFormat = FLOAT32
    ) -> list[pb.TensorHeader]:
        """The tensor headers of the request for a call of geometry ``shape`` in wire format
        ``fmt`` (activations in ``fmt``, kernels float32)."""
        return [t.format(fmt).header(t.name, t.shape(shape)) for t in self._request()]

    def answer_headers(
        self, shape: ConvShape, need_input_grad: bool = False, fmt: TensorFormat = FLOAT32
    ) -> list[pb.TensorHeader]:
        """The tensor headers of the answer for a call of geometry ``shape`` in wire format
        ``fmt``."""
        replica = _names_replica(shape)
        return [
            t.format(fmt).header(t.name, t.shape(shape))
            for t in self._answer(need_input_grad, replica)
        ]

    def answer_bytes(
        self, shape: ConvShape, need_input_grad: bool = False, fmt: TensorFormat = FLOAT32
    ) -> int:
        """Tensor bytes of the answer for a call of geometry ``shape`` in wire format ``fmt``."""
        # Summed here, not from headers: an absurd request's answer may not fit a uint64 field.
        replica = _names_replica(shape)
        return sum(
            t.format(fmt).nbytes(t.shape(shape)) for t in self._answer(need_input_grad, replica)
        )


FORWARD = ConvCall(
    "Forward",
    pb.FORWARD,
    (
        TensorRule("x", input_shape, activation=True),
        TensorRule("w", kernel_shape),
        TensorRule("b", bias_shape),
    ),
    (TensorRule("y", map_shape, activation=True),),
)
BACKWARD = ConvCall(
    "Backward",
    pb.BACKWARD,
    (TensorRule("dy", map_shape, activation=True),),
    (
        TensorRule("dw", kernel_shape),
        TensorRule("db", bias_shape),
        TensorRule("dx", input_shape, input_grad_only=True, activation=True),
    ),
)
ECHO = ConvCall("Echo", pb.PHASE_UNSPECIFIED, None, None)
STAGE_FORWARD = ConvCall(
    "StageForward",
    pb.STAGE_FORWARD,
    (
        TensorRule("x", stage_sent_input_shape, activation=True),
        TensorRule("w", stage_kernel_shape),
        TensorRule("b", stage_bias_shape),
        TensorRule("bn", stage_bn_shape),
    ),
    (TensorRule("y", stage_output_shape, activation=True), TensorRule("stats", stage_stats_shape)),
)
STAGE_BACKWARD = ConvCall(
    "StageBackward",
    pb.STAGE_BACKWARD,
    (TensorRule("dy", stage_grad_shape, activation=True),),
    (
        TensorRule("dw", stage_dw_shape),
        TensorRule("db", stage_db_shape),
        TensorRule("dbn", stage_dbn_shape),
        TensorRule("dx", stage_input_shape, input_grad_only=True, activation=True),
        TensorRule("rw", replica_kernel_shape, replica_only=True),
        TensorRule("rb", replica_bias_shape, replica_only=True),
    ),
)
PLACE_KERNELS = ConvCall(
    "PlaceKernels",
    pb.PLACE_KERNELS,
    (
        TensorRule("w", slice_kernel_shape),
        TensorRule("b", slice_bias_shape),
        TensorRule("mw", slice_kernel_shape),
        TensorRule("mb", slice_bias_shape),
        TensorRule("f", slice_head_shape),
        TensorRule("mf", slice_head_shape),
    ),
    (),
)
FETCH_KERNELS = ConvCall(
    "FetchKernels",
    pb.FETCH_KERNELS,
    (),
    (
        TensorRule("w", slice_kernel_shape),
        TensorRule("b", slice_bias_shape),
        TensorRule("mw", slice_kernel_shape),
        TensorRule("mb", slice_bias_shape),
        TensorRule("f", slice_head_shape),
        TensorRule("mf", slice_head_shape),
    ),
)
RESIDENT_STAGE_FORWARD = ConvCall(
    "ResidentStageForward",
    pb.RESIDENT_STAGE_FORWARD,
    (
        TensorRule("x", resident_sent_input_shape, activation=True),
        TensorRule("hw", halo_kernel_shape),
        TensorRule("hb", halo_bias_shape),
        TensorRule("hf", halo_head_shape),
        TensorRule("bn", resident_bn_shape),
    ),
    # z: float32 whatever the wire format (N x classes values: nothing to save)
    (
        TensorRule("y", resident_output_shape, activation=True),
        TensorRule("z", resident_logits_shape),
        TensorRule("stats", resident_stats_shape),
    ),
)
RESIDENT_STAGE_BACKWARD = ConvCall(
    "ResidentStageBackward",
    pb.RESIDENT_STAGE_BACKWARD,
    (
        TensorRule("dy", resident_grad_shape, activation=True),
        TensorRule("dz", resident_logits_shape),
    ),
    (
        TensorRule("ew", edge_kernel_shape),
        TensorRule("eb", edge_bias_shape),
        TensorRule("ef", edge_head_shape),
        TensorRule("dbn", resident_dbn_shape),
        TensorRule("dx", resident_input_shape, input_grad_only=True, activation=True),
        TensorRule("rw", resident_replica_kernel_shape, replica_only=True),
        TensorRule("rb", resident_replica_bias_shape, replica_only=True),
    ),
)
REPLICA_FORWARD = ConvCall(
    "ReplicaForward",
    pb.REPLICA_FORWARD,
    (
        # the images, every node the same: float32, or palette8 where they fit (the client
        # chooses, hetconv.replica.ReplicaBlock.x_format; a header names its format)
        TensorRule("x", input_shape),
        TensorRule("w", kernel_shape),
        TensorRule("b", bias_shape),
    ),
    (),
)


PUT_PART = ConvCall(
    "PutPart", pb.PUT_PART, (TensorRule("p", part_shape, activation=True),), ()
)  # fmt: skip
FETCH_PART = ConvCall(
    "FetchPart", pb.FETCH_PART, (), (TensorRule("p", part_shape, activation=True),)
)  # fmt: skip
#: The whole network split by images (:mod:`hetconv.master.imagesplit`): the request carries
#: every parameter, named as the model names them (float32, in the model's order), then
#: :data:`IMAGES_TENSORS` (the images, palette8 where they fit, and their labels); the answer
#: every parameter's gradient (named and ordered as sent), then :data:`IMAGES_ANSWER`. Their
#: names depend on the model, so the table lists none (:meth:`ConvCall.request_names` is None);
#: :func:`images_step_names` gives them.
IMAGES_STEP = ConvCall("ImagesStep", pb.IMAGES_STEP, None, None)
#: The tensors after the parameters in an ImagesStep request and in its answer.
IMAGES_TENSORS, IMAGES_ANSWER = ("x", "labels"), ("losses", "hits")


#: The ring exchange (:mod:`hetconv.ring`): a chunk of the flat gradient a worker puts into the
#: next rank, or the master's gradient into rank 0 (``p``, float32, one dimension; none with
#: ``abort``).
RING_PART = ConvCall("RingPart", pb.RING_PART, None, ())


def images_step_names(parameters) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(request names, answer names) of an ImagesStep call for a model whose parameter names
    are ``parameters``, in the model's order."""
    names = tuple(parameters)
    return names + IMAGES_TENSORS, names + IMAGES_ANSWER


DESCRIBE = UnaryCall("Describe", pb.DescribeRequest, pb.DeviceDescription)
PROBE = UnaryCall("Probe", pb.ProbeRequest, pb.ProbeResult)

#: The calls that carry tensors, by name.
CONV_CALLS: dict[str, ConvCall] = {
    call.name: call
    for call in (
        FORWARD,
        BACKWARD,
        ECHO,
        STAGE_FORWARD,
        STAGE_BACKWARD,
        PLACE_KERNELS,
        FETCH_KERNELS,
        RESIDENT_STAGE_FORWARD,
        RESIDENT_STAGE_BACKWARD,
        REPLICA_FORWARD,
        PUT_PART,
        FETCH_PART,
        IMAGES_STEP,
        RING_PART,
    )
}
#: The calls that do not.
UNARY_CALLS: dict[str, UnaryCall] = {call.name: call for call in (DESCRIBE, PROBE)}
#: Every RPC of the service, by its name in the proto.
METHODS: dict[str, Method] = {
    **{call.name: call.method for call in UNARY_CALLS.values()},
    **{m.name: m for call in CONV_CALLS.values() for m in (call.stream, call.bundle)},
}

__all__ = [
    "BACKWARD",
    "CONV_CALLS",
    "DESCRIBE",
    "ECHO",
    "FETCH_KERNELS",
    "FETCH_PART",
    "FORWARD",
    "HANDLER_FACTORIES",
    "IMAGES_ANSWER",
    "IMAGES_STEP",
    "IMAGES_TENSORS",
    "METHODS",
    "PLACE_KERNELS",
    "PROBE",
    "PUT_PART",
    "READY",
    "REPLICA_FORWARD",
    "RESIDENT_STAGE_BACKWARD",
    "RESIDENT_STAGE_FORWARD",
    "RING_PART",
    "SERVICE_NAME",
    "STAGE_BACKWARD",
    "STAGE_FORWARD",
    "UNARY_CALLS",
    "ConvCall",
    "Method",
    "ResidentStageShape",
    "SliceShape",
    "StageShape",
    "TensorRule",
    "UnaryCall",
    "bias_shape",
    "call_shape",
    "images_step_names",
    "input_shape",
    "kernel_shape",
    "map_shape",
]
