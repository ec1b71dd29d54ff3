"""Real ``hetconv worker`` processes over gRPC on loopback: results, refusals, shutdown, CLI.

Every test here talks to a worker in another process through a real socket: the module's shared
worker (started by :class:`LocalWorkers`), or one started for the test with its own flags.
Malformed requests go through a raw channel with the wire codec, so each can break exactly one
rule of ``protos/hetconv/proto/worker.proto`` that :class:`WorkerClient` would never break.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from threadpoolctl import threadpool_limits

from hetconv import __version__, wire
from hetconv.backends import ConvShape, Padding, get_backend
from hetconv.calls import READY
from hetconv.master.client import WorkerClient, WorkerError
from hetconv.master.launch import LocalWorkers, stop_processes
from hetconv.proto import worker_pb2 as pb

SERVICE = "hetconv.v1.ConvWorker"
TIMEOUT = 20.0  # seconds for any single call or process step; a hang fails instead of stalling
POSIX_ONLY = pytest.mark.skipif(
    sys.platform == "win32", reason="POSIX signals: Windows cannot deliver SIGINT/SIGTERM this way"
)


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = "1"
    return env


def reference(operation: str, *args):
    """``get_backend('cpu').<operation>(*args)`` computed here, as the worker computes it.

    The workers run BLAS on one thread (``LocalWorkers(blas_threads=1)`` and :func:`_env`);
    computing the reference the same way gives it the same summation order, so the comparison
    tests the transport and the worker's bookkeeping rather than float reassociation.
    """
    with threadpool_limits(limits=1):
        return getattr(get_backend("cpu"), operation)(*args)


def _session() -> int:
    return random.getrandbits(64)


class WorkerProcess:
    """One ``python -m hetconv worker --listen 127.0.0.1:0 --no-startup-probe ...`` process."""

    def __init__(self, *args: str, listen: str = "127.0.0.1:0", stdin=subprocess.DEVNULL):
        command = [sys.executable, "-m", "hetconv", "worker", "--listen", listen]
        command += ["--no-startup-probe", *args]
        self.popen = subprocess.Popen(
            command,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=_env(),
            text=True,
        )
        self.lines: list[str] = []
        self.address: str | None = None
        self._settled = threading.Event()  # set at the ready line or at end of output
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        for line in self.popen.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if line.startswith(READY):
                self.address = line[len(READY) :].strip()
                self._settled.set()
        self._settled.set()

    def wait_settled(self, timeout: float = TIMEOUT) -> str | None:
        """Wait until it says it is ready (returns the address) or its output ends (None)."""
        assert self._settled.wait(timeout), f"worker said nothing useful in {timeout} s"
        return self.address

    def wait_ready(self, timeout: float = TIMEOUT) -> str:
        address = self.wait_settled(timeout)
        assert address is not None, f"worker did not start:\n{self.output()}"
        return address

    def output(self) -> str:
        """Everything it printed; complete once the process has exited."""
        if self.popen.poll() is not None:
            self._reader.join(5)
        return "\n".join(self.lines)

    def stop(self) -> None:
        stop_processes([self.popen])
        self._reader.join(5)


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_worker() -> Iterator[LocalWorkers]:
    """One real worker process for the whole module (default limits)."""
    workers = LocalWorkers(1, startup_timeout=60)
    try:
        workers.start()
        yield workers
    finally:
        workers.stop()


@pytest.fixture(scope="module")
def address(local_worker: LocalWorkers) -> str:
    return local_worker.addresses[0]


@pytest.fixture(scope="module")
def client(address: str) -> Iterator[WorkerClient]:
    worker = WorkerClient(address)
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def channel(address: str) -> Iterator[grpc.Channel]:
    """A raw channel to the shared worker, with the same options the master uses."""
    with grpc.insecure_channel(address, options=wire.channel_options()) as ch:
        grpc.channel_ready_future(ch).result(timeout=TIMEOUT)
        yield ch


@pytest.fixture
def spawn_worker() -> Iterator[Callable[..., WorkerProcess]]:
    """Start worker processes with chosen flags; every one is stopped when the test ends."""
    started: list[WorkerProcess] = []

    def spawn(*args: str, listen: str = "127.0.0.1:0", **options) -> WorkerProcess:
        process = WorkerProcess(*args, listen=listen, **options)
        started.append(process)
        return process

    yield spawn
    for process in started:
        process.stop()


@pytest.fixture(scope="module")
def limited_worker() -> Iterator[WorkerProcess]:
    """A worker that refuses requests of more than 1 MiB of tensors."""
    process = WorkerProcess("--max-request-mib", "1", "--backend", "cpu")
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


# -- helpers -------------------------------------------------------------------------------------


def stream_method(channel: grpc.Channel, name: str):
    return channel.stream_stream(
        f"/{SERVICE}/{name}",
        request_serializer=wire.serialize_message,
        response_deserializer=wire.deserialize_message,
    )


def probe_method(channel: grpc.Channel):
    return channel.unary_unary(
        f"/{SERVICE}/Probe",
        request_serializer=pb.ProbeRequest.SerializeToString,
        response_deserializer=pb.ProbeResult.FromString,
    )


def refused(channel: grpc.Channel, method: str, messages: list) -> grpc.RpcError:
    """Send ``messages`` on a stream call that must fail; returns the error."""
    call = stream_method(channel, method)
    with pytest.raises(grpc.RpcError) as info:
        responses = list(call(iter(messages), timeout=TIMEOUT))
        pytest.fail(f"{method} was answered with {len(responses)} messages instead of an error")
    return info.value


def health_status(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT).status


def conv_tensors(seed: int = 0, c: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A small valid layer: x (2, 3, 6, 6), w (4, c, 3, 3), b (4,)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 6, 6), dtype=np.float32)
    w = rng.standard_normal((4, c, 3, 3), dtype=np.float32)
    b = rng.standard_normal(4, dtype=np.float32)
    return x, w, b


PADDING = (1, 1, 1, 1)


def header(session: int, tensors: list[pb.TensorHeader], **fields) -> pb.ConvMessage:
    fields.setdefault("layer", "conv")
    fields.setdefault("step", 1)
    return pb.ConvMessage(header=pb.ConvRequest(session=session, tensors=tensors, **fields))


def forward_messages(
    session: int,
    arrays: tuple[np.ndarray, ...] | None = None,
    names: tuple[str, ...] = ("x", "w", "b"),
    data: bytes | None = None,
    **fields,
) -> list:
    """A Forward request: header, then the arrays' bytes in 1 MiB chunks (or ``data``, whole)."""
    arrays = conv_tensors() if arrays is None else arrays
    heads = [wire.tensor_header(n, a) for n, a in zip(names, arrays, strict=True)]
    fields.setdefault("phase", pb.FORWARD)
    fields.setdefault("padding", PADDING)
    messages: list = [header(session, heads, **fields)]
    if data is None:
        messages += list(wire.data_chunks(arrays))
    elif data:
        messages.append(memoryview(data))
    return messages


