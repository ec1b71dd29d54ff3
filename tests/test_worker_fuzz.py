"""Fuzzing a real ``hetconv worker`` process with generated malformed requests (hypothesis).

One worker process (``LocalWorkers(1)``) serves the whole module; a second, started with
``--max-request-mib 1``, takes the oversized requests. Requests are built here as raw bytes
(``request_serializer`` is the identity), so any rule of ``protos/hetconv/proto/worker.proto``
can be broken, through both the streaming calls (Forward/Backward/Echo) and the one-message
calls (ForwardBundle/BackwardBundle/EchoBundle).

The contract under test: every bad request gets INVALID_ARGUMENT, FAILED_PRECONDITION or
RESOURCE_EXHAUSTED with a non-empty message, and the worker goes on serving correctly. UNKNOWN
would mean an exception escaped the worker's validation; INTERNAL, that gRPC itself gave up on
the request. (``tests/test_worker_process.py`` holds the hand-written cases, one per rule; the
properties here are their generalisation, not copies.)

Non-finite inputs (NaN, +-Inf) are valid float32: the worker computes them like any other
values and answers OK with the IEEE result (the master's loss check catches a diverging run).
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test
from threadpoolctl import threadpool_limits

from hetconv import wire
from hetconv.backends import get_backend
from hetconv.calls import READY, SERVICE_NAME
from hetconv.formats import FORMATS, IMAGE_FORMATS
from hetconv.master.client import WorkerClient
from hetconv.master.launch import LocalWorkers, stop_processes
from hetconv.proto import worker_pb2 as pb
from hetconv.security import TOKEN_ENV
from hetconv.worker.service import WorkerConfig

TIMEOUT = 20.0  # seconds for any single call; a hang fails instead of stalling
OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
#: The statuses a refused request may get.
CLEAR = frozenset({INVALID, PRECONDITION, EXHAUSTED})
CALLS = ("Forward", "Backward", "Echo")
TRANSPORTS = ("stream", "bundle")
#: The limit of the second worker, ``--max-request-mib 1``.
LIMITED_BYTES = 1 << 20
#: How much the worker's resident memory may grow over the whole module (after a warm-up).
RSS_GROWTH_BOUND = 32 << 20

FUZZ = settings(
    max_examples=120,
    deadline=None,  # a loopback call on a loaded 2-core machine can take 100 ms
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_session_ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 24)


def fresh_session() -> int:
    """A session id no earlier request used (hypothesis replays its own ``random`` seeds)."""
    return next(_session_ids) % (1 << 64)


def reference(operation: str, *args):
    """``get_backend('cpu').<operation>(*args)`` here, on one BLAS thread as the worker runs
    (the same summation order: the comparison tests the wire, not float reassociation).
    NaN and Inf inputs compute quietly, as in the worker."""
    with threadpool_limits(limits=1), np.errstate(invalid="ignore", over="ignore"):
        return getattr(get_backend("cpu"), operation)(*args)


def rss_bytes(pid: int) -> int | None:
    """Resident memory of process ``pid`` (Linux ``/proc``), None where that is unknown."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024  # the figure is in kB
    return None


# -- workers and calls ---------------------------------------------------------------------------


class LimitedWorker:
    """``python -I -m hetconv worker ... --max-request-mib 1``, read until its ready line."""

    def __init__(self) -> None:
        command = [
            sys.executable, "-I", "-m", "hetconv", "worker", "--listen", "127.0.0.1:0",
            "--no-startup-probe", "--max-request-mib", "1",
        ]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop(TOKEN_ENV, None)  # as LocalWorkers: no token required of this test's calls
        for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[name] = "1"
        self.popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )
        self.lines: collections.deque[str] = collections.deque(maxlen=40)
        self.address: str | None = None
        self._settled = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith(READY):
                self.address = line[len(READY) :].strip()
                self._settled.set()
        self._settled.set()

    def wait_ready(self, timeout: float = 60.0) -> str:
        self._settled.wait(timeout)
        if self.address is None:
            raise RuntimeError("limited worker did not start:\n" + "\n".join(self.lines))
        return self.address

    def stop(self) -> None:
        stop_processes([self.popen])


@pytest.fixture(scope="module")
def worker() -> Iterator[LocalWorkers]:
    """The worker process every fuzz test drives (default limits)."""
    workers = LocalWorkers(1, startup_timeout=60)
    try:
        workers.start()
        yield workers
    finally:
        workers.stop()


@pytest.fixture(scope="module")
def channel(worker: LocalWorkers) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(worker.addresses[0], options=wire.channel_options()) as ch:
        grpc.channel_ready_future(ch).result(timeout=TIMEOUT)
        yield ch


@pytest.fixture(scope="module")
def client(worker: LocalWorkers) -> Iterator[WorkerClient]:
    worker_client = WorkerClient(worker.addresses[0])
    yield worker_client
    worker_client.close()


@pytest.fixture(scope="module")
def max_request_bytes(client: WorkerClient) -> int:
    return client.describe().max_request_bytes


@pytest.fixture(scope="module", autouse=True)
def rss_before(worker: LocalWorkers, client: WorkerClient) -> int | None:
    """The worker's resident memory after a warm-up of every path, before any fuzzing."""
    rng = np.random.default_rng(0)
    for shape in ((2, 3, 6, 6), (4, 8, 100, 100)):  # bundled, then streamed (1.3 MB)
        x = rng.standard_normal(shape, dtype=np.float32)
        w = rng.standard_normal((4, shape[1], 3, 3), dtype=np.float32)
        session = fresh_session()
        for _ in range(4):  # reach several of the server's handler threads
            y, _ = client.forward(session, 0, "warm", x, w, np.zeros(4, np.float32), (1,) * 4)
            client.backward(session, 0, "warm", np.ones_like(y), True)
            client.echo([("x", x)])
    return rss_bytes(worker.processes[0].pid)


@pytest.fixture(scope="module")
def limited_channel() -> Iterator[grpc.Channel]:
    """A channel to a worker that refuses requests of more than 1 MiB of tensors."""
    process = LimitedWorker()
    try:
        address = process.wait_ready()
        with grpc.insecure_channel(address, options=wire.channel_options()) as ch:
            grpc.channel_ready_future(ch).result(timeout=TIMEOUT)
            yield ch
    finally:
        process.stop()


