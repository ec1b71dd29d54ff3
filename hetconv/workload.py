"""What a network's distributed convolutions are and what each call moves on the wire.

* **Shapes.** The network's convolution layers come from its spec (:func:`conv_layers`), by the
  walk :class:`hetconv.model.Model` builds with (:func:`hetconv.model.walk_spec`): the same
  geometry and the same "no input gradient for a first layer" rule.
* **Bytes** (:func:`call_bytes`). A forward call sends ``x`` (N, C, H, W), the worker's kernels
  ``w`` (k, C, kh, kw) and biases ``b`` (k,), and gets ``y`` (N, k, Ho, Wo) back; a backward call
  sends only ``dy`` (N, k, Ho, Wo) (the worker kept ``x`` and ``w``) and gets ``dw``, ``db`` and,
  except for a network's first layer, a full-size ``dx`` part back (the tensors of each call are
  listed once, in :mod:`hetconv.calls`). Activations (``x``, ``y``, ``dy``, ``dx``) travel in
  the run's wire format (float32 by default, or 16-bit: :mod:`hetconv.formats`), kernels and
  their gradients as float32; each direction also carries one
  header (or result) message whose size is computed with the real protobuf messages. The counts
  equal the trace's ``bytes_sent`` / ``bytes_received``. A call whose tensors, both directions
  together, total at most :data:`~hetconv.wire.BUNDLE_BYTES` goes as one message each way
  (cheaper per call); a larger one streams.

  A fused stage call (:func:`stage_call_bytes`, :mod:`hetconv.stages`) moves the kernels
  widened by the stage's halo and the stage's (pooled) output of the owned kernels instead.

Convolution work of a node is its kernels' FLOPs: forward 2·N·Ho·Wo·k·C·kh·kw, the kernel
gradient as much again and the input gradient (when the layer needs it) as much again.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hetconv import calls
from hetconv.backends import ConvShape
from hetconv.conv import ConvSpec
from hetconv.formats import FLOAT32, TensorFormat, answer_dtype
from hetconv.model import CIFAR_INPUT, walk_spec
from hetconv.onnx_import import load_network
from hetconv.proto import worker_pb2 as pb
from hetconv.replica import images_format
from hetconv.resident import edge_rows
from hetconv.stages import StageSpec, ops_to_proto
from hetconv.wire import BUNDLE_BYTES

FLOAT_BYTES = FLOAT32.itemsize
FORWARD, BACKWARD = "forward", "backward"
PHASES = (FORWARD, BACKWARD)

# -- the network's convolutions ------------------------------------------------------------------


@dataclass(frozen=True)
class ConvLayer:
    """One convolution layer at a batch size: what a distributed call of it moves and computes.

    ``shape`` includes the batch (``shape.n``); ``need_input_grad`` is False for a network's first
    layer (nothing consumes that gradient, so the backward call neither computes nor returns it).
    """

    name: str
    shape: ConvShape
    need_input_grad: bool
    #: the channel-local layers after it (:mod:`hetconv.stages`), which a fused mode runs on
    #: the workers; None: a conv or fc follows. Not compared (call_bytes takes it explicitly).
    stage: StageSpec | None = dataclasses.field(default=None, compare=False)
    #: the classes of the final fc its stage feeds directly, which a split head computes on
    #: the nodes (:mod:`hetconv.head`); 0: none. Not compared.
    head: int = dataclasses.field(default=0, compare=False)
    #: as a replicated first block (:mod:`hetconv.replica`): whether its images fit palette8
    #: (normalised 8-bit pixels always do), so a worker's copy travels in a quarter of
    #: float32's bytes.
    images_fit: bool = True
    #: as a replicated block split by images (:mod:`hetconv.split`), one worker's part of it:
    #: (the :class:`~hetconv.split.SplitPlan`, the worker's address); ``shape`` then holds
    #: only that worker's images. None: not split.
    split_of: tuple | None = None
    #: whether it is strided (it runs as the stride-1 convolution of its phases, whose kernels
    #: are a rearranged copy each step: :mod:`hetconv.modetable` keeps them sent). Not compared.
    strided: bool = dataclasses.field(default=False, compare=False)
    #: the convolution its stage output feeds unchanged (:attr:`hetconv.conv.ConvSpec.feeds`),
    #: into which its block may be replicated; None: another layer follows. Not compared.
    feeds: str | None = dataclasses.field(default=None, compare=False)
    #: whether it has a bias parameter (without one, kernels kept on the workers keep a fixed
    #: zero bias: :mod:`hetconv.master.resident`). Not compared.
    bias: bool = dataclasses.field(default=True, compare=False)

    @classmethod
    def from_spec(cls, spec: ConvSpec, batch: int) -> ConvLayer:
        """The layer ``spec`` describes, at ``batch`` images."""
        head = spec.head[1] if spec.head is not None else 0
        strided = spec.phased_from is not None or spec.stride != (1, 1)
        return cls(
            spec.name, spec.shape(batch), spec.need_input_grad, spec.stage, head, spec.images_fit,
            strided=strided, feeds=spec.feeds, bias=spec.bias,
        )  # fmt: skip

    @property
    def kernels(self) -> int:
        return self.shape.k

    @property
    def x_bytes(self) -> int:
        """The layer's input (N, C, H, W), sent whole to every worker with a share."""
        s = self.shape
        return FLOAT_BYTES * s.n * s.c * s.h * s.w

    @property
    def images_format(self) -> TensorFormat:
        """The format its input travels in as a replicated block's images
        (:func:`hetconv.replica.images_format`)."""
        return images_format(calls.input_shape(self.shape), self.images_fit)

    @property
    def images_bytes(self) -> int:
        """Its input on the wire as a replicated block's images (:attr:`images_format`)."""
        return self.images_format.nbytes(calls.input_shape(self.shape))

    @property
    def kernel_bytes(self) -> int:
        """One kernel and its bias: ``w`` (C, kh, kw) plus ``b`` (forward), ``dw`` + ``db``
        (backward)."""
        s = self.shape
        return FLOAT_BYTES * (s.c * s.kh * s.kw + 1)

    @property
    def map_bytes(self) -> int:
        """One kernel's feature maps (N, Ho, Wo): ``y`` forward, ``dy`` backward."""
        ho, wo = self.shape.out_hw
        return FLOAT_BYTES * self.shape.n * ho * wo

    def x_wire_bytes(self, fmt: TensorFormat = FLOAT32) -> int:
        """:attr:`x_bytes` on the wire in format ``fmt`` (``dx`` parts too)."""
        return fmt.nbytes(calls.input_shape(self.shape))

    def map_wire_bytes(self, fmt: TensorFormat = FLOAT32) -> int:
        """:attr:`map_bytes` on the wire in format ``fmt``."""
        ho, wo = self.shape.out_hw
        return fmt.nbytes((self.shape.n, ho, wo))

    @property
    def flops_per_kernel(self) -> float:
        """Forward FLOPs of one kernel (the kernel gradient and input gradient cost as much)."""
        return self.shape.flops_forward / self.shape.k

    def passes(self, phase: str) -> int:
        """Convolutions of forward's size a phase runs: 1 forward, 1 or 2 backward."""
        if phase == FORWARD:
            return 1
        return 2 if self.need_input_grad else 1

    @property
    def step_passes(self) -> int:
        """Forward + backward: 3, or 2 for a first layer (what the probe times)."""
        return self.passes(FORWARD) + self.passes(BACKWARD)


