"""The gRPC service a worker runs: convolutions for a slice of a layer's kernels.

A worker never sees the model, except where the whole network is split by images (ImagesStep,
:mod:`hetconv.worker.imagesplit`). Each Forward call brings a layer's inputs and a kernel slice;
the worker returns those feature maps and keeps the inputs and kernels for the Backward call of
the same session, layer, kernel offset and step, which then only has to bring the
output-gradient slice. The kernel offset is part of the key because one worker process may serve
two slices of a layer in one step: a master that names it under two addresses (``127.0.0.1:P``
and ``localhost:P``) sees two workers. Describe returns an id drawn at random when the service
starts, so such a master can tell. Every
request is validated before any work is done; a bad one is refused with a message naming what
was wrong and the status its error's type carries (INVALID_ARGUMENT for most, see
:mod:`hetconv.errors`), and the worker goes on serving. Which tensors each call carries, and
every RPC's codec, come from :mod:`hetconv.calls`.

Request tensors may come in any format the worker knows (each header names its own); answers
carry activations (``y``, ``dx``) in the format the request's ``answer_dtype`` asks for and
kernel gradients as float32 (:mod:`hetconv.formats`). Echo answers each tensor in the format
it came in. A format the worker does not know is refused with INVALID_ARGUMENT naming it.

What a worker holds is bounded as a whole (:mod:`hetconv.worker.budget`): every call reserves
its bytes from the header before any tensor is allocated and releases them when it ends, the
saved forward states, resident slices and the parts peers put share the same budget, and
calls in flight are bounded in number. A call
that waits on its client for ``idle_timeout`` seconds is ended (:mod:`hetconv.worker.idle`).
FetchPart, a call that only waits for a part, takes no call slot: waiting calls have a bound
of their own, so they never starve the calls that compute. Health says NOT_SERVING while every
call slot is taken (one more call would be refused) and SERVING again once one comes back. The
handler pool is larger than the calls in flight and those waiting, so health checks and
Describe are answered while every call slot is taken; convolutions run one at a time on one
device thread, so the backend's scratch buffers exist once, and are trimmed after a call that
grew them.

The calls of each feature (fused stages, resident kernels, the replicated and split block) are
served by handlers built on one :class:`~hetconv.worker.context.WorkerContext`: what they read,
run on the device and keep goes through it, never through the service.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hetconv import __version__
from hetconv.backends import Backend, conv_shape
from hetconv.calls import (
    BACKWARD,
    DESCRIBE,
    ECHO,
    FETCH_PART,
    FORWARD,
    IMAGES_STEP,
    METHODS,
    PROBE,
    PUT_PART,
    REPLICA_FORWARD,
    RING_PART,
    SERVICE_NAME,
    STAGE_BACKWARD,
    STAGE_FORWARD,
    ConvCall,
    input_shape,
    map_shape,
)
from hetconv.errors import InvalidCall, MissingForward, WireError
from hetconv.formats import FLOAT32, answer_format, format_of
from hetconv.proto import worker_pb2 as pb
from hetconv.wire import Bundle, chunks, encode_tensors, server_options
from hetconv.worker.activity import Activity
from hetconv.worker.auth import WorkerSecurity
from hetconv.worker.budget import MemoryBudget, OverBudget
from hetconv.worker.config import SPARE_THREADS, WorkerConfig
from hetconv.worker.context import (
    Answer,
    DeviceThread,
    Received,
    WorkerContext,
    answer,
    caller_alive,
)
from hetconv.worker.idle import CallEnded, IdleWatch, Watched
from hetconv.worker.imagesplit import ImagesCalls
from hetconv.worker.overlap import Streamed
from hetconv.worker.peers import reach_peers
from hetconv.worker.replica import ReplicaCalls
from hetconv.worker.requests import RequestReader, request_padding
from hetconv.worker.resident import ResidentCalls
from hetconv.worker.ring import RingCalls
from hetconv.worker.split import SplitCalls
from hetconv.worker.stages import StageCalls

#: What a call's core returns: the answer's tensors, compute and receive seconds.
_Core = Callable[[Iterator], tuple[Answer, float, float]]


#: Describe's trailing metadata key: what the memory budget holds (:class:`Holding`).
MEMORY_METADATA = "hetconv-memory"


@dataclass
class _Saved:
    """What a Forward call leaves for its Backward call."""

    step: int
    x: np.ndarray
    w: np.ndarray
    padding: tuple[int, int, int, int]


class ConvWorkerService:
    """The handlers of ``hetconv.v1.ConvWorker`` on one backend.

    Args:
        backend: the device the convolutions run on.
        config: limits and defaults.
    """

    def __init__(self, backend: Backend, config: WorkerConfig | None = None):
        self.backend = backend
        self.config = config or WorkerConfig()
        # The backend's scratch buffers kept between calls: its bound and as much again for
        # the reordered kernels the bound leaves out, a quarter of the budget at most (held for
        # good, so counted in it); a call that grows them beyond is trimmed after. Trimmed
        # after every call, the next call faults its buffers in afresh: at paper-500-1500
        # batch 64 that cost a worker's backward 0.3-0.6 s of its 2.3 s (one thread).
        scratch_keep = min(
            2 * int(getattr(backend, "scratch_bytes", 0)), self.config.memory_bytes // 4
        )
        # calls in flight, and what each Forward leaves for its Backward under
        # (session, (layer, kernel offset)), all in one byte budget
        self.budget = MemoryBudget(
            self.config.memory_bytes,
            self.config.sessions,
            self.config.max_calls,
            reserved_bytes=scratch_keep,
        )
        self.idle = IdleWatch(self.config.idle_timeout)
        # One convolution at a time, always on this one thread: per-thread scratch exists once.
        self.device = DeviceThread(backend, scratch_keep)
        self.requests = 0  # conv requests answered successfully
        self.activity = Activity()  # the same, with bytes and sessions, since the last look
        self.instance_id = 1 + secrets.randbelow((1 << 64) - 1)  # never 0 (0: not said)
        self.sum_port = 0  # where ring peers put batch norm's sums (start_server opens it)
        # An ImagesStep's passes on a device backend are held in its memory, not the host's.
        device_bytes = (backend.memory_limit or backend.describe().memory_bytes
                        if backend.on_device else None)  # fmt: skip
        self.reader = RequestReader(
            self.config.max_request_bytes, self.budget, self.activity, device_bytes
        )
        # What the feature handlers use of the worker: every request they read goes through
        # _receive (so a service that wraps it sees every call's request).
        self.context = WorkerContext(backend, self.config, self.budget, self.device, self._receive)
        self.context.replicas = ReplicaCalls(self.context)  # a replicated block (hetconv.replica)
        self.context.split = SplitCalls(self.context)  # the same split by images (hetconv.split)
        self.context.ring = RingCalls(self.context)  # the ring exchange (hetconv.ring)

    @contextmanager
    def _in_flight(self, name: str, context, waits: bool = False) -> Iterator[Watched]:
        """A call in flight: counted and metered by the budget, watched for idling. A call
        over the budget's limit on calls is refused here (RESOURCE_EXHAUSTED). ``waits``: a
        call that only waits, counted among the waiting calls instead of taking a slot."""
        with ExitStack() as stack:
            try:
                memory = stack.enter_context(self.budget.call(name, waits=waits))
            except OverBudget as e:
                context.abort(e.status, f"{name}: {e}")
            # a wait on other nodes ends with the call, idle ones by the watch (worker/split.py)
            memory.watched = stack.enter_context(self.idle.call(context, name))
            yield memory.watched

    def close(self) -> None:
        """Stop the idle watch and the device thread (after the server has stopped)."""
        self.idle.stop()
        self.device.close()
        self.context.split.close()
        self.context.ring.close()

    # -- unary calls ------------------------------------------------------------------------

    def describe(self, request: pb.DescribeRequest, context) -> pb.DeviceDescription:
        info = self.backend.describe()
        # What the memory budget holds, as trailing metadata (the message's fields stay as
        # they are): budget=...,in_flight=...,...,idle_ended=N,scratch_trimmed=N
        memory = self.budget.holding().as_metadata()
        extra = (
            f"idle_ended={self.idle.ended},scratch_trimmed={self.device.trimmed},"
            f"device_dropped={self.device.dropped},sum_frames={self.context.ring.sum_frames}"
        )
        context.set_trailing_metadata(((MEMORY_METADATA, f"{memory},{extra}"),))
        answer = pb.DeviceDescription(
            backend=info.backend,
            kind=info.kind,
            name=info.name,
            memory_bytes=info.memory_bytes,
            cores=info.cores,
            hetconv_version=__version__,
            max_request_bytes=self.config.max_request_bytes,
            instance_id=self.instance_id,
            sum_port=self.sum_port,
        )
        if request.peers:  # the peers of a split block this worker cannot reach (hetconv.split)
            split = self.context.split
            try:
                unreachable = reach_peers(
                    request.peers, split.token, request.peer_timeout, tls=split.tls
                )
            except InvalidCall as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Describe: {e}")
            answer.unreachable.extend(unreachable)
            answer.unreachable_why.extend(unreachable.values())
        return answer

    def probe(self, request: pb.ProbeRequest, context) -> pb.ProbeResult:
        try:
            if len(request.padding) != 4:
                raise ValueError(f"padding must have 4 sides, got {list(request.padding)}")
            shape = conv_shape(
                (request.n, request.c, request.h, request.w),
                (request.k, request.c, request.kh, request.kw),
                tuple(int(v) for v in request.padding),
            )
            # Input and feature maps, about three times over (the probe's working set).
            needed = 3 * (FLOAT32.nbytes(input_shape(shape)) + FLOAT32.nbytes(map_shape(shape)))
            if needed > self.config.max_request_bytes:
                raise ValueError(f"probe shape {shape} needs more memory than this worker allows")
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"probe: {e}")
        repeats = request.repeats or self.config.probe_repeats
        if repeats > 20:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"probe: {repeats} repeats, max 20")
        with self._in_flight("Probe", context):
            try:
                self.budget.current().reserve(needed, f"a probe of {shape}")
            except OverBudget as e:
                context.abort(e.status, f"probe: {e}")
            seconds = self.device.run(
                lambda: self.backend.time_step(shape, repeats, request.with_grad_input),
                caller_alive(self.budget),
            )
        passes = 3 if request.with_grad_input else 2
        return pb.ProbeResult(
            seconds=seconds, gflops=passes * shape.flops_forward / max(seconds, 1e-12) / 1e9
        )

    # -- streaming calls --------------------------------------------------------------------

    def _receive(self, messages: Iterator, call: ConvCall, progress=None) -> Received:
        """Read and check a call's request (:class:`~hetconv.worker.requests.RequestReader`):
        every call's, the feature handlers' too, comes through here."""
        return self.reader.receive(messages, call, progress)

    @staticmethod
    def _result(tensors: Answer, compute: float, receive: float):
        out = encode_tensors([(name, a) for name, a, _ in tensors], [f for *_, f in tensors])
        result = pb.ConvResult(
            compute_seconds=compute, receive_seconds=receive, tensors=out.headers
        )
        return pb.ConvMessage(result=result), out.segments

    def _run(self, call: ConvCall, core: _Core, messages: Iterator, context):
        """Run ``core`` on the incoming messages; refuse bad requests with the status their
        error's type carries."""
        try:
            got = core(messages)
            memory = self.budget.current()
            if isinstance(got, Streamed):  # its bytes go as they are computed
                if memory is not None:
                    memory.cover(2 * got.nbytes, f"{call.name}'s answer")
                self.requests += 1
                return got
            tensors, compute, receive = got
            if memory is not None:  # the answer, when _admit could not foresee it
                memory.cover(2 * sum(a.nbytes for _, a, _ in tensors), f"{call.name}'s answer")
        except CallEnded:
            raise  # the call is over already: nothing to answer
        except WireError as e:
            context.abort(e.status, f"{call.name}: {e}")
        except MemoryError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{call.name}: out of memory: {e}")
        except Exception as e:  # a bug, but the caller still gets a named status, not UNKNOWN
            context.abort(grpc.StatusCode.INTERNAL, f"{call.name}: {type(e).__name__}: {e}")
        self.requests += 1
        head, segments = self._result(tensors, compute, receive)
        self.activity.answered(sum(v.nbytes for v in segments))
        return head, segments

    def streamed(self, call: ConvCall, core: _Core):
        """The handler of a streaming call: header and chunks in, header and chunks out."""

        def handler(messages: Iterator, context) -> Iterator:
            with self._in_flight(call.name, context, call is FETCH_PART) as watched:
                try:
                    got = self._run(call, core, watched.messages(messages), context)
                except CallEnded:
                    return  # ended by the idle watch or its caller: nothing more to send
                if isinstance(got, Streamed):
                    stream = self._streaming(call, got, context)
                else:
                    stream = itertools.chain([got[0]], chunks(got[1]))
                for message in stream:
                    with watched.waiting():  # a client that stops reading holds us here
                        yield message

        return handler

    def _streaming(self, call: ConvCall, answer: Streamed, context) -> Iterator:
        """The messages of an answer sent as it is computed; a failure on the way ends the
        call with the status its error's type carries (the header is gone already)."""
        sent = 0
        messages = answer.messages()
        while True:
            try:
                message = next(messages)
            except StopIteration:
                break
            except WireError as e:
                context.abort(e.status, f"{call.name}: {e}")
            except MemoryError as e:
                status = grpc.StatusCode.RESOURCE_EXHAUSTED
                context.abort(status, f"{call.name}: out of memory: {e}")
            except Exception as e:
                context.abort(grpc.StatusCode.INTERNAL, f"{call.name}: {type(e).__name__}: {e}")
            if isinstance(message, memoryview):
                sent += message.nbytes
            yield message
        self.activity.answered(sent)

    def bundled(self, call: ConvCall, core: _Core):
        """The handler of a call whose request and answer are each one ``ConvBundle``."""

        def handler(bundle: Bundle, context) -> Bundle:
            with self._in_flight(call.name, context, call is FETCH_PART):
                try:
                    got = self._run(call, core, iter([bundle]), context)
                except CallEnded as e:  # its caller is gone: the status is for the record
                    context.abort(e.status, f"{call.name}: {e}")
                if isinstance(got, Streamed):  # one message: computed whole, then sent
                    try:
                        tensors, compute, receive = got.collect()
                    except WireError as e:
                        context.abort(e.status, f"{call.name}: {e}")
                    except Exception as e:
                        context.abort(
                            grpc.StatusCode.INTERNAL, f"{call.name}: {type(e).__name__}: {e}"
                        )
                    got = self._result(tensors, compute, receive)
                    self.activity.answered(sum(v.nbytes for v in got[1]))
                return Bundle(*got)

        return handler

    def forward(self, messages: Iterator):
        request, (x, w, b), receive = self._receive(messages, FORWARD)
        padding = request_padding(request)
        start = time.perf_counter()

        def work():
            y = self.backend.conv_forward(x, w, b, padding)
            self.backend.synchronize()
            return y

        y = self.device.run(work, caller_alive(self.budget))
        compute = time.perf_counter() - start
        self._save(request, _Saved(request.step, x, w, padding))
        formats = FORWARD.answer_formats(fmt=answer_format(request.answer_dtype))
        return answer(formats, (y,)), compute, receive

    def backward(self, messages: Iterator):
        request, (dy,), receive = self._receive(messages, BACKWARD)
        saved = self._saved_for(request)
        shape = conv_shape(saved.x.shape, saved.w.shape, saved.padding)
        ((name, expected),) = BACKWARD.request_shapes(shape).items()
        if dy.shape != expected:
            raise InvalidCall(f"{name} has shape {dy.shape}, expected {expected}")
        start = time.perf_counter()

        def work():
            dw, db = self.backend.conv_grad_kernels(saved.x, dy, saved.w.shape[2:], saved.padding)
            out = [dw, db]
            if request.need_input_grad:
                out.append(
                    self.backend.conv_grad_input(dy, saved.w, saved.x.shape[2:], saved.padding)
                )
            self.backend.synchronize()
            return out

        out = self.device.run(work, caller_alive(self.budget))
        # dw, db and, when asked for, dx; dx in the format asked for, dw and db float32
        formats = BACKWARD.answer_formats(
            request.need_input_grad, answer_format(request.answer_dtype)
        )
        return answer(formats, out), time.perf_counter() - start, receive

    def echo(self, messages: Iterator):
        request, arrays, receive = self._receive(messages, ECHO)
        pairs = zip(request.tensors, arrays, strict=True)
        return [(h.name, a, format_of(h)) for h, a in pairs], 0.0, receive  # each as it came

    # -- the forward-input cache ------------------------------------------------------------

    def _save(self, request: pb.ConvRequest, saved: _Saved) -> None:
        """Keep ``saved`` under (session, layer, kernel offset) in the memory budget; what this
        session keeps of the layer from other steps goes (its backward calls are over), so a
        split that changes leaves no stale slices behind."""
        key = (request.layer, request.kernel_offset)

        def stale(other: tuple[str, int], kept: _Saved) -> bool:
            return other[0] == request.layer and kept.step != saved.step

        self.budget.save(request.session, key, saved, replaces=stale)

    def _saved_for(self, request: pb.ConvRequest) -> _Saved:
        layer, offset = request.layer, request.kernel_offset
        saved = self.budget.saved(request.session, (layer, offset))
        if saved is None or saved.step != request.step:
            if saved is not None:
                have = f"step {saved.step}"
            else:
                keys = self.budget.keys(request.session)
                others = sorted(k[1] for k in keys if k[0] == layer and k[1] != offset)
                have = "only kernels from " + ", ".join(map(str, others)) if others else ""
                dropped = self.budget.dropped(request.session, (layer, offset))
                if not others and dropped is not None:
                    raise MissingForward(self.context.dropped_message(request, dropped))
                have = have or "nothing"
            where = f" from kernel {offset}" if offset else ""
            raise MissingForward(
                f"no forward pass of layer {layer!r}{where} at step {request.step} for this "
                f"session (have {have}); send Forward first",
            )
        return saved