@dataclass
class Answer:
    """How a call ended: its status, and on OK the result's tensors by name, in order."""

    code: grpc.StatusCode
    details: str = ""
    names: list[str] = field(default_factory=list)
    arrays: list[np.ndarray] = field(default_factory=list)

    def tensors(self) -> dict[str, np.ndarray]:
        return dict(zip(self.names, self.arrays, strict=True))


def _result_receiver(first: pb.ConvMessage) -> wire.TensorReceiver:
    assert first.WhichOneof("kind") == "result", f"answer started with {first}"
    names = [h.name for h in first.result.tensors]
    return wire.TensorReceiver(wire.check_headers(first.result.tensors, names))


def send(channel: grpc.Channel, call: str, transport: str, payload) -> Answer:
    """Send ``payload`` (a list of serialized messages for a stream, the serialized
    ``ConvBundle`` for a bundle call) to ``call`` and read the answer as the master would."""
    try:
        if transport == "stream":
            method = channel.stream_stream(
                f"/{SERVICE_NAME}/{call}",
                request_serializer=lambda b: b,
                response_deserializer=wire.deserialize_message,
            )
            responses = iter(method(iter(payload), timeout=TIMEOUT))
        else:
            method = channel.unary_unary(
                f"/{SERVICE_NAME}/{call}Bundle",
                request_serializer=lambda b: b,
                response_deserializer=wire.deserialize_bundle,
            )
            responses = iter([method(payload, timeout=TIMEOUT)])
        first, arrays = wire.receive_stream(responses, _result_receiver)
    except grpc.RpcError as e:
        return Answer(e.code(), e.details() or "")
    return Answer(OK, "", [h.name for h in first.result.tensors], arrays)


def assert_refused(answer: Answer, expect: frozenset, call: str, what: str) -> None:
    """A clear refusal: one of ``expect`` (never UNKNOWN or INTERNAL), naming the call."""
    assert answer.code in expect, (
        f"{what}: expected {sorted(c.name for c in expect)}, got {answer.code.name}: "
        f"{answer.details!r}"
    )
    assert answer.details.strip(), f"{what}: {answer.code.name} without a message"
    assert answer.details.startswith(f"{call}: "), answer.details


def health_status(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT).status


# -- requests as data ----------------------------------------------------------------------------


def _bytes_of(array: np.ndarray) -> bytes:
    return wire.wire_array("tensor", array).tobytes()


@dataclass
class Draft:
    """A request before it is framed: header fields and its tensors (header, bytes), in order.

    ``expect`` is the status it must get once framed as it is (OK for a valid draft).
    """

    call: str
    request: pb.ConvRequest
    tensors: list[tuple[pb.TensorHeader, bytes]]
    expect: frozenset = frozenset({OK})
    what: str = "valid"
    framing: str = "exact"

    def header_message(self) -> pb.ConvRequest:
        request = pb.ConvRequest()
        request.CopyFrom(self.request)
        del request.tensors[:]
        request.tensors.extend(h for h, _ in self.tensors)
        return request

    def data(self) -> bytes:
        return b"".join(data for _, data in self.tensors)

    def refuse(self, code: grpc.StatusCode, what: str) -> None:
        self.expect, self.what = frozenset({code}), what


def _tensor(name: str, array: np.ndarray) -> tuple[pb.TensorHeader, bytes]:
    return wire.tensor_header(name, array), _bytes_of(array)


def _shaped(name: str, shape: tuple[int, ...]) -> tuple[pb.TensorHeader, bytes]:
    """A tensor of ``shape`` with consistent header and bytes (values 1, 2, 3, ...)."""
    array = np.arange(1, math.prod(shape) + 1, dtype=np.float32).reshape(shape)
    return _tensor(name, array)


def _declared(name: str, shape: tuple[int, ...]) -> tuple[pb.TensorHeader, bytes]:
    """A header for ``shape`` whose bytes are never sent (too many to build)."""
    nbytes = math.prod(shape) * 4
    header = pb.TensorHeader(name=name, shape=shape, dtype=pb.FLOAT32, nbytes=nbytes)
    return header, b""