def conv_layers(
    spec: Sequence[Mapping], batch: int, input_shape: tuple[int, int, int] = CIFAR_INPUT
) -> list[ConvLayer]:
    """The convolution layers of a model spec (see :mod:`hetconv.model`) at ``batch`` images.

    Walks the spec with the model's own walk (:func:`hetconv.model.walk_spec`), without
    allocating any weights.

    Raises:
        ValueError: a layer type the model does not know, or shapes that do not fit.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return [
        ConvLayer.from_spec(layer.conv, batch)
        for layer in walk_spec(spec, input_shape)
        if layer.conv is not None
    ]


def network_layers(network: str, batch: int) -> list[ConvLayer]:
    """:func:`conv_layers` of a preset name (``paper-50-500``, ...), a ``.json`` spec file or
    an ``.onnx`` graph (at its own input shape)."""
    named = load_network(network)
    return conv_layers(named.spec, batch, named.input_shape or CIFAR_INPUT)


# -- bytes on the wire ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CallBytes:
    """What one worker call moves, counted as the trace counts it.

    ``sent`` / ``received`` are the request header (or answer result) message's protobuf size
    plus the tensor bytes; ``bundled`` says whether the call went as one message each way.
    """

    sent: int
    received: int
    tensors_sent: int
    tensors_received: int
    bundled: bool

    @property
    def total(self) -> int:
        return self.sent + self.received


def _call_bytes(request: pb.ConvRequest, answer, layer: ConvLayer, step: int) -> CallBytes:
    """What a call moves: ``request`` (its call-specific fields set) with the fields every
    call's header carries, and a result carrying the ``answer`` tensor headers."""
    request.session = (1 << 64) - 1  # fixed64: any non-zero session has the same size
    request.step = step
    request.layer = layer.name
    result = pb.ConvResult(compute_seconds=1.0, receive_seconds=1.0, tensors=answer)
    tensors_sent = sum(t.nbytes for t in request.tensors)
    tensors_received = sum(t.nbytes for t in answer)
    return CallBytes(
        sent=pb.ConvMessage(header=request).ByteSize() + tensors_sent,
        received=pb.ConvMessage(result=result).ByteSize() + tensors_received,
        tensors_sent=tensors_sent,
        tensors_received=tensors_received,
        bundled=tensors_sent + tensors_received <= BUNDLE_BYTES,
    )