def all_bytes(arrays: tuple[np.ndarray, ...]) -> bytes:
    return b"".join(a.tobytes() for a in arrays)


def backward_messages(session: int, dy: np.ndarray, **fields) -> list:
    heads = [wire.tensor_header("dy", dy)]
    fields.setdefault("phase", pb.BACKWARD)
    return [header(session, heads, **fields), *wire.data_chunks([dy])]


# -- a correct round trip ------------------------------------------------------------------------


@pytest.mark.parametrize("need_input_grad", [True, False], ids=["with-dx", "without-dx"])
def test_forward_then_backward_equal_the_local_cpu_backend(client, rng, need_input_grad):
    # x is 1.28 MB, so it crosses the wire in more than one chunk; odd kernel and padding.
    x = rng.standard_normal((4, 8, 100, 100), dtype=np.float32)
    w = rng.standard_normal((6, 8, 3, 2), dtype=np.float32)
    b = rng.standard_normal(6, dtype=np.float32)
    padding = (1, 0, 2, 1)
    session = _session()

    y, stats = client.forward(session, 7, "conv1", x, w, b, padding, kernel_offset=12)
    expected_y = reference("conv_forward", x, w, b, padding)
    assert y.dtype == np.float32 and y.shape == expected_y.shape == (4, 6, 99, 102)
    np.testing.assert_allclose(y, expected_y, rtol=1e-5, atol=1e-6)
    assert stats.bytes_sent > x.nbytes and stats.bytes_received > y.nbytes

    dy = rng.standard_normal(y.shape, dtype=np.float32)
    dx, dw, db, _ = client.backward(session, 7, "conv1", dy, need_input_grad, kernel_offset=12)
    expected_dw, expected_db = reference("conv_grad_kernels", x, dy, w.shape[2:], padding)
    assert dw.shape == w.shape and db.shape == b.shape
    np.testing.assert_allclose(dw, expected_dw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(db, expected_db, rtol=1e-5, atol=1e-6)
    if need_input_grad:
        expected_dx = reference("conv_grad_input", dy, w, x.shape[2:], padding)
        assert dx is not None and dx.shape == x.shape
        np.testing.assert_allclose(dx, expected_dx, rtol=1e-5, atol=1e-6)
    else:
        assert dx is None


def test_forward_inputs_are_kept_per_session_and_layer(client, rng):
    """Two sessions and two layers in flight: each Backward uses its own Forward's inputs."""
    calls = {}
    for session in (_session(), _session()):
        for layer in ("conv1", "conv2"):
            x = rng.standard_normal((2, 3, 5, 5), dtype=np.float32)
            w = rng.standard_normal((2, 3, 3, 3), dtype=np.float32)
            b = np.zeros(2, np.float32)
            y, _ = client.forward(session, 0, layer, x, w, b, PADDING)
            calls[session, layer] = (x, w, rng.standard_normal(y.shape, dtype=np.float32))
    for (session, layer), (x, w, dy) in calls.items():
        dx, dw, _, _ = client.backward(session, 0, layer, dy, True)
        np.testing.assert_allclose(
            dw, reference("conv_grad_kernels", x, dy, (3, 3), PADDING)[0], rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            dx, reference("conv_grad_input", dy, w, (5, 5), PADDING), rtol=1e-5, atol=1e-6
        )


def test_slices_of_one_layer_in_one_step_are_kept_per_kernel_offset(client, rng):
    """One worker reached under two addresses serves two slices of a layer with the same number
    of kernels in one step: each Backward must use its own Forward's kernels (it used to get
    the last Forward's, and returned an input gradient of the wrong slice)."""
    session = _session()
    x = rng.standard_normal((2, 3, 6, 6), dtype=np.float32)
    slices = {}
    for offset in (0, 4):
        w = rng.standard_normal((4, 3, 3, 3), dtype=np.float32)
        y, _ = client.forward(session, 5, "conv2", x, w, np.zeros(4, np.float32), PADDING,
                              kernel_offset=offset)  # fmt: skip
        slices[offset] = w, rng.standard_normal(y.shape, dtype=np.float32)
    for offset, (w, dy) in slices.items():
        dx, dw, _, _ = client.backward(session, 5, "conv2", dy, True, kernel_offset=offset)
        np.testing.assert_allclose(
            dx, reference("conv_grad_input", dy, w, (6, 6), PADDING), rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            dw, reference("conv_grad_kernels", x, dy, (3, 3), PADDING)[0], rtol=1e-5, atol=1e-6
        )
    with pytest.raises(WorkerError, match="from kernel 8 at step 5") as info:
        client.backward(session, 5, "conv2", slices[0][1], True, kernel_offset=8)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "have only kernels from 0, 4" in str(info.value)


def test_describe_gives_an_instance_id_per_worker_process(client, address, spawn_worker):
    first = client.describe().instance_id
    assert first != 0 and client.describe().instance_id == first
    port = address.rsplit(":", 1)[1]
    alias = WorkerClient(f"localhost:{port}")  # the same process under another name
    try:
        assert alias.describe().instance_id == first
    finally:
        alias.close()
    other = WorkerClient(spawn_worker("--backend", "cpu").wait_ready())
    try:
        assert other.describe().instance_id not in (0, first)
    finally:
        other.close()


def test_describe_names_the_cpu_backend_and_the_request_limit(client):
    info = client.describe()
    assert info.backend == "cpu"
    assert info.max_request_bytes <= 2048 << 20  # the CLI default, --max-request-mib 2048
    assert info.hetconv_version == __version__
    assert info.cores >= 1 and info.memory_bytes > 0


def test_probe_returns_positive_seconds(client):
    seconds = client.probe(ConvShape(2, 4, 8, 8, 6, 3, 3, Padding(1, 1, 1, 1)), repeats=1)
    assert seconds > 0


@pytest.mark.parametrize("service", ["", SERVICE], ids=["server", "conv-worker"])
def test_health_check_says_serving(channel, service):
    assert health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING


def test_health_check_of_an_unknown_service_is_not_found(channel):
    with pytest.raises(grpc.RpcError) as info:
        health_status(channel, "no.such.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


# -- malformed requests --------------------------------------------------------------------------


@dataclass(frozen=True)
class Malformed:
    """A request that breaks one rule, and the status and message it must get."""

    method: str
    build: Callable[[WorkerClient, int], list]  # (client, fresh session) -> messages
    code: grpc.StatusCode
    match: str  # a fragment the status details must contain


def _wrong_dtype(client, session):
    messages = forward_messages(session)
    messages[0].header.tensors[1].dtype = pb.DTYPE_UNSPECIFIED
    return messages


def _unknown_dtype(client, session):
    messages = forward_messages(session)
    messages[0].header.tensors[0].dtype = 7  # proto3 enums are open: any number can arrive
    return messages


def _nbytes_disagrees(client, session):
    messages = forward_messages(session)
    messages[0].header.tensors[0].nbytes -= 4
    return messages


def _negative_dimension(client, session):
    messages = forward_messages(session)
    x = messages[0].header.tensors[0]
    x.shape[0] = -2
    x.nbytes = 0
    return messages


def _two_headers(client, session):
    messages = forward_messages(session)
    return [messages[0], messages[0], *messages[1:]]


def _backward_step_mismatch(client, session):
    x, w, b = conv_tensors()
    y, _ = client.forward(session, 1, "conv", x, w, b, PADDING)
    return backward_messages(session, np.ones_like(y), step=2)


def _backward_dy_shape_wrong(client, session):
    x, w, b = conv_tensors()
    client.forward(session, 1, "conv", x, w, b, PADDING)
    return backward_messages(session, np.ones((2, 5, 6, 6), np.float32))  # 5 kernels, not 4


INVALID = grpc.StatusCode.INVALID_ARGUMENT
MALFORMED = {
    "backward-phase-to-forward": Malformed(
        "Forward",
        lambda c, s: forward_messages(s, phase=pb.BACKWARD),
        INVALID,
        "request phase BACKWARD sent to the FORWARD call",
    ),
    "unspecified-phase-to-forward": Malformed(
        "Forward",
        lambda c, s: forward_messages(s, phase=pb.PHASE_UNSPECIFIED),
        INVALID,
        "PHASE_UNSPECIFIED sent to the FORWARD call",
    ),
    "forward-phase-to-backward": Malformed(
        "Backward",
        lambda c, s: forward_messages(s),
        INVALID,
        "request phase FORWARD sent to the BACKWARD call",
    ),
    "wrong-tensor-names": Malformed(
        "Forward",
        lambda c, s: forward_messages(s, names=("x", "w", "bias")),
        INVALID,
        "tensors ['x', 'w', 'bias'] sent, expected ['x', 'w', 'b']",
    ),
    "tensors-out-of-order": Malformed(
        "Forward",
        lambda c, s: forward_messages(s, names=("w", "x", "b")),
        INVALID,
        "expected ['x', 'w', 'b']",
    ),
    "missing-bias": Malformed(
        "Forward",
        lambda c, s: forward_messages(s, arrays=conv_tensors()[:2], names=("x", "w")),
        INVALID,
        "tensors ['x', 'w'] sent",
    ),
    "wrong-dtype": Malformed(
        "Forward", _wrong_dtype, INVALID, "tensor w has dtype DTYPE_UNSPECIFIED, expected FLOAT32"
    ),
    "unknown-dtype": Malformed("Forward", _unknown_dtype, INVALID, "tensor x has dtype 7"),
    "nbytes-disagrees-with-shape": Malformed(
        "Forward",
        _nbytes_disagrees,
        INVALID,
        "tensor x declares 860 bytes but shape (2, 3, 6, 6) of float32 holds 864",
    ),
    "negative-dimension": Malformed(
        "Forward", _negative_dimension, INVALID, "tensor x has a negative dimension"
    ),
    "fewer-bytes-than-declared": Malformed(
        "Forward",
        lambda c, s: forward_messages(s, data=all_bytes(conv_tensors())[:-8]),
        INVALID,
        "stream ended after 1304 bytes of tensor data, the header declared 1312",
    ),
    "no-bytes-at-all": Malformed(
        "Forward",
        lambda c, s: forward_messages(s, data=b""),
        INVALID,
        "stream ended after 0 bytes of tensor data, the header declared 1312",
    ),
    "more-bytes-than-declared": Malformed(
        "Forward",
        lambda c, s: forward_messages(s, data=all_bytes(conv_tensors()) + bytes(4)),
        INVALID,
        "received 1316 bytes of tensor data, the header declared 1312",
    ),
    "kernel-channels-differ-from-input": Malformed(
        "Forward",
        lambda c, s: forward_messages(s, arrays=conv_tensors(c=2)),
        INVALID,
        "kernels have 2 input channels, input has 3",
    ),
    "bias-length-wrong": Malformed(
        "Forward",
        lambda c, s: forward_messages(s, arrays=(*conv_tensors()[:2], np.zeros(3, np.float32))),
        INVALID,
        "b has shape (3,), expected (4,)",
    ),
    "x-not-4d": Malformed(
        "Forward",
        lambda c, s: forward_messages(
            s, arrays=(np.zeros((3, 6, 6), np.float32),) + conv_tensors()[1:]
        ),
        INVALID,
        "must both have 4 dimensions",
    ),
    "kernel-larger-than-input": Malformed(
        "Forward",
        lambda c, s: forward_messages(
            s, arrays=(conv_tensors()[0], np.zeros((4, 3, 9, 9), np.float32), conv_tensors()[2])
        ),
        INVALID,
        "kernel 9x9 does not fit input 6x6",
    ),
    "padding-with-3-sides": Malformed(
        "Forward",
        lambda c, s: forward_messages(s, padding=(1, 1, 1)),
        INVALID,
        "padding must have 4 sides (top, bottom, left, right), got [1, 1, 1]",
    ),
    "padding-negative": Malformed(
        "Forward",
        lambda c, s: forward_messages(s, padding=(1, -1, 1, 1)),
        INVALID,
        "padding (1, -1, 1, 1) has a negative side",
    ),
    "data-before-header": Malformed(
        "Forward",
        lambda c, s: [memoryview(bytes(16)), *forward_messages(s)],
        INVALID,
        "stream started with tensor data instead of a header",
    ),
    "result-instead-of-header": Malformed(
        "Forward",
        lambda c, s: [pb.ConvMessage(result=pb.ConvResult())],
        INVALID,
        "stream started with result, not a header",
    ),
    "empty-stream": Malformed(
        "Forward", lambda c, s: [], INVALID, "stream ended before its header"
    ),
    "two-headers": Malformed(
        "Forward",
        _two_headers,
        INVALID,
        "a second header message arrived in the middle of tensor data",
    ),
    "backward-of-layer-never-forwarded": Malformed(
        "Backward",
        lambda c, s: backward_messages(s, np.ones((2, 4, 6, 6), np.float32), layer="never"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "no forward pass of layer 'never' at step 1 for this session (have nothing)",
    ),
    "backward-step-mismatch": Malformed(
        "Backward",
        _backward_step_mismatch,
        grpc.StatusCode.FAILED_PRECONDITION,
        "no forward pass of layer 'conv' at step 2 for this session (have step 1)",
    ),
    "backward-dy-shape-wrong": Malformed(
        "Backward",
        _backward_dy_shape_wrong,
        INVALID,
        "dy has shape (2, 5, 6, 6), expected (2, 4, 6, 6)",
    ),
}


def send_malformed(client: WorkerClient, channel: grpc.Channel, case: Malformed) -> None:
    error = refused(channel, case.method, case.build(client, _session()))
    assert error.code() == case.code, error.details()
    assert error.details().startswith(f"{case.method}: "), error.details()
    assert case.match in error.details()


@pytest.mark.parametrize("case", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_conv_request_is_refused_with_the_right_status(client, channel, case):
    send_malformed(client, channel, case)


PROBES = {
    "kernel-does-not-fit": (
        pb.ProbeRequest(n=1, c=2, h=4, w=4, k=3, kh=7, kw=7, padding=(0, 0, 0, 0)),
        "kernel 7x7 does not fit input 4x4",
    ),
    "padding-with-3-sides": (
        pb.ProbeRequest(n=1, c=2, h=4, w=4, k=3, kh=3, kw=3, padding=(1, 1, 1)),
        "padding must have 4 sides",
    ),
    "empty-shape": (
        pb.ProbeRequest(n=0, c=2, h=4, w=4, k=3, kh=3, kw=3, padding=(1, 1, 1, 1)),
        "empty convolution",
    ),
    "too-many-repeats": (
        pb.ProbeRequest(n=1, c=2, h=4, w=4, k=3, kh=3, kw=3, padding=(1, 1, 1, 1), repeats=21),
        "21 repeats, max 20",
    ),
}


@pytest.mark.parametrize("request_, match", list(PROBES.values()), ids=list(PROBES))
def test_malformed_probe_is_invalid_argument(channel, request_, match):
    with pytest.raises(grpc.RpcError) as info:
        probe_method(channel)(request_, timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith("probe: ")
    assert match in info.value.details()


def test_worker_still_serves_correctly_after_every_malformed_request(
    local_worker, client, channel, rng
):
    """Runs every refusal again itself, so it holds whatever order the tests run in."""
    for case in MALFORMED.values():
        send_malformed(client, channel, case)
    for request_, _ in PROBES.values():
        with pytest.raises(grpc.RpcError):
            probe_method(channel)(request_, timeout=TIMEOUT)

    assert local_worker.processes[0].poll() is None, "the worker process died"
    for service in ("", SERVICE):
        assert health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING
    x = rng.standard_normal((3, 5, 9, 9), dtype=np.float32)
    w = rng.standard_normal((7, 5, 3, 3), dtype=np.float32)
    b = rng.standard_normal(7, dtype=np.float32)
    y, _ = client.forward(_session(), 0, "after", x, w, b, PADDING)
    expected = reference("conv_forward", x, w, b, PADDING)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


# -- the request-size limit ----------------------------------------------------------------------


def test_request_over_max_request_mib_is_resource_exhausted(limited_worker):
    # x alone is 1 MiB; with w and b the request is over the 1 MiB limit.
    x = np.zeros((1, 4, 256, 256), np.float32)
    w = np.zeros((2, 4, 3, 3), np.float32)
    b = np.zeros(2, np.float32)
    with grpc.insecure_channel(limited_worker.address, options=wire.channel_options()) as ch:
        error = refused(ch, "Forward", forward_messages(_session(), arrays=(x, w, b)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert f"more than {1 << 20} bytes" in error.details()
    assert "limit of this worker" in error.details()


def test_request_under_max_request_mib_is_served(limited_worker, rng):
    client = WorkerClient(limited_worker.address)
    try:
        assert client.describe().max_request_bytes == 1 << 20
        x = rng.standard_normal((1, 4, 200, 200), dtype=np.float32)  # 640 kB
        w = rng.standard_normal((2, 4, 3, 3), dtype=np.float32)
        b = rng.standard_normal(2, dtype=np.float32)
        y, _ = client.forward(_session(), 0, "conv", x, w, b, PADDING)
    finally:
        client.close()
    expected = reference("conv_forward", x, w, b, PADDING)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


# -- graceful shutdown ---------------------------------------------------------------------------


@POSIX_ONLY
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_signal_stops_the_worker_gracefully(spawn_worker, signame):
    process = spawn_worker()
    address = process.wait_ready()
    client = WorkerClient(address)
    try:
        x, w, b = conv_tensors()
        client.forward(_session(), 0, "conv", x, w, b, PADDING)  # one request served
    finally:
        client.close()

    process.popen.send_signal(getattr(signal, signame))
    output = _stopped_cleanly(process, signame)
    assert f"hetconv worker on {address} stopped after 1 requests" in output


def _stopped_cleanly(process: WorkerProcess, after: str) -> str:
    """Wait for the worker to exit 0 without a traceback; returns its output."""
    try:
        status = process.popen.wait(10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"worker still running 10 s after {after}:\n{process.output()}")
    output = process.output()
    assert status == 0, output
    assert "Traceback" not in output
    return output


def test_exit_on_stdin_close_stops_when_the_launcher_goes(spawn_worker):
    process = spawn_worker("--exit-on-stdin-close", stdin=subprocess.PIPE)
    address = process.wait_ready()
    process.popen.stdin.write("anything written is ignored\n")
    process.popen.stdin.flush()
    time.sleep(0.5)
    assert process.popen.poll() is None, process.output()
    with grpc.insecure_channel(address) as channel:
        assert health_status(channel, "") == health_pb2.HealthCheckResponse.SERVING

    process.popen.stdin.close()  # what the kernel does when the launcher dies, SIGKILL or not
    output = _stopped_cleanly(process, "its stdin closed")
    assert f"hetconv worker on {address} stopped after" in output


def test_exit_on_stdin_close_worker_stopped_by_sigterm_exits_without_a_fatal_error(spawn_worker):
    # The launcher stops the worker while it still holds the worker's stdin open (as
    # benchmarks/gpu_vs_torch.py does): the thread that waits for the end of input is then
    # blocked in a read at shutdown, which with sys.stdin's buffered reader ended the process
    # with "Fatal Python error: _enter_buffered_busy" (status -6).
    process = spawn_worker("--exit-on-stdin-close", stdin=subprocess.PIPE)
    address = process.wait_ready()
    process.popen.send_signal(signal.SIGTERM)
    output = _stopped_cleanly(process, "SIGTERM")
    assert "Fatal Python error" not in output
    assert f"hetconv worker on {address} stopped after" in output


# A worker whose ready line is written to an object that signals the process itself in the
# middle of that write: deterministically, the earliest moment a launcher could react to it.
SIGNAL_AT_READY = """
import os, signal, sys
from hetconv.calls import READY
from hetconv.worker.main import run_worker

class SignalAtReady:
    def write(self, text):
        sys.stdout.write(text)
        if text.startswith(READY):
            sys.stdout.flush()
            os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        return len(text)

    def flush(self):
        sys.stdout.flush()

sys.exit(run_worker("127.0.0.1:0", "cpu", out=SignalAtReady(), startup_probe=False))
"""


@POSIX_ONLY
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_signal_sent_at_the_ready_line_stops_the_worker_gracefully(signame):
    run = subprocess.run(
        [sys.executable, "-c", SIGNAL_AT_READY, signame],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=TIMEOUT,
    )
    assert READY in run.stdout, run.stdout + run.stderr
    assert run.returncode == 0, f"status {run.returncode}: {run.stdout}{run.stderr}"
    assert "stopped after 0 requests" in run.stdout
    assert "Traceback" not in run.stderr


# -- the command line ----------------------------------------------------------------------------


def hetconv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetconv", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=TIMEOUT,
    )


def test_worker_help_mentions_listen():
    run = hetconv("worker", "--help")
    assert run.returncode == 0, run.stderr
    assert "--listen" in run.stdout
    assert "--max-request-mib" in run.stdout


def test_worker_with_a_nonsense_address_is_a_one_line_usage_error():
    run = hetconv("worker", "--listen", "nonsense", "--no-startup-probe")
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("hetconv worker: error: ") and "nonsense" in lines[0]
    assert "Traceback" not in run.stderr + run.stdout


def test_worker_on_a_port_already_in_use_is_a_one_line_error():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = hetconv("worker", "--listen", f"127.0.0.1:{port}", "--no-startup-probe")
    assert run.returncode != 0
    assert "Traceback" not in run.stderr + run.stdout
    assert READY not in run.stdout
    ours = ("hetconv: ", "hetconv worker: ")
    errors = [line for line in run.stderr.splitlines() if line.startswith(ours)]
    assert len(errors) == 1, run.stderr
    assert errors[0].startswith(f"hetconv worker: error: cannot listen on 127.0.0.1:{port}")
    assert run.stderr.rstrip().endswith(errors[0])  # the last word is ours, not gRPC's


def test_second_worker_on_the_port_of_a_running_worker_is_refused(spawn_worker, address):
    process = spawn_worker(listen=address)
    bound = process.wait_settled()
    if bound is not None:
        process.stop()  # at once: while it lives it takes connections meant for the other
    assert bound is None, f"a second worker started serving on {address}:\n{process.output()}"
    assert process.popen.wait(10) != 0
    assert "hetconv worker: error: cannot listen on" in process.output()
