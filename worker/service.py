"""The gRPC service a worker runs: convolutions for a slice of a layer's kernels.

A worker never sees the model. Each Forward call brings a layer's inputs and a kernel slice; the
worker returns those feature maps and keeps the inputs and kernels for the Backward call of the
same session, layer and step, which then only has to bring the output-gradient slice. Every
request is validated before any work is done; a bad one gets INVALID_ARGUMENT naming what was
wrong and the worker goes on serving.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hetconv import __version__
from hetconv.backends import Backend, conv_shape
from hetconv.proto import worker_pb2 as pb
from hetconv.wire import (
    Bundle,
    TensorReceiver,
    WireError,
    byte_segments,
    check_headers,
    deserialize_bundle,
    deserialize_message,
    receive_stream,
    serialize_bundle,
    serialize_message,
    server_options,
    tensor_header,
    tensor_stream,
)
from hetconv.worker.auth import WorkerSecurity

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ConvWorker"].full_name

_FORWARD_TENSORS = ("x", "w", "b")
_BACKWARD_TENSORS = ("dy",)


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker serves.

    Args:
        max_request_bytes: the largest request (all tensors together) it accepts; bigger ones are
            refused with RESOURCE_EXHAUSTED instead of swapping the machine to death.
        sessions: masters whose forward inputs it keeps at once (least recently used goes).
        probe_repeats: timed runs per probe when the master does not say (best is reported).
        threads: gRPC handler threads (convolutions themselves run one at a time).
    """

    max_request_bytes: int = 2 << 30
    sessions: int = 4
    probe_repeats: int = 2
    threads: int = 8


@dataclass
class _Saved:
    """What a Forward call leaves for its Backward call."""

    step: int
    x: np.ndarray
    w: np.ndarray
    padding: tuple[int, int, int, int]