@functools.lru_cache(maxsize=65536)
def call_bytes(
    layer: ConvLayer,
    phase: str,
    kernels: int,
    kernel_offset: int = 0,
    step: int = 1000,
    fmt: TensorFormat = FLOAT32,
) -> CallBytes:
    """Bytes of one worker call of ``layer`` computing ``kernels`` kernels from ``kernel_offset``.

    Args:
        phase: ``"forward"`` or ``"backward"``.
        step: the training step the call belongs to; the header carries it as a varint, so it
            changes the count by a byte or two (the default is a typical mid-run step).
        fmt: the wire format of activations (``--wire-format``); kernels are float32 always.

    The header sizes come from the real protobuf messages with the fields
    :class:`~hetconv.master.client.WorkerClient` sets (a 64-bit session, the step, the layer
    name, padding on forward, the kernel offset, ``need_input_grad`` on backward) and the
    worker's result (its two timings and the tensor headers).
    """
    call = {FORWARD: calls.FORWARD, BACKWARD: calls.BACKWARD}.get(phase)
    if call is None:
        raise ValueError(f"phase {phase!r} is not 'forward' or 'backward'")
    s = dataclasses.replace(layer.shape, k=kernels)  # the worker's slice
    request = pb.ConvRequest(
        phase=call.phase, tensors=call.request_headers(s, fmt), answer_dtype=answer_dtype(fmt)
    )
    if call is calls.FORWARD:
        request.padding.extend((s.padding.top, s.padding.bottom, s.padding.left, s.padding.right))
    else:
        request.need_input_grad = layer.need_input_grad
    answer = call.answer_headers(s, layer.need_input_grad, fmt)
    request.kernel_offset = kernel_offset
    return _call_bytes(request, answer, layer, step)