# -- strategies ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """A valid stride-1 convolution: x (n, c, h, w), w (k, c, kh, kw), padding (t, b, l, r)."""

    n: int
    c: int
    h: int
    w: int
    k: int
    kh: int
    kw: int
    padding: tuple[int, int, int, int]

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        top, bottom, left, right = self.padding
        return (
            self.n,
            self.k,
            self.h + top + bottom - self.kh + 1,
            self.w + left + right - self.kw + 1,
        )

    def arrays(self, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((self.n, self.c, self.h, self.w), dtype=np.float32)
        w = rng.standard_normal((self.k, self.c, self.kh, self.kw), dtype=np.float32)
        b = rng.standard_normal(self.k, dtype=np.float32)
        return x, w, b


@st.composite
def geometries(draw) -> Geometry:
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    padding = tuple(draw(st.integers(0, 2)) for _ in range(4))
    h = draw(st.integers(max(1, kh - padding[0] - padding[1]), 6))
    w = draw(st.integers(max(1, kw - padding[2] - padding[3]), 6))
    return Geometry(
        draw(st.integers(1, 2)), draw(st.integers(1, 3)), h, w, draw(st.integers(1, 4)),
        kh, kw, padding,
    )  # fmt: skip


SEEDS = st.integers(0, 2**32 - 1)
INT32 = st.integers(-(2**31), 2**31 - 1)
UINT64 = st.integers(0, 2**64 - 1)
LAYERS = st.text(max_size=12)  # any UTF-8 string is a valid layer name


@st.composite
def forward_drafts(draw) -> Draft:
    geometry = draw(geometries())
    x, w, b = geometry.arrays(draw(SEEDS))
    request = pb.ConvRequest(
        phase=pb.FORWARD, session=fresh_session(), step=draw(UINT64), layer=draw(LAYERS),
        padding=geometry.padding, kernel_offset=draw(st.integers(0, 2**32 - 1)),
    )  # fmt: skip
    return Draft("Forward", request, [_tensor("x", x), _tensor("w", w), _tensor("b", b)])


@st.composite
def backward_drafts(draw) -> Draft:
    """A well-formed Backward for a session this worker never saw."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=4, max_size=4)))
    dy = np.random.default_rng(draw(SEEDS)).standard_normal(shape, dtype=np.float32)
    request = pb.ConvRequest(
        phase=pb.BACKWARD, session=fresh_session(), step=draw(UINT64), layer=draw(LAYERS),
        need_input_grad=draw(st.booleans()),
    )  # fmt: skip
    draft = Draft("Backward", request, [_tensor("dy", dy)])
    draft.refuse(PRECONDITION, "backward before any forward of its session")
    return draft


ECHO_SHAPES = st.lists(st.integers(0, 4), max_size=4).map(tuple)


@st.composite
def echo_drafts(draw) -> Draft:
    """Any tensors at all, names included: Echo returns them unchanged."""
    shapes = draw(st.lists(ECHO_SHAPES, max_size=4))
    names = draw(st.lists(st.text(max_size=6), min_size=len(shapes), max_size=len(shapes)))
    return Draft(
        "Echo",
        pb.ConvRequest(phase=pb.PHASE_UNSPECIFIED, session=draw(UINT64)),
        [_shaped(name, shape) for name, shape in zip(names, shapes, strict=True)],
    )


DRAFTS = {"Forward": forward_drafts(), "Backward": backward_drafts(), "Echo": echo_drafts()}

# Mutations: each breaks exactly one rule of a valid draft and says which status that earns.
# ``draw`` is hypothesis's, so every choice shrinks.


def _pick(draw, draft: Draft) -> int:
    if not draft.tensors:  # an Echo of nothing: give it a tensor to break
        draft.tensors.append(_shaped("t", (2,)))
    return draw(st.integers(0, len(draft.tensors) - 1))


def _other_than(value: int, low: int, high: int) -> st.SearchStrategy:
    """Any integer in [low, high] but ``value`` (no filter: hypothesis favours small values)."""
    below = [st.integers(low, value - 1)] if value > low else []
    above = [st.integers(value + 1, high)] if value < high else []
    return st.one_of(*below, *above)


def mutate_phase(draw, draft: Draft) -> None:
    draft.request.phase = draw(_other_than(draft.request.phase, -(2**31), 2**31 - 1))
    draft.refuse(INVALID, f"phase {draft.request.phase}")


def mutate_dtype(draw, draft: Draft) -> None:
    header = draft.tensors[_pick(draw, draft)][0]
    # Any value but those with a format (FLOAT32, FLOAT16, BFLOAT16, PALETTE8: 1..4); another
    # format would only be refused for its byte count, and an empty tensor not at all.
    known = sorted({**FORMATS, **IMAGE_FORMATS})
    assert known == list(range(known[0], known[-1] + 1))
    header.dtype = draw(
        st.one_of(st.integers(-(2**31), known[0] - 1), st.integers(known[-1] + 1, 2**31 - 1))
    )
    draft.refuse(INVALID, f"tensor {header.name!r} of dtype {header.dtype}")


def mutate_nbytes(draw, draft: Draft) -> None:
    header = draft.tensors[_pick(draw, draft)][0]
    header.nbytes = draw(_other_than(header.nbytes, 0, 2**64 - 1))
    draft.refuse(INVALID, f"tensor {header.name!r} declaring {header.nbytes} bytes")


def _set_dimension(draw, draft: Draft, values: st.SearchStrategy, what: str) -> None:
    header = draft.tensors[_pick(draw, draft)][0]
    value = draw(values)
    axis = draw(st.integers(0, len(header.shape)))
    if axis == len(header.shape):
        header.shape.append(value)
    else:
        header.shape[axis] = value
    draft.refuse(INVALID, f"tensor {header.name!r} with {what} dimension {value}")


def mutate_negative_dimension(draw, draft: Draft) -> None:
    _set_dimension(draw, draft, st.integers(-(2**63), -1), "negative")


def mutate_absurd_dimension(draw, draft: Draft) -> None:
    _set_dimension(draw, draft, st.integers((1 << 31) + 1, 2**63 - 1), "absurd")


def mutate_rename(draw, draft: Draft) -> None:
    header = draft.tensors[_pick(draw, draft)][0]
    header.name = draw(st.text(max_size=4).filter(lambda n: n != header.name))
    draft.refuse(INVALID, f"a tensor renamed {header.name!r}")


def mutate_drop_tensor(draw, draft: Draft) -> None:
    del draft.tensors[_pick(draw, draft)]
    draft.refuse(INVALID, "a tensor missing")


def mutate_duplicate_tensor(draw, draft: Draft) -> None:
    tensor = draft.tensors[_pick(draw, draft)]
    draft.tensors.insert(draw(st.integers(0, len(draft.tensors))), tensor)
    draft.refuse(INVALID, f"tensor {tensor[0].name!r} twice")


def mutate_reorder(draw, draft: Draft) -> None:
    order = draw(st.permutations(range(len(draft.tensors))))
    if order == sorted(order):  # the identity: rotate it instead of filtering it out
        order = order[1:] + order[:1]
    draft.tensors = [draft.tensors[i] for i in order]
    draft.refuse(INVALID, f"tensors in order {order}")


def _replace(draft: Draft, name: str, tensor: tuple[pb.TensorHeader, bytes]) -> None:
    index = [h.name for h, _ in draft.tensors].index(name)
    draft.tensors[index] = tensor


def _shape(draft: Draft, name: str) -> tuple[int, ...]:
    return next(tuple(h.shape) for h, _ in draft.tensors if h.name == name)


def mutate_rank(draw, draft: Draft) -> None:
    """x, w or b (or dy) with a dimension too many or too few (header and bytes agree)."""
    name = draw(st.sampled_from([h.name for h, _ in draft.tensors]))
    shape = _shape(draft, name)
    if draw(st.booleans()) or len(shape) == 1:
        shape = (*shape, draw(st.integers(1, 2)))
    else:
        shape = shape[:-1]
    _replace(draft, name, _shaped(name, shape))
    draft.refuse(INVALID, f"{name} of shape {shape}")


def mutate_channels(draw, draft: Draft) -> None:
    k, c, kh, kw = _shape(draft, "w")
    c = draw(st.integers(1, 5).filter(lambda v: v != c))
    _replace(draft, "w", _shaped("w", (k, c, kh, kw)))
    draft.refuse(INVALID, f"kernels of {c} channels")


def mutate_bias_length(draw, draft: Draft) -> None:
    k = _shape(draft, "w")[0]
    length = draw(st.integers(0, 6).filter(lambda v: v != k))
    _replace(draft, "b", _shaped("b", (length,)))
    draft.refuse(INVALID, f"bias of length {length} for {k} kernels")


def mutate_kernel_too_big(draw, draft: Draft) -> None:
    _, c, h, w = _shape(draft, "x")
    top, bottom, left, right = draft.request.padding
    k = _shape(draft, "w")[0]
    kh = draw(st.integers(h + top + bottom + 1, h + top + bottom + 3))
    kw = draw(st.integers(1, w + left + right))
    if draw(st.booleans()):
        kh, kw = kw, draw(st.integers(w + left + right + 1, w + left + right + 3))
    _replace(draft, "w", _shaped("w", (k, c, kh, kw)))
    draft.refuse(
        INVALID, f"kernel {kh}x{kw} over input {h}x{w} padded {tuple(draft.request.padding)}"
    )


def mutate_empty(draw, draft: Draft) -> None:
    name = draw(st.sampled_from(["x", "w"]))
    shape = list(_shape(draft, name))
    shape[draw(st.integers(0, 3))] = 0
    _replace(draft, name, _shaped(name, tuple(shape)))
    draft.refuse(INVALID, f"empty {name} {tuple(shape)}")


def mutate_padding(draw, draft: Draft) -> None:
    if draw(st.booleans()):
        sides = draw(st.lists(INT32, max_size=8).filter(lambda s: len(s) != 4))
    else:
        sides = list(draft.request.padding)
        sides[draw(st.integers(0, 3))] = draw(st.integers(-(2**31), -1))
    draft.request.ClearField("padding")
    draft.request.padding.extend(sides)
    draft.refuse(INVALID, f"padding {sides}")


def mutate_oversized(draw, draft: Draft, limit: int) -> None:
    """One tensor declared (consistently) larger than ``limit``; its bytes are never sent."""
    index = _pick(draw, draft)
    header = draft.tensors[index][0]
    shape = [max(d, 1) for d in header.shape] or [1]
    rest = math.prod(shape[1:])
    needed = limit // (4 * rest) + 1
    assert needed <= 1 << 31, "the limit is too large to exceed with one dimension"
    shape[0] = draw(st.integers(needed, max(needed, min(1 << 31, 8 * needed))))
    draft.tensors[index] = _declared(header.name, tuple(shape))
    draft.framing = "header-only"
    draft.refuse(EXHAUSTED, f"tensor {header.name!r} of {4 * math.prod(shape)} bytes")


TENSOR_MUTATIONS = [
    mutate_phase, mutate_dtype, mutate_nbytes, mutate_negative_dimension,
    mutate_absurd_dimension,
]  # fmt: skip
NAME_MUTATIONS = [mutate_rename, mutate_drop_tensor, mutate_duplicate_tensor]
FORWARD_MUTATIONS = [
    *TENSOR_MUTATIONS, *NAME_MUTATIONS, mutate_reorder, mutate_rank, mutate_channels,
    mutate_bias_length, mutate_kernel_too_big, mutate_empty, mutate_padding,
]  # fmt: skip
BACKWARD_MUTATIONS = [*TENSOR_MUTATIONS, *NAME_MUTATIONS, mutate_rank]
ECHO_MUTATIONS = TENSOR_MUTATIONS  # Echo takes any names, shapes and number of tensors

STREAM_FRAMINGS = (
    "truncated", "extra", "header-only", "data-first", "second-header", "result-first",
    "empty-first", "no-messages",
)  # fmt: skip
BUNDLE_FRAMINGS = (
    "truncated", "extra", "header-only", "no-header", "result-instead", "header-twice",
    "data-twice",
)  # fmt: skip


def _chunks(draw, data: bytes) -> list[bytes]:
    """``data`` cut at arbitrary points (empty chunks included) into data messages."""
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=4)))
    bounds = [0, *cuts, len(data)]
    return [
        wire.serialize_message(memoryview(data[a:b]))
        for a, b in zip(bounds, bounds[1:], strict=False)
        if b > a or draw(st.booleans())
    ]


def frame_exact(draft: Draft, transport: str) -> bytes | list[bytes]:
    """The draft as the payload of :func:`send`: its header, then its bytes in one piece."""
    header, data = draft.header_message(), draft.data()
    if transport == "bundle":
        return pb.ConvBundle(header=header, data=data).SerializeToString()
    chunks = [wire.serialize_message(memoryview(data))] if data else []
    return [pb.ConvMessage(header=header).SerializeToString(), *chunks]


def frame(draw, draft: Draft, transport: str) -> bytes | list[bytes]:
    """The draft as the payload of :func:`send`, framed as ``draft.framing`` says."""
    header, data = draft.header_message(), draft.data()
    head = pb.ConvMessage(header=header).SerializeToString()
    framing = draft.framing
    if transport == "bundle":
        if framing == "exact":
            return frame_exact(draft, transport)
        if framing == "truncated":
            cut = draw(st.integers(0, len(data) - 1))
            return pb.ConvBundle(header=header, data=data[:cut]).SerializeToString()
        if framing == "extra":
            extra = draw(st.binary(min_size=1, max_size=64))
            return pb.ConvBundle(header=header, data=data + extra).SerializeToString()
        if framing == "header-only":
            return pb.ConvBundle(header=header).SerializeToString()
        if framing == "no-header":
            return pb.ConvBundle(data=data).SerializeToString()
        if framing == "result-instead":
            result = pb.ConvResult(tensors=header.tensors)
            return pb.ConvBundle(result=result, data=data).SerializeToString()
        if framing == "header-twice":  # protobuf merges the two: every tensor listed twice
            again = pb.ConvBundle(header=header).SerializeToString()
            return pb.ConvBundle(header=header, data=data).SerializeToString() + again
        if framing == "data-twice":  # the last data field wins: one byte short
            again = pb.ConvBundle(data=data[1:]).SerializeToString()
            return pb.ConvBundle(header=header, data=data).SerializeToString() + again
        raise AssertionError(framing)
    chunks = _chunks(draw, data)
    if framing == "exact":
        return [head, *chunks]
    if framing == "truncated":
        return [head, *_chunks(draw, data[: draw(st.integers(0, len(data) - 1))])]
    if framing == "extra":
        return [head, *_chunks(draw, data + draw(st.binary(min_size=1, max_size=64)))]
    if framing == "header-only":
        return [head]
    if framing == "data-first":
        return [wire.serialize_message(memoryview(data[:4])), head, *chunks]
    if framing == "second-header":
        at = draw(st.integers(0, len(chunks)))
        return [head, *chunks[:at], head, *chunks[at:]]
    if framing == "result-first":
        return [pb.ConvMessage(result=pb.ConvResult(tensors=header.tensors)).SerializeToString()]
    if framing == "empty-first":
        return [pb.ConvMessage().SerializeToString(), head, *chunks]
    if framing == "no-messages":
        return []
    raise AssertionError(framing)


# -- malformed requests --------------------------------------------------------------------------


MUTATIONS = {"Forward": FORWARD_MUTATIONS, "Backward": BACKWARD_MUTATIONS, "Echo": ECHO_MUTATIONS}
#: Every way each call is broken here: (call, mutation or "oversized", (transport, framing)).
BREAKAGES = [
    *(
        pytest.param(call, mutation, None, id=f"{call}-{mutation.__name__[7:]}")
        for call in CALLS
        for mutation in MUTATIONS[call]
    ),
    *(pytest.param(call, "oversized", None, id=f"{call}-oversized") for call in CALLS),
    *(
        pytest.param(call, None, (transport, framing), id=f"{call}-{transport}-{framing}")
        for call in CALLS
        for transport, framings in (("stream", STREAM_FRAMINGS), ("bundle", BUNDLE_FRAMINGS))
        for framing in framings
    ),
]


@pytest.mark.parametrize(("call", "mutation", "framing"), BREAKAGES)
@settings(FUZZ, max_examples=20)
@given(data=st.data())
def test_malformed_request_is_refused_clearly(
    channel, max_request_bytes, call, mutation, framing, data
):
    """A valid request broken once, in its header (through a stream or a bundle, as drawn) or
    in its framing. Header and framing errors are INVALID_ARGUMENT, a declared size over the
    worker's limit RESOURCE_EXHAUSTED; a well-formed Backward of a session never forwarded
    would be FAILED_PRECONDITION (the ordering cases are the state machine's, below)."""
    draft = data.draw(DRAFTS[call])
    if framing is None:
        transport = data.draw(st.sampled_from(TRANSPORTS))
        if mutation == "oversized":
            mutate_oversized(data.draw, draft, max_request_bytes)
        else:
            mutation(data.draw, draft)
    else:
        transport, draft.framing = framing
        if not draft.data():  # an Echo of nothing (or of empty tensors): give it bytes to break
            draft.tensors.append(_shaped("t", (2,)))
        draft.refuse(INVALID, f"framed {draft.framing}")
    answer = send(channel, call, transport, frame(data.draw, draft, transport))
    assert_refused(answer, draft.expect, call, f"{call} via {transport}: {draft.what}")


@FUZZ
@given(draft=echo_drafts(), transport=st.sampled_from(TRANSPORTS), data=st.data())
def test_echo_returns_any_valid_tensors_unchanged(channel, draft, transport, data):
    """Empty tensors, scalars (shape ()), duplicate and non-ASCII names, zero tensors."""
    answer = send(channel, "Echo", transport, frame(data.draw, draft, transport))
    assert answer.code == OK, answer.details
    assert answer.names == [h.name for h, _ in draft.tensors]
    for (header, sent), back in zip(draft.tensors, answer.arrays, strict=True):
        assert back.shape == tuple(header.shape) and back.tobytes() == sent


# -- oversized requests --------------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_request_over_the_worker_limit_is_resource_exhausted(limited_channel, data):
    """Against ``--max-request-mib 1``: a valid header declaring more than 1 MiB of tensors,
    followed by nothing, a part of its bytes or (Echo) all of them."""
    call = data.draw(st.sampled_from(CALLS))
    draft = data.draw(DRAFTS[call])
    transport = data.draw(st.sampled_from(TRANSPORTS))
    mutate_oversized(data.draw, draft, LIMITED_BYTES)
    payload = frame(data.draw, draft, transport)
    if call == "Echo" and data.draw(st.booleans()):  # real bytes, just over the limit
        size = (LIMITED_BYTES >> 2) + data.draw(st.integers(1, 64))
        draft.tensors = [_shaped(draft.tensors[0][0].name, (size,))]
        draft.framing = "exact"
        payload = frame(data.draw, draft, transport)
    elif transport == "stream" and data.draw(st.booleans()):  # a first chunk of the bytes
        payload.append(wire.serialize_message(memoryview(bytes(64 << 10))))
    answer = send(limited_channel, call, transport, payload)
    assert_refused(answer, frozenset({EXHAUSTED}), call, f"{call} via {transport}: {draft.what}")
    assert "limit of this worker" in answer.details


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_message_over_the_grpc_limit_is_resource_exhausted(worker, transport):
    """One message of more than 16 MiB (``wire.MAX_MESSAGE_BYTES``): gRPC refuses it before
    the worker's code runs. The channel here has no send limit, unlike the master's."""
    too_big = bytes(wire.MAX_MESSAGE_BYTES + 1)
    with grpc.insecure_channel(worker.addresses[0]) as ch:
        if transport == "stream":
            payload = [wire.serialize_message(memoryview(too_big))]
        else:
            payload = pb.ConvBundle(data=too_big).SerializeToString()
        answer = send(ch, "Echo", transport, payload)
    assert answer.code == EXHAUSTED, answer.details
    assert "larger than max" in answer.details


# -- raw garbage ---------------------------------------------------------------------------------


def _decodable(payload: bytes, transport: str) -> bool:
    """Whether the worker's deserializer parses ``payload`` (so its handler sees it)."""
    try:
        if transport == "stream":
            wire.deserialize_message(payload)
        else:
            wire.deserialize_bundle(payload)
    except Exception:
        return False
    return True


@st.composite
def damaged_headers(draw) -> bytes:
    """A valid request's header message with a few bytes overwritten or inserted, then cut."""
    draft = draw(st.sampled_from(list(DRAFTS.values())).flatmap(lambda drafts: drafts))
    buffer = bytearray(pb.ConvMessage(header=draft.header_message()).SerializeToString())
    for _ in range(draw(st.integers(1, 3))):
        if buffer and draw(st.booleans()):
            buffer[draw(st.integers(0, len(buffer) - 1))] = draw(st.integers(0, 255))
        else:
            at = draw(st.integers(0, len(buffer)))
            buffer[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(buffer[: draw(st.integers(0, len(buffer)))])


@FUZZ
@given(
    call=st.sampled_from(CALLS),
    transport=st.sampled_from(TRANSPORTS),
    garbage=st.binary(max_size=64) | damaged_headers(),
    follow=st.lists(st.binary(max_size=16), max_size=2),
)
def test_garbage_messages_are_refused_clearly(channel, call, transport, garbage, follow):
    """Random bytes, and damaged real headers, as the first (or only) message of each call,
    a stream's followed by more random messages.

    Echo may answer OK: garbage can decode to a header of no tensors, a valid Echo. A message
    that protobuf cannot decode at all must be refused clearly too (INVALID_ARGUMENT naming
    it; see :func:`test_undecodable_message_is_invalid_argument`).
    """
    messages = [garbage, *follow] if transport == "stream" else [garbage]
    answer = send(channel, call, transport, messages if transport == "stream" else garbage)
    what = f"{call} via {transport}: {messages!r}"
    decodable = all(_decodable(m, transport) for m in messages)
    event(f"{'decodable' if decodable else 'undecodable'}: {answer.code.name}")
    if decodable:
        if answer.code != OK:
            assert_refused(answer, CLEAR, call, what)
        else:
            assert call == "Echo", what
    else:
        assert_refused(answer, frozenset({INVALID}), call, what)


def _bad_utf8_layer_header(phase: int) -> bytes:
    """A header whose layer name is not UTF-8 (proto3 strings must be): Latin-1 "é"."""
    request = pb.ConvRequest(phase=phase, layer="LAYER").SerializeToString()
    request = request.replace(b"\x22\x05LAYER", b"\x22\x01\xe9")
    return b"\x0a" + bytes([len(request)]) + request


UNDECODABLE = {
    "field-number-0": b"\x00",
    "header-of-undecodable-request": b"\x0a\x02\xff\xff",
    "layer-name-not-utf8": None,  # built per call: the phase must match
}
_PHASES = {"Forward": pb.FORWARD, "Backward": pb.BACKWARD, "Echo": pb.PHASE_UNSPECIFIED}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("garbage", list(UNDECODABLE), ids=list(UNDECODABLE))
def test_undecodable_message_is_invalid_argument(channel, call, transport, garbage):
    payload = UNDECODABLE[garbage] or _bad_utf8_layer_header(_PHASES[call])
    answer = send(channel, call, transport, [payload] if transport == "stream" else payload)
    assert_refused(answer, frozenset({INVALID}), call, f"{garbage} via {transport}")


@pytest.mark.parametrize("call", CALLS)
def test_cut_data_message_in_a_stream_is_invalid_argument(channel, call):
    draft = _one_pixel_forward(0)
    if call != "Forward":
        draft = Draft(call, pb.ConvRequest(phase=_PHASES[call]), [_shaped("dy", (1, 1, 1, 1))])
    header = frame_exact(draft, "stream")[0]
    answer = send(channel, call, "stream", [header, b"\x12\x05ab"])
    assert_refused(answer, frozenset({INVALID}), call, "cut data message")


# -- tensors the worker cannot hold --------------------------------------------------------------


ECHO_UNHOLDABLE = {
    # shape product 0 (so nbytes 0 passes), but numpy refuses to even describe the array
    "empty-tensor-with-huge-dimensions": (0, 1 << 31, 1 << 31, 1 << 31),
    # numpy arrays have at most 64 dimensions
    "65-dimensions": (1,) * 65,
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("shape", list(ECHO_UNHOLDABLE.values()), ids=list(ECHO_UNHOLDABLE))
def test_echo_of_a_tensor_numpy_cannot_hold_is_invalid_argument(channel, transport, shape):
    header = pb.TensorHeader(name="a", shape=shape, dtype=pb.FLOAT32, nbytes=4 * math.prod(shape))
    draft = Draft("Echo", pb.ConvRequest(), [(header, bytes(header.nbytes))])
    answer = send(channel, "Echo", transport, frame_exact(draft, transport))
    assert_refused(answer, CLEAR, "Echo", f"Echo of shape {shape[:4]}... via {transport}")


def _one_pixel_forward(padding: int) -> Draft:
    """x, w and b of one element each (12 bytes of tensors) with ``padding`` on every side:
    the output is (2 * padding + 1)^2 floats."""
    one = np.ones((1, 1, 1, 1), np.float32)
    request = pb.ConvRequest(phase=pb.FORWARD, session=fresh_session(), padding=[padding] * 4)
    tensors = [_tensor("x", one), _tensor("w", one), _tensor("b", np.ones(1, np.float32))]
    return Draft("Forward", request, tensors)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_padding_that_outgrows_memory_is_refused(channel, transport):
    draft = _one_pixel_forward(1 << 30)
    answer = send(channel, "Forward", transport, frame_exact(draft, transport))
    assert_refused(answer, CLEAR, "Forward", "padding 2**30")


def test_answer_over_the_request_limit_is_resource_exhausted(limited_channel):
    draft = _one_pixel_forward(512)
    answer = send(limited_channel, "Forward", "bundle", frame_exact(draft, "bundle"))
    assert_refused(answer, frozenset({EXHAUSTED}), "Forward", "output of 4.2 MB")


# -- non-finite values ---------------------------------------------------------------------------


NON_FINITE = st.sampled_from([np.nan, np.inf, -np.inf])


def _poison(draw, array: np.ndarray) -> np.ndarray:
    """``array`` with some elements (possibly none) replaced by NaN or +-Inf."""
    flat = array.copy().reshape(-1)
    for index in draw(st.lists(st.integers(0, flat.size - 1), max_size=3)):
        flat[index] = draw(NON_FINITE)
    return flat.reshape(array.shape)


@pytest.mark.slow
@FUZZ
@given(
    geometry=geometries(),
    seed=SEEDS,
    transport=st.sampled_from(TRANSPORTS),
    need_input_grad=st.booleans(),
    data=st.data(),
)
def test_non_finite_inputs_are_computed(channel, geometry, seed, transport, need_input_grad, data):
    """NaN and +-Inf in x, w, b and dy are computed, not refused: OK, the right shapes, and the
    same values (NaN where the reference has NaN) as the cpu backend here."""
    x, w, b = (_poison(data.draw, a) for a in geometry.arrays(seed))
    session = fresh_session()
    request = pb.ConvRequest(
        phase=pb.FORWARD, session=session, step=1, layer="nan", padding=geometry.padding
    )
    forward = Draft("Forward", request, [_tensor("x", x), _tensor("w", w), _tensor("b", b)])
    answer = send(channel, "Forward", transport, frame(data.draw, forward, transport))
    assert answer.code == OK, answer.details
    (y,) = answer.arrays
    assert answer.names == ["y"] and y.shape == geometry.out_shape
    expected = reference("conv_forward", x, w, b, geometry.padding)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6, equal_nan=True)

    dy = _poison(data.draw, np.random.default_rng(seed).standard_normal(y.shape, np.float32))
    request = pb.ConvRequest(
        phase=pb.BACKWARD, session=session, step=1, layer="nan", need_input_grad=need_input_grad
    )
    answer = send(
        channel,
        "Backward",
        transport,
        frame(data.draw, Draft("Backward", request, [_tensor("dy", dy)]), transport),
    )
    assert answer.code == OK, answer.details
    got = answer.tensors()
    dw, db = reference("conv_grad_kernels", x, dy, w.shape[2:], geometry.padding)
    np.testing.assert_allclose(got["dw"], dw, rtol=1e-5, atol=1e-6, equal_nan=True)
    np.testing.assert_allclose(got["db"], db, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert ("dx" in got) == need_input_grad
    if need_input_grad:
        dx = reference("conv_grad_input", dy, w, x.shape[2:], geometry.padding)
        np.testing.assert_allclose(got["dx"], dx, rtol=1e-5, atol=1e-6, equal_nan=True)


# -- order: duplicated, repeated and out-of-order calls ------------------------------------------


@dataclass
class Saved:
    """What the worker should hold for a (session, layer): the Forward it answered."""

    step: int
    x: np.ndarray
    w: np.ndarray
    padding: tuple[int, int, int, int]
    y_shape: tuple[int, ...]


def _forward_payload(session, layer, step, x, w, b, padding, transport, draw):
    request = pb.ConvRequest(
        phase=pb.FORWARD, session=session, step=step, layer=layer, padding=padding
    )
    draft = Draft("Forward", request, [_tensor("x", x), _tensor("w", w), _tensor("b", b)])
    return frame(draw, draft, transport)


def _backward_payload(session, layer, step, dy, need_input_grad, transport, draw):
    request = pb.ConvRequest(
        phase=pb.BACKWARD, session=session, step=step, layer=layer,
        need_input_grad=need_input_grad,
    )  # fmt: skip
    return frame(draw, Draft("Backward", request, [_tensor("dy", dy)]), transport)


LAYER_NAMES = st.sampled_from(["conv1", "conv2"])
STEPS = st.integers(0, 2)


class _CallOrder(RuleBasedStateMachine):
    """The state machine of :func:`test_forward_and_backward_in_any_order`, on ``channel``
    (set by the test) against a worker that keeps ``capacity`` sessions."""

    channel: grpc.Channel
    capacity = WorkerConfig().sessions

    def __init__(self) -> None:
        super().__init__()
        # More sessions than the worker keeps, so that some get evicted.
        self.sessions = [fresh_session() for _ in range(self.capacity + 2)]
        self.saved: OrderedDict[int, dict[str, Saved]] = OrderedDict()
        self.evicted: set[int] = set()  # sessions whose saved inputs the worker dropped
        self.last_forward: tuple | None = None

    def _target(self, data) -> tuple[int, str, Saved | None]:
        """A (session, layer) the model holds a Forward for, or any."""
        anywhere = st.tuples(st.sampled_from(self.sessions), LAYER_NAMES)
        held = [(s, layer) for s, layers in self.saved.items() for layer in layers]
        session, layer = data.draw(st.sampled_from(held) | anywhere if held else anywhere)
        return session, layer, self.saved.get(session, {}).get(layer)

    def _forwarded(self, args, answer: Answer) -> None:
        session, layer, step, x, w, b, padding = args
        assert answer.code == OK, answer.details
        expected = reference("conv_forward", x, w, b, padding)
        np.testing.assert_allclose(answer.arrays[0], expected, rtol=1e-5, atol=1e-6)
        self.saved.setdefault(session, {})[layer] = Saved(step, x, w, padding, expected.shape)
        self.saved.move_to_end(session)
        self.evicted.discard(session)
        while len(self.saved) > self.capacity:
            self.evicted.add(self.saved.popitem(last=False)[0])

    @rule(
        layer=LAYER_NAMES,
        step=STEPS,
        geometry=geometries(),
        seed=SEEDS,
        transport=st.sampled_from(TRANSPORTS),
        data=st.data(),
    )
    def forward(self, layer, step, geometry, seed, transport, data):
        session = data.draw(st.sampled_from(self.sessions))
        args = (session, layer, step, *geometry.arrays(seed), geometry.padding)
        payload = _forward_payload(*args, transport, data.draw)
        self._forwarded(args, send(self.channel, "Forward", transport, payload))
        self.last_forward = args

    @precondition(lambda self: self.last_forward is not None)
    @rule(transport=st.sampled_from(TRANSPORTS), data=st.data())
    def forward_again(self, transport, data):
        """The last Forward once more (a master's retry): the same answer."""
        payload = _forward_payload(*self.last_forward, transport, data.draw)
        self._forwarded(self.last_forward, send(self.channel, "Forward", transport, payload))

    @rule(
        need_input_grad=st.booleans(),
        seed=SEEDS,
        transport=st.sampled_from(TRANSPORTS),
        data=st.data(),
    )
    def backward(self, need_input_grad, seed, transport, data):
        session, layer, held = self._target(data)
        step = data.draw(st.just(held.step) | STEPS if held else STEPS)
        shape = held.y_shape if held else (1, 1, 1, 1)
        dy = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
        payload = _backward_payload(session, layer, step, dy, need_input_grad, transport, data.draw)
        answer = send(self.channel, "Backward", transport, payload)
        if held is None or held.step != step:
            event("backward: FAILED_PRECONDITION")
            assert_refused(answer, frozenset({PRECONDITION}), "Backward", "unheld forward")
            if held is None and session in self.evicted:  # eviction is named as the cause
                assert "dropped the session's saved inputs" in answer.details, answer.details
            else:
                assert "send Forward first" in answer.details, answer.details
            return
        event("backward: OK")
        assert answer.code == OK, answer.details
        got = answer.tensors()
        dw, db = reference("conv_grad_kernels", held.x, dy, held.w.shape[2:], held.padding)
        np.testing.assert_allclose(got["dw"], dw, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["db"], db, rtol=1e-5, atol=1e-6)
        assert ("dx" in got) == need_input_grad
        if need_input_grad:
            dx = reference("conv_grad_input", dy, held.w, held.x.shape[2:], held.padding)
            np.testing.assert_allclose(got["dx"], dx, rtol=1e-5, atol=1e-6)

    @rule(transport=st.sampled_from(TRANSPORTS), data=st.data())
    def backward_with_a_wrong_dy(self, transport, data):
        session, layer, held = self._target(data)
        step = held.step if held else 0
        n, k, ho, wo = held.y_shape if held else (1, 1, 1, 1)
        shape = data.draw(
            st.sampled_from([(n + 1, k, ho, wo), (n, k + 1, ho, wo), (n, k, ho, wo + 1)])
        )
        payload = _backward_payload(
            session, layer, step, np.zeros(shape, np.float32), False, transport, data.draw
        )
        answer = send(self.channel, "Backward", transport, payload)
        expect = INVALID if held is not None else PRECONDITION
        event(f"wrong dy: {expect.name}")
        assert_refused(answer, frozenset({expect}), "Backward", f"dy {shape}")


@pytest.mark.slow
def test_forward_and_backward_in_any_order(channel):
    """Forward and Backward calls of a few sessions, layers and steps in any order, repeated
    and duplicated, each through a stream or a bundle, against a model of the worker's cache
    (``WorkerConfig.sessions`` sessions, the least recently forwarded evicted first).

    A Backward whose Forward (same session, layer and step) the worker holds is answered with
    the reference gradients, as often as it is sent; any other Backward is
    FAILED_PRECONDITION; one with a dy of the wrong shape for what it holds is
    INVALID_ARGUMENT.
    """
    run_state_machine_as_test(
        type("CallOrder", (_CallOrder,), {"channel": channel}),
        settings=settings(FUZZ, max_examples=30, stateful_step_count=25),
    )


# -- after all that ------------------------------------------------------------------------------


def test_worker_is_healthy_correct_and_lean_after_the_fuzzing(
    worker, channel, client, rss_before, rng
):
    """Runs last (file order); holds also when run alone, against the warm-up baseline."""
    process = worker.processes[0]
    assert process.poll() is None, "the worker process died:\n" + "\n".join(worker._output[0])
    for service in ("", SERVICE_NAME):
        assert health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING

    # A small (bundled) and a large (streamed, several chunks) layer, forward and backward:
    # nothing earlier (NaN in reused scratch buffers, say) may leak into these results.
    for x_shape, k in (((2, 3, 7, 7), 5), ((4, 8, 100, 100), 6)):
        x = rng.standard_normal(x_shape, dtype=np.float32)
        w = rng.standard_normal((k, x_shape[1], 3, 2), dtype=np.float32)
        b = rng.standard_normal(k, dtype=np.float32)
        padding = (1, 0, 2, 1)
        session = fresh_session()
        y, _ = client.forward(session, 3, "after", x, w, b, padding)
        np.testing.assert_allclose(
            y, reference("conv_forward", x, w, b, padding), rtol=1e-5, atol=1e-6
        )
        dy = rng.standard_normal(y.shape, dtype=np.float32)
        dx, dw, db, _ = client.backward(session, 3, "after", dy, True, answer_bytes=0)
        expected_dw, expected_db = reference("conv_grad_kernels", x, dy, (3, 2), padding)
        np.testing.assert_allclose(dw, expected_dw, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(db, expected_db, rtol=1e-5, atol=1e-6)
        expected_dx = reference("conv_grad_input", dy, w, x_shape[2:], padding)
        np.testing.assert_allclose(dx, expected_dx, rtol=1e-5, atol=1e-6)

    rss_after = rss_bytes(process.pid)
    if rss_before is None or rss_after is None:
        pytest.skip("resident memory is read from /proc/PID/status (Linux only)")
    growth = rss_after - rss_before
    assert growth <= RSS_GROWTH_BOUND, (
        f"worker RSS grew by {growth / 2**20:.1f} MiB over the fuzzing "
        f"({rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB), "
        f"bound {RSS_GROWTH_BOUND >> 20} MiB"
    )