class _Invalid(Exception):
    """A request the worker refuses; carries the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _padding(request: pb.ConvRequest) -> tuple[int, int, int, int]:
    if len(request.padding) != 4:
        raise _Invalid(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"padding must have 4 sides (top, bottom, left, right), got {list(request.padding)}",
        )
    sides = tuple(int(v) for v in request.padding)
    if min(sides) < 0:
        raise _Invalid(grpc.StatusCode.INVALID_ARGUMENT, f"padding {sides} has a negative side")
    return sides  # type: ignore[return-value]


class ConvWorkerService:
    """The handlers of ``hetconv.v1.ConvWorker`` on one backend.

    Args:
        backend: the device the convolutions run on.
        config: limits and defaults.
    """

    def __init__(self, backend: Backend, config: WorkerConfig | None = None):
        self.backend = backend
        self.config = config or WorkerConfig()
        self._device_lock = threading.Lock()  # one convolution at a time on the device
        self._cache_lock = threading.Lock()
        self._saved: OrderedDict[int, dict[str, _Saved]] = OrderedDict()
        self.requests = 0  # conv requests answered successfully

    # -- unary calls ------------------------------------------------------------------------

    def describe(self, request: pb.DescribeRequest, context) -> pb.DeviceDescription:
        info = self.backend.describe()
        return pb.DeviceDescription(
            backend=info.backend,
            kind=info.kind,
            name=info.name,
            memory_bytes=info.memory_bytes,
            cores=info.cores,
            hetconv_version=__version__,
            max_request_bytes=self.config.max_request_bytes,
        )

    def probe(self, request: pb.ProbeRequest, context) -> pb.ProbeResult:
        try:
            if len(request.padding) != 4:
                raise ValueError(f"padding must have 4 sides, got {list(request.padding)}")
            shape = conv_shape(
                (request.n, request.c, request.h, request.w),
                (request.k, request.c, request.kh, request.kw),
                tuple(int(v) for v in request.padding),
            )
            elements = shape.n * shape.c * shape.h * shape.w + shape.n * shape.k * math.prod(
                shape.out_hw
            )
            if 4 * elements * 3 > self.config.max_request_bytes:
                raise ValueError(f"probe shape {shape} needs more memory than this worker allows")
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"probe: {e}")
        repeats = request.repeats or self.config.probe_repeats
        if repeats > 20:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"probe: {repeats} repeats, max 20")
        with self._device_lock:
            seconds = self.backend.time_step(shape, repeats, request.with_grad_input)
        passes = 3 if request.with_grad_input else 2
        return pb.ProbeResult(
            seconds=seconds, gflops=passes * shape.flops_forward / max(seconds, 1e-12) / 1e9
        )

    # -- streaming calls --------------------------------------------------------------------

    def _receive(
        self, messages: Iterator, phase: int, names: tuple[str, ...] | None
    ) -> tuple[pb.ConvRequest, list[np.ndarray], float]:
        start = time.perf_counter()

        def receiver_for(first: pb.ConvMessage) -> TensorReceiver:
            if first.WhichOneof("kind") != "header":
                raise WireError(f"stream started with {first.WhichOneof('kind')}, not a header")
            request = first.header
            if request.phase != phase:
                raise WireError(
                    f"request phase {pb.Phase.Name(request.phase) if request.phase in pb.Phase.values() else request.phase} "  # noqa: E501
                    f"sent to the {pb.Phase.Name(phase)} call"
                )
            expected = names if names is not None else [h.name for h in request.tensors]
            try:
                shapes = check_headers(request.tensors, expected, self.config.max_request_bytes)
            except WireError as e:
                if "limit of this worker" in str(e):
                    raise _Invalid(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
                raise
            if names is not None:
                self._check_shapes(request, shapes)
            return TensorReceiver(shapes)

        first, arrays = receive_stream(messages, receiver_for)
        return first.header, arrays, time.perf_counter() - start

    def _check_shapes(self, request: pb.ConvRequest, shapes: list[tuple[int, ...]]) -> None:
        if request.phase == pb.FORWARD:
            _padding(request)
            x, w, b = shapes
            if len(x) != 4 or len(w) != 4:
                raise WireError(f"x {x} and w {w} must both have 4 dimensions (NCHW, KCHW)")
            if b != (w[0],):
                raise WireError(f"b has shape {b}, expected ({w[0]},) for {w[0]} kernels")
            try:
                shape = conv_shape(x, w, tuple(request.padding))
            except ValueError as e:
                raise WireError(str(e)) from None
            # The request's size is bounded on arrival; what it implies must be too: a few bytes
            # with a huge padding would otherwise ask for gigabytes of output.
            ho, wo = shape.out_hw
            answer = 4 * shape.n * shape.k * ho * wo
            if answer + 4 * math.prod(x) > self.config.max_request_bytes:
                raise _Invalid(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the feature maps would hold {answer} bytes: beyond this worker's limit "
                    f"of {self.config.max_request_bytes} bytes per request",
                )
        elif len(shapes[0]) != 4:
            raise WireError(f"dy has shape {shapes[0]}, expected 4 dimensions (N, k, Ho, Wo)")

    @staticmethod
    def _result(tensors: list[tuple[str, np.ndarray]], compute: float, receive: float):
        result = pb.ConvResult(
            compute_seconds=compute,
            receive_seconds=receive,
            tensors=[tensor_header(name, a) for name, a in tensors],
        )
        return pb.ConvMessage(result=result), [a for _, a in tensors]

    def _run(self, call: str, core, messages: Iterator, context):
        """Run ``core`` on the incoming messages; refuse bad requests with a named status."""
        try:
            tensors, compute, receive = core(messages)
        except WireError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{call}: {e}")
        except _Invalid as e:
            context.abort(e.code, f"{call}: {e}")
        except MemoryError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{call}: out of memory: {e}")
        except Exception as e:  # a bug, but the caller still gets a named status, not UNKNOWN
            context.abort(grpc.StatusCode.INTERNAL, f"{call}: {type(e).__name__}: {e}")
        self.requests += 1
        return self._result(tensors, compute, receive)

    def streamed(self, call: str, core):
        """The handler of a streaming call: header and chunks in, header and chunks out."""

        def handler(messages: Iterator, context) -> Iterator:
            head, arrays = self._run(call, core, messages, context)
            yield from tensor_stream(head, arrays)

        return handler

    def bundled(self, call: str, core):
        """The handler of a call whose request and answer are each one ``ConvBundle``."""

        def handler(bundle: Bundle, context) -> Bundle:
            head, arrays = self._run(call, core, iter([bundle]), context)
            return Bundle(head, [v for a in arrays for v in byte_segments(a)])

        return handler

    def forward(self, messages: Iterator):
        request, (x, w, b), receive = self._receive(messages, pb.FORWARD, _FORWARD_TENSORS)
        padding = _padding(request)
        start = time.perf_counter()
        with self._device_lock:
            y = self.backend.conv_forward(x, w, b, padding)
            self.backend.synchronize()
        compute = time.perf_counter() - start
        self._save(request, _Saved(request.step, x, w, padding))
        return [("y", y)], compute, receive

    def backward(self, messages: Iterator):
        request, (dy,), receive = self._receive(messages, pb.BACKWARD, _BACKWARD_TENSORS)
        saved = self._saved_for(request)
        ho, wo = conv_shape(saved.x.shape, saved.w.shape, saved.padding).out_hw
        expected = (saved.x.shape[0], saved.w.shape[0], ho, wo)
        if dy.shape != expected:
            raise WireError(f"dy has shape {dy.shape}, expected {expected}")
        start = time.perf_counter()
        with self._device_lock:
            dw, db = self.backend.conv_grad_kernels(saved.x, dy, saved.w.shape[2:], saved.padding)
            out = [("dw", dw), ("db", db)]
            if request.need_input_grad:
                dx = self.backend.conv_grad_input(dy, saved.w, saved.x.shape[2:], saved.padding)
                out.append(("dx", dx))
            self.backend.synchronize()
        return out, time.perf_counter() - start, receive

    def echo(self, messages: Iterator):
        request, arrays, receive = self._receive(messages, pb.PHASE_UNSPECIFIED, None)
        names = [h.name for h in request.tensors]
        return list(zip(names, arrays, strict=True)), 0.0, receive

    # -- the forward-input cache ------------------------------------------------------------

    def _save(self, request: pb.ConvRequest, saved: _Saved) -> None:
        with self._cache_lock:
            layers = self._saved.setdefault(request.session, {})
            layers[request.layer] = saved
            self._saved.move_to_end(request.session)
            while len(self._saved) > self.config.sessions:
                self._saved.popitem(last=False)

    def _saved_for(self, request: pb.ConvRequest) -> _Saved:
        with self._cache_lock:
            saved = self._saved.get(request.session, {}).get(request.layer)
        if saved is None or saved.step != request.step:
            have = f"step {saved.step}" if saved else "nothing"
            raise _Invalid(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no forward pass of layer {request.layer!r} at step {request.step} for this "
                f"session (have {have}); send Forward first",
            )
        return saved


def _handlers(service: ConvWorkerService) -> grpc.GenericRpcHandler:
    def stream(fn):
        return grpc.stream_stream_rpc_method_handler(
            fn, request_deserializer=deserialize_message, response_serializer=serialize_message
        )

    def bundle(fn):
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=deserialize_bundle, response_serializer=serialize_bundle
        )

    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Describe": grpc.unary_unary_rpc_method_handler(
                service.describe,
                request_deserializer=pb.DescribeRequest.FromString,
                response_serializer=pb.DeviceDescription.SerializeToString,
            ),
            "Probe": grpc.unary_unary_rpc_method_handler(
                service.probe,
                request_deserializer=pb.ProbeRequest.FromString,
                response_serializer=pb.ProbeResult.SerializeToString,
            ),
            "Forward": stream(service.streamed("Forward", service.forward)),
            "Backward": stream(service.streamed("Backward", service.backward)),
            "Echo": stream(service.streamed("Echo", service.echo)),
            "ForwardBundle": bundle(service.bundled("Forward", service.forward)),
            "BackwardBundle": bundle(service.bundled("Backward", service.backward)),
            "EchoBundle": bundle(service.bundled("Echo", service.echo)),
        },
    )


def start_server(
    service: ConvWorkerService,
    listen: str = "127.0.0.1:0",
    security: WorkerSecurity | None = None,
) -> tuple[grpc.Server, str]:
    """Start serving ``service`` (and grpc.health.v1) on ``listen``; returns (server, address).

    A port of 0 picks a free one; the address returned names the port bound.

    Args:
        security: a token every call must carry (health checks too) and TLS credentials;
            None: plain gRPC, anyone who can connect may call.

    Raises:
        OSError: the address cannot be bound.
    """
    security = security or WorkerSecurity()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=service.config.threads),
        # The token check runs before any handler, for every method of every service here.
        interceptors=security.interceptors(),
        # No SO_REUSEPORT: a second worker on a serving port must fail, not silently share it
        # (the kernel would split connections, and a Backward could miss its Forward's worker).
        options=[*server_options(), ("grpc.so_reuseport", 0)],
    )
    server.add_generic_rpc_handlers((_handlers(service),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    credentials = security.server_credentials()
    try:
        if credentials is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        if credentials is not None and not security.credentials_usable():
            raise ValueError(
                "TLS: the private key (--tls-key) does not belong to the certificate "
                "(--tls-cert), or one of them is not a valid key or certificate"
            )
        raise OSError(
            f"cannot listen on {listen}: the port is in use or the address is not this machine's"
        )
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    host = listen.rsplit(":", 1)[0]
    service.health = health_servicer  # so shutdown can report NOT_SERVING first
    return server, f"{host}:{port}"


__all__ = ["ConvWorkerService", "WorkerConfig", "start_server"]