@functools.lru_cache(maxsize=65536)
def stage_call_bytes(
    layer: ConvLayer,
    stage: StageSpec,
    phase: str,
    kernels: int,
    kernel_offset: int = 0,
    step: int = 1000,
    fmt: TensorFormat = FLOAT32,
    training: bool = True,
    replica: ConvLayer | None = None,
) -> CallBytes:
    """Bytes of one fused stage call (:mod:`hetconv.stages`) of ``layer`` for a node owning
    ``kernels`` kernels from ``kernel_offset``: forward sends ``x`` and the kernels widened by
    the stage's halo and gets the stage output of the owned kernels back; backward sends that
    output's gradient over the owned and halo channels and gets ``dw``, ``db`` of the owned
    kernels and (except for a first layer) a ``dx`` part. A stage's batch norms add, forward,
    their weight and bias of the widened slice (and ``training=False``: running mean and
    variance) sent and (training) the owned channels' batch mean and variance back; backward,
    their weight and bias gradients of the owned channels back. Headers as
    :class:`~hetconv.master.client.WorkerClient` sets them (the stage description included).

    ``replica``: the replicated first block (:mod:`hetconv.replica`) whose output is the
    layer's input: forward counts its ReplicaForward (images and the block's kernels out) and
    sends no ``x``; backward answers the block's kernel gradient parts instead of ``dx``.
    """
    call = {FORWARD: calls.STAGE_FORWARD, BACKWARD: calls.STAGE_BACKWARD}.get(phase)
    if call is None:
        raise ValueError(f"phase {phase!r} is not 'forward' or 'backward'")
    own = slice(kernel_offset, kernel_offset + kernels)
    wide = stage.widened(own, layer.kernels)
    grad = stage.grad_range(own, layer.kernels)
    s = dataclasses.replace(layer.shape, k=wide.stop - wide.start)
    shape = calls.StageShape(
        s, kernels, grad.stop - grad.start, stage.output_hw(s.out_hw), stage.batchnorms, training,
        replica.shape if replica is not None else None,
    )  # fmt: skip
    request = pb.ConvRequest(
        phase=call.phase, tensors=call.request_headers(shape, fmt), answer_dtype=answer_dtype(fmt)
    )
    if call is calls.STAGE_FORWARD:
        request.padding.extend((s.padding.top, s.padding.bottom, s.padding.left, s.padding.right))
        request.stage.ops.extend(ops_to_proto(stage))
        request.stage.own_start = own.start - wide.start
        request.stage.own_count = kernels
        request.stage.batchnorm_eval = bool(stage.batchnorms) and not training
    else:
        request.need_input_grad = layer.need_input_grad and replica is None
        request.stage.grad_start = grad.start - wide.start
    answer = call.answer_headers(shape, request.need_input_grad, fmt)
    request.kernel_offset = wide.start
    return _with_replica(request, answer, layer, step, replica, call is calls.STAGE_FORWARD)


def replica_forward_bytes(block: ConvLayer, step: int = 1000) -> CallBytes:
    """Bytes of one ReplicaForward (:mod:`hetconv.replica`): the images and the block's
    kernels and biases out (float32), no tensors back."""
    call, s = calls.REPLICA_FORWARD, block.shape
    headers = call.request_headers(s)
    headers[0] = block.images_format.header(headers[0].name, calls.input_shape(s))
    request = pb.ConvRequest(phase=call.phase, tensors=headers)
    request.padding.extend((s.padding.top, s.padding.bottom, s.padding.left, s.padding.right))
    if block.stage is not None:
        request.stage.ops.extend(ops_to_proto(block.stage))
    request.stage.own_count = s.k
    if block.split_of is not None:  # one worker's images of a split block
        plan, address = block.split_of
        request.split.CopyFrom(plan.request_for(address))
    return _call_bytes(request, [], block, step)


def split_part(block: ConvLayer, plan, address: str) -> ConvLayer:
    """``block`` as worker ``address`` computes it in ``plan`` (a
    :class:`~hetconv.split.SplitPlan`): on its images only."""
    images = plan.images(address)
    shape = dataclasses.replace(block.shape, n=images.stop - images.start)
    return dataclasses.replace(block, shape=shape, split_of=(plan, address))


def _with_replica(request, answer, layer, step, replica, forward: bool) -> CallBytes:
    """A stage call's bytes; with a replicated block, the call names it, and a forward's
    ReplicaForward, made just before it, counts with it (the master's trace adds them)."""
    if replica is None:
        return _call_bytes(request, answer, layer, step)
    request.replica_layer = replica.name
    own = _call_bytes(request, answer, layer, step)
    if not forward:
        return own
    before = replica_forward_bytes(replica, step)
    return CallBytes(
        sent=own.sent + before.sent,
        received=own.received + before.received,
        tensors_sent=own.tensors_sent + before.tensors_sent,
        tensors_received=own.tensors_received + before.tensors_received,
        bundled=own.bundled,
    )