def _handlers(service: ConvWorkerService) -> grpc.GenericRpcHandler:
    """Every RPC of :data:`hetconv.calls.METHODS`, each with its codec from there."""
    handlers = {
        DESCRIBE.name: DESCRIBE.method.handler(service.describe),
        PROBE.name: PROBE.method.handler(service.probe),
    }
    cores = {FORWARD: service.forward, BACKWARD: service.backward, ECHO: service.echo}
    context = service.context  # the feature handlers use only it
    stages = StageCalls(context)  # fused stages (hetconv.worker.stages)
    cores.update({STAGE_FORWARD: stages.forward, STAGE_BACKWARD: stages.backward})
    cores.update(ResidentCalls(context).cores())  # resident kernels (hetconv.worker.resident)
    cores[REPLICA_FORWARD] = context.replicas.forward
    cores.update({PUT_PART: context.split.put, FETCH_PART: context.split.fetch})
    cores[IMAGES_STEP] = ImagesCalls(context).step  # the whole network split by images
    cores[RING_PART] = context.ring.put  # its ring exchange (hetconv.ring)
    for call, core in cores.items():
        handlers[call.stream.name] = call.stream.handler(service.streamed(call, core))
        handlers[call.bundle.name] = call.bundle.handler(service.bundled(call, core))
    if handlers.keys() != METHODS.keys():  # a call added to the table but not served here
        raise RuntimeError(f"RPCs without a handler: {sorted(METHODS.keys() - handlers.keys())}")
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def start_server(
    service: ConvWorkerService,
    listen: str = "127.0.0.1:0",
    security: WorkerSecurity | None = None,
    sum_port: int = 0,
) -> tuple[grpc.Server, str]:
    """Start serving ``service`` (and grpc.health.v1) on ``listen``; returns (server, address).

    A port of 0 picks a free one; the address returned names the port bound. The ring's sum
    port (:mod:`.summesh`) opens on the same host, on ``sum_port`` (0: a free one).

    Args:
        security: a token every call must carry (health checks too) and TLS credentials;
            None: plain gRPC, anyone who can connect may call.

    Raises:
        OSError: the address cannot be bound.
    """
    security = security or WorkerSecurity()
    # a split block's peers are reached with this worker's own token (hetconv.split)
    service.context.split.use(security.token, tls=security.tls_cert is not None)
    service.context.ring.use(security.token, tls=security.tls_cert is not None)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=service.config.threads),
        # The token check runs before any handler, for every method of every service here.
        interceptors=security.interceptors(),
        # No SO_REUSEPORT: a second worker on a serving port must fail, not silently share it
        # (the kernel would split connections, and a Backward could miss its Forward's worker).
        options=[
            *server_options(service.config.streams_per_connection),
            ("grpc.so_reuseport", 0),
        ],
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

    def slots(full: bool) -> None:  # NOT_SERVING while no call could be taken
        status = health_pb2.HealthCheckResponse
        for name in ("", SERVICE_NAME):
            health_servicer.set(name, status.NOT_SERVING if full else status.SERVING)

    slots(False)
    service.budget.on_slots = slots
    host = listen.rsplit(":", 1)[0]
    try:  # the ring's parts (summesh)
        service.sum_port = service.context.ring.listen(host, sum_port)
    except OSError as e:
        server.stop(0)
        raise OSError(f"cannot open the sum port {sum_port} on {host}: {e.strerror or e}") from e
    service.health = health_servicer  # so shutdown can report NOT_SERVING first
    return server, f"{host}:{port}"


__all__ = ["SPARE_THREADS", "ConvWorkerService", "WorkerConfig", "start_server"]
