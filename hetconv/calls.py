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
    ResidentStageForward   x, hw, hb, hf    y, as StageForward (own kernels from the worker's
                                            slice), or with a split head z
    ResidentStageBackward  dy, dz       ew, eb, ef: the updated edge kernels, and dx when asked
    ReplicaForward x, w, b          (nothing): the worker keeps the replicated block's output
    PutPart    p                    (nothing): a part of a split block's output or gradient
    FetchPart  (nothing)            p: the gradient part a worker sent a lost one
    Describe   (DescribeRequest -> DeviceDescription)
    Probe      (ProbeRequest -> ProbeResult)

A tensor's shape follows from the call's geometry, a :class:`~hetconv.backends.ConvShape` of the
worker's slice (N images of C x H x W, k kernels of C x kh x kw, padding): ``x`` and ``dx`` are
(N, C, H, W), ``w`` and ``dw`` (k, C, kh, kw), ``b`` and ``db`` (k,), ``y`` and ``dy`` the
feature maps (N, k, Ho, Wo).

A fused stage call (:mod:`hetconv.stages`) has a :class:`StageShape` for geometry instead: its
``conv`` is the widened slice's ConvShape (``x``, ``w``, ``b``, ``dx`` as above), ``y`` is
(N, own, Ho', Wo') and ``dy`` (N, grad, Ho', Wo'), the stage output of the owned kernels and its
gradient over the owned and halo channels; ``dw`` (own, C, kh, kw) and ``db`` (own,). Its
batch norm layers' tensors (all empty in a stage without one): ``bn`` (rows, k), per batch norm
its weight and bias of the widened slice and in evaluation its running mean and variance;
``stats`` (rows, own), per batch norm in training the batch mean and biased variance of the
owned channels (float32: the master's running statistics move by them); ``dbn`` (rows, own),
per batch norm the weight and bias gradients of the owned channels.

Resident calls (:mod:`hetconv.resident`) have a :class:`SliceShape` (PlaceKernels,
FetchKernels: ``w``, ``mw`` (k, C, kh, kw), ``b``, ``mb`` (k,)) or a :class:`ResidentStageShape`
(``hw`` (halo, C, kh, kw) and ``hb`` (halo,): the widened slice's kernels that are not the
worker's own; ``ew`` (edges, C, kh, kw) and ``eb`` (edges,)). With a split head
(:mod:`hetconv.head`) the slice also holds the final fully connected layer's columns of its
channels, ``f`` and ``mf`` (k, P, classes), P the stage output's positions; ``hf`` (halo, P,
classes) and ``ef`` (edges, P, classes) are those of the halo and edge channels; the forward
answers ``z`` (N, classes), the slice's partial logits, instead of ``y`` (then (N, 0, Ho',
Wo')), and the backward sends ``dz`` (N, classes) instead of ``dy``. Without a head ``f``,
``mf``, ``hf``, ``ef`` are (rows, 0, 0) and ``z``, ``dz`` (N, 0): no bytes.

A replicated first block (:mod:`hetconv.replica`): ReplicaForward has a :class:`ConvShape`
(the block's convolution over the images, all its kernels). A stage call that names the
block (``replica_layer``) sends an empty ``x`` (the worker has the input) and its backward
answers, instead of ``dx``, the block's kernel and bias gradient parts ``rw`` (k0, C0, kh0, kw0)
and ``rb`` (k0,), from the geometry's ``replica`` (the block's ConvShape).

A replicated block split by images (:mod:`hetconv.split`): PutPart and FetchPart carry one
part ``p``, whose geometry is its own shape, (count, k0, Ho0', Wo0'): a block output on some
images, or an input-gradient part for them.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from hetconv.backends import ConvShape, Padding
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

Shape = tuple[int, ...]


def input_shape(s: ConvShape) -> Shape:
    """``x``, ``dx``: (N, C, H, W)."""
    return (s.n, s.c, s.h, s.w)


def kernel_shape(s: ConvShape) -> Shape:
    """``w``, ``dw``: (k, C, kh, kw)."""
    return (s.k, s.c, s.kh, s.kw)


def bias_shape(s: ConvShape) -> Shape:
    """``b``, ``db``: (k,)."""
    return (s.k,)


def map_shape(s: ConvShape) -> Shape:
    """``y``, ``dy``: (N, k, Ho, Wo)."""
    return (s.n, s.k, *s.out_hw)


def call_shape(
    x_shape: Sequence[int], w_shape: Sequence[int], padding: tuple[int, int, int, int]
) -> ConvShape:
    """The geometry of a call with input ``x_shape``, kernels ``w_shape`` and ``padding`` (top,
    bottom, left, right) as the master states it: not validated (the worker does that)."""
    n, c, h, w = (int(v) for v in x_shape)
    k, _, kh, kw = (int(v) for v in w_shape)
    top, bottom, left, right = (int(v) for v in padding)
    return ConvShape(n, c, h, w, k, kh, kw, Padding(top, bottom, left, right))


@dataclass(frozen=True)
class StageShape:
    """The geometry of one fused stage call (:mod:`hetconv.stages`).

    Attributes:
        conv: the convolution of the widened kernel slice (halo included).
        own: the kernels the node owns (answers ``y``, ``dw``, ``db`` for).
        grad: the channels of the stage-output gradient backward sends.
        out_hw: the stage output's (Ho', Wo') (after pooling).
        batchnorms: the stage's batch norm layers.
        training: whether they normalise by the batch's statistics (or the running ones).
        replica: the convolution of the replicated block whose output is this layer's input
            (:mod:`hetconv.replica`); None: the input travels.
    """

    conv: ConvShape
    own: int
    grad: int
    out_hw: tuple[int, int]
    batchnorms: int = 0
    training: bool = True
    replica: ConvShape | None = None


def stage_input_shape(s: StageShape) -> Shape:
    return input_shape(s.conv)


def stage_kernel_shape(s: StageShape) -> Shape:
    return kernel_shape(s.conv)


def stage_bias_shape(s: StageShape) -> Shape:
    return bias_shape(s.conv)


def stage_output_shape(s: StageShape) -> Shape:
    """``y``: (N, own, Ho', Wo')."""
    return (s.conv.n, s.own, *s.out_hw)


def stage_grad_shape(s: StageShape) -> Shape:
    """``dy``: (N, grad, Ho', Wo')."""
    return (s.conv.n, s.grad, *s.out_hw)


def stage_bn_shape(s: StageShape) -> Shape:
    """``bn``: (2 or 4 per batch norm, k): weight, bias (evaluation: running mean, var)."""
    return (s.batchnorms * (2 if s.training else 4), s.conv.k)


def stage_stats_shape(s: StageShape) -> Shape:
    """``stats``: (2 per batch norm in training, own): batch mean and biased variance."""
    return (2 * s.batchnorms if s.training else 0, s.own)


def stage_dbn_shape(s: StageShape) -> Shape:
    """``dbn``: (2 per batch norm, own): weight and bias gradients."""
    return (2 * s.batchnorms, s.own)


def stage_sent_input_shape(s: StageShape) -> Shape:
    """``x`` as a stage request sends it: (N, C, H, W), or empty with a replicated block."""
    return (0, 0, 0, 0) if s.replica is not None else input_shape(s.conv)


def replica_kernel_shape(s: StageShape) -> Shape:
    """``rw``: the replicated block's kernels (k0, C0, kh0, kw0)."""
    if s.replica is None:
        raise ValueError("rw needs the replicated block's geometry")
    return kernel_shape(s.replica)


def replica_bias_shape(s: StageShape) -> Shape:
    """``rb``: (k0,)."""
    if s.replica is None:
        raise ValueError("rb needs the replicated block's geometry")
    return bias_shape(s.replica)


def stage_dw_shape(s: StageShape) -> Shape:
    """``dw``: (own, C, kh, kw)."""
    return (s.own, s.conv.c, s.conv.kh, s.conv.kw)


def stage_db_shape(s: StageShape) -> Shape:
    """``db``: (own,)."""
    return (s.own,)


@dataclass(frozen=True)
class SliceShape:
    """A resident kernel slice: ``k`` kernels of C x kh x kw; with a split head, the final fc's
    columns of its channels: ``positions`` (the stage output's Ho' * Wo') by ``classes``."""

    k: int
    c: int
    kh: int
    kw: int
    positions: int = 0
    classes: int = 0


def slice_kernel_shape(s: SliceShape) -> Shape:
    """``w``, ``mw``: (k, C, kh, kw)."""
    return (s.k, s.c, s.kh, s.kw)


def slice_bias_shape(s: SliceShape) -> Shape:
    """``b``, ``mb``: (k,)."""
    return (s.k,)


def head_rows_shape(rows: int, positions: int, classes: int) -> Shape:
    """A split head's fc columns of ``rows`` channels: (rows, P, classes), or (rows, 0, 0)
    without a head (``classes`` 0)."""
    return (rows, positions, classes) if classes else (rows, 0, 0)


def slice_head_shape(s: SliceShape) -> Shape:
    """``f``, ``mf``: (k, P, classes), or (k, 0, 0) without a head."""
    return head_rows_shape(s.k, s.positions, s.classes)


@dataclass(frozen=True)
class ResidentStageShape:
    """A resident stage call: the stage geometry, how many edge kernels come back and the
    split head's classes (0: none)."""

    stage: StageShape
    edges: int
    classes: int = 0

    @property
    def positions(self) -> int:
        """The stage output's positions per channel, Ho' * Wo'."""
        return self.stage.out_hw[0] * self.stage.out_hw[1]

    @property
    def halo(self) -> int:
        """Kernels of the widened slice that are not the worker's own (sent as hw, hb)."""
        return self.stage.conv.k - self.stage.own


def resident_input_shape(s: ResidentStageShape) -> Shape:
    return input_shape(s.stage.conv)


def resident_sent_input_shape(s: ResidentStageShape) -> Shape:
    return stage_sent_input_shape(s.stage)


def resident_replica_kernel_shape(s: ResidentStageShape) -> Shape:
    return replica_kernel_shape(s.stage)


def resident_replica_bias_shape(s: ResidentStageShape) -> Shape:
    return replica_bias_shape(s.stage)


def halo_kernel_shape(s: ResidentStageShape) -> Shape:
    """``hw``: (halo, C, kh, kw)."""
    c = s.stage.conv
    return (s.halo, c.c, c.kh, c.kw)


def halo_bias_shape(s: ResidentStageShape) -> Shape:
    """``hb``: (halo,)."""
    return (s.halo,)


def halo_head_shape(s: ResidentStageShape) -> Shape:
    """``hf``: (halo, P, classes), or (halo, 0, 0) without a head."""
    return head_rows_shape(s.halo, s.positions, s.classes)


def resident_output_shape(s: ResidentStageShape) -> Shape:
    """``y``: (N, own, Ho', Wo'); with a split head (N, 0, Ho', Wo')."""
    n, own, *hw = stage_output_shape(s.stage)
    return (n, 0 if s.classes else own, *hw)


def resident_logits_shape(s: ResidentStageShape) -> Shape:
    """``z``, ``dz``: (N, classes), or (N, 0) without a head."""
    return (s.stage.conv.n, s.classes)


def resident_grad_shape(s: ResidentStageShape) -> Shape:
    """``dy``: (N, grad, Ho', Wo'); with a split head (N, 0, Ho', Wo')."""
    n, grad, *hw = stage_grad_shape(s.stage)
    return (n, 0 if s.classes else grad, *hw)


def edge_kernel_shape(s: ResidentStageShape) -> Shape:
    """``ew``: (edges, C, kh, kw)."""
    c = s.stage.conv
    return (s.edges, c.c, c.kh, c.kw)


def edge_bias_shape(s: ResidentStageShape) -> Shape:
    """``eb``: (edges,)."""
    return (s.edges,)


def edge_head_shape(s: ResidentStageShape) -> Shape:
    """``ef``: (edges, P, classes), or (edges, 0, 0) without a head."""
    return head_rows_shape(s.edges, s.positions, s.classes)


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
    ),
    # z: float32 whatever the wire format (N x classes values: nothing to save)
    (
        TensorRule("y", resident_output_shape, activation=True),
        TensorRule("z", resident_logits_shape),
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


def part_shape(s: Sequence[int]) -> Shape:
    """``p``: a split block's part, whose geometry is its shape."""
    return tuple(int(v) for v in s)


PUT_PART = ConvCall(
    "PutPart", pb.PUT_PART, (TensorRule("p", part_shape, activation=True),), ()
)  # fmt: skip
FETCH_PART = ConvCall(
    "FetchPart", pb.FETCH_PART, (), (TensorRule("p", part_shape, activation=True),)
)  # fmt: skip
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
    "METHODS",
    "PLACE_KERNELS",
    "PROBE",
    "PUT_PART",
    "READY",
    "REPLICA_FORWARD",
    "RESIDENT_STAGE_BACKWARD",
    "RESIDENT_STAGE_FORWARD",
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
    "input_shape",
    "kernel_shape",
    "map_shape",
]