@functools.lru_cache(maxsize=65536)
def resident_call_bytes(
    layer: ConvLayer,
    stage: StageSpec,
    phase: str,
    kernels: int,
    kernel_offset: int = 0,
    step: int = 1000,
    fmt: TensorFormat = FLOAT32,
    replica: ConvLayer | None = None,
    head: int = 0,
    training: bool = True,
) -> CallBytes:
    """Bytes of one resident fused stage call (:mod:`hetconv.master.resident`) of ``layer``
    for a worker holding ``kernels`` kernels from ``kernel_offset``: forward sends ``x`` and the
    halo kernels only and gets the stage output of the owned kernels back; backward sends the
    stage-output gradient as the fused call does and gets the updated edge kernels and (except
    for a first layer) a ``dx`` part. The syncs that bound the replay log are
    :func:`resident_sync_bytes`. ``replica`` as :func:`stage_call_bytes`'s. ``head``: the
    classes of a split head (:mod:`hetconv.head`): the halo's and edges' fc columns travel
    too, and logits and their gradient instead of the stage output and its gradient. A
    stage's batch norms add what :func:`stage_call_bytes` says they add (``training`` as
    there): their parameters stay with the master and travel with each call."""
    call = {FORWARD: calls.RESIDENT_STAGE_FORWARD, BACKWARD: calls.RESIDENT_STAGE_BACKWARD}.get(
        phase
    )
    if call is None:
        raise ValueError(f"phase {phase!r} is not 'forward' or 'backward'")
    own = slice(kernel_offset, kernel_offset + kernels)
    wide = stage.widened(own, layer.kernels)
    grad = stage.grad_range(own, layer.kernels)
    s = dataclasses.replace(layer.shape, k=wide.stop - wide.start)
    stage_shape = calls.StageShape(
        s, kernels, grad.stop - grad.start, stage.output_hw(s.out_hw), stage.batchnorms, training,
        replica.shape if replica is not None else None,
    )  # fmt: skip
    shape = calls.ResidentStageShape(stage_shape, len(edge_rows(kernels, stage.halo)), head)
    request = pb.ConvRequest(
        phase=call.phase, tensors=call.request_headers(shape, fmt), answer_dtype=answer_dtype(fmt)
    )
    request.resident.version = (1 << 32) + step  # a few placements in: as many varint bytes
    if call is calls.RESIDENT_STAGE_FORWARD:
        request.padding.extend((s.padding.top, s.padding.bottom, s.padding.left, s.padding.right))
        request.stage.ops.extend(ops_to_proto(stage))
        request.stage.own_start = own.start - wide.start
        request.stage.own_count = kernels
        request.resident.count = kernels
        request.resident.halo_before = own.start - wide.start
        request.stage.batchnorm_eval = bool(stage.batchnorms) and not training
        request.kernel_offset = wide.start
    else:
        request.need_input_grad = layer.need_input_grad and replica is None
        request.stage.grad_start = grad.start - wide.start
    answer = call.answer_headers(shape, request.need_input_grad, fmt)
    forward = call is calls.RESIDENT_STAGE_FORWARD
    return _with_replica(request, answer, layer, step, replica, forward)


def resident_sync_bytes(layer: ConvLayer, kernels: int, head: int = 0) -> int:
    """Tensor bytes of one sync of a ``kernels``-kernel resident slice (FetchKernels: weights,
    biases and their momentum buffers, float32; with a split head of ``head`` classes, the fc
    columns too); per step it is this over the sync interval."""
    columns = 0
    if head and layer.stage is not None:
        ho, wo = layer.stage.output_hw(layer.shape.out_hw)
        columns = 4 * ho * wo * head
    return 2 * kernels * (layer.kernel_bytes + columns)
