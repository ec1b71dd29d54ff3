"""Who may use a worker: the token, TLS, the open-worker warning, request bounds, no pickle.

Every claim about a worker is checked on real worker processes over loopback sockets: calls
without the right token are refused with UNAUTHENTICATED on every RPC (unary and streaming,
health included) and do no work (the worker's request counter stays put); the right token gives
correct results and trains exactly like local training; TLS with the right CA works, with a
wrong one fails at once with a message that says why. One in-process test holds the token
check against a service of every streaming kind with a spy behind it.
"""

from __future__ import annotations

import ast
import io
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import tokenize
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from threadpoolctl import threadpool_limits

from hetconv import wire
from hetconv.backends import ConvShape, Padding, get_backend
from hetconv.calls import READY
from hetconv.conv import LocalConv
from hetconv.master.client import WorkerAuthError, WorkerClient, WorkerUnavailable
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers, stop_processes
from hetconv.proto import worker_pb2 as pb
from hetconv.security import TOKEN_ENV, bearer_metadata, resolve_token
from hetconv.training import TrainConfig, train
from hetconv.worker.auth import TokenInterceptor, WorkerSecurity, is_loopback, open_worker_warning
from hetconv.worker.main import available_memory_bytes, default_max_request_bytes
from hetconv.worker.service import ConvWorkerService, start_server

SERVICE = "hetconv.v1.ConvWorker"
TIMEOUT = 20.0  # seconds for any call or process step: a hang fails instead of stalling
TOKEN = "test-token-Zx8_q"
OTHER_TOKEN = "env-token-9Kp-w"
PADDING = (1, 1, 1, 1)
ROOT = Path(__file__).resolve().parents[1]
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def _env(token: str | None = None) -> dict[str, str]:
    """The environment of a worker process: one BLAS thread, and ``token`` (or none at all,
    whatever this shell has) in HETCONV_TOKEN."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop(TOKEN_ENV, None)
    if token is not None:
        env[TOKEN_ENV] = token
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = "1"
    return env


def reference(operation: str, *args):
    """The cpu backend's answer computed as the single-threaded worker computes it."""
    with threadpool_limits(limits=1):
        return getattr(get_backend("cpu"), operation)(*args)


def _session() -> int:
    return random.getrandbits(64)


class WorkerProcess:
    """``python -m hetconv worker --no-startup-probe ...``, stdout and stderr kept apart."""

    def __init__(self, *args: str, listen: str = "127.0.0.1:0", token_env: str | None = None):
        command = [sys.executable, "-m", "hetconv", "worker", "--listen", listen]
        self.popen = subprocess.Popen(
            [*command, "--no-startup-probe", "--backend", "cpu", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_env(token_env),
            text=True,
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.address: str | None = None
        self._settled = threading.Event()
        self._readers = [
            threading.Thread(target=self._drain, args=(self.popen.stdout, self.stdout, True)),
            threading.Thread(target=self._drain, args=(self.popen.stderr, self.stderr, False)),
        ]
        for reader in self._readers:
            reader.daemon = True
            reader.start()

    def _drain(self, stream, lines: list[str], watch: bool) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))
            if watch and line.startswith(READY):
                self.address = line[len(READY) :].strip()
                self._settled.set()
        if watch:
            self._settled.set()

    def wait_ready(self) -> str:
        assert self._settled.wait(TIMEOUT), f"worker said nothing useful in {TIMEOUT} s"
        assert self.address is not None, f"worker did not start:\n{self.output()}"
        return self.address

    def output(self) -> str:
        return "\n".join(self.stdout + self.stderr)

    def stop(self) -> str:
        """Stop it (SIGTERM: graceful) and return its stdout."""
        stop_processes([self.popen])
        for reader in self._readers:
            reader.join(5)
        return "\n".join(self.stdout)


@pytest.fixture
def spawn_worker() -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def spawn(*args: str, **kwargs) -> WorkerProcess:
        started.append(WorkerProcess(*args, **kwargs))
        return started[-1]

    yield spawn
    for process in started:
        process.stop()


# -- certificates --------------------------------------------------------------------------------

_OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
x509_extensions = ext
prompt = no
[dn]
CN = {cn}
[ext]
subjectAltName = {san}
basicConstraints = critical, CA:TRUE
"""


def self_signed(directory: Path, name: str, san: str = "IP:127.0.0.1, DNS:localhost"):
    """A self-signed certificate (its own CA) for ``san``: returns (cert, key) paths.

    Made with the ``openssl`` command and a config file (no ``-addext``, which LibreSSL lacks).
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no `openssl` command to make a test certificate with")
    config = directory / f"{name}.cnf"
    config.write_text(_OPENSSL_CONFIG.format(cn=name, san=san))
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    run = subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", str(key), "-out", str(cert), "-config", str(config)],
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    if run.returncode != 0:
        pytest.skip(f"openssl could not make a test certificate: {run.stderr.strip()}")
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    """``cert``/``key``: the worker's, for 127.0.0.1 and localhost; ``other``: an unrelated CA;
    ``elsewhere``: a certificate for another host name only."""
    directory = tmp_path_factory.mktemp("certs")
    cert, key = self_signed(directory, "worker")
    other, _ = self_signed(directory, "other")
    elsewhere, elsewhere_key = self_signed(directory, "elsewhere", san="DNS:elsewhere.example")
    return {
        "cert": cert,
        "key": key,
        "other": other,
        "elsewhere": elsewhere,
        "elsewhere_key": elsewhere_key,
    }


# -- the workers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_workers() -> Iterator[list[str]]:
    """Two plain-gRPC workers that require TOKEN (given through LocalWorkers' environment)."""
    with LocalWorkers(2, startup_timeout=60, token=TOKEN) as workers:
        # The token travels in the environment, never on the command line (`ps` shows that).
        assert all(TOKEN not in " ".join(p.args) for p in workers.processes)
        yield workers.addresses


@pytest.fixture(scope="module")
def address(token_workers) -> str:
    return token_workers[0]


@pytest.fixture(scope="module")
def channel(address) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(address, options=wire.channel_options()) as ch:
        grpc.channel_ready_future(ch).result(timeout=TIMEOUT)
        yield ch


@pytest.fixture(scope="module")
def tls_worker(certs) -> Iterator[WorkerProcess]:
    """A TLS worker whose --token (TOKEN) must win over its HETCONV_TOKEN (OTHER_TOKEN)."""
    process = WorkerProcess(
        "--tls-cert", str(certs["cert"]), "--tls-key", str(certs["key"]), "--token", TOKEN,
        "--max-request-mib", "64", token_env=OTHER_TOKEN,
    )  # fmt: skip
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


# -- raw calls, each a valid request of one RPC --------------------------------------------------


def conv_tensors(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 6, 6), dtype=np.float32)
    w = rng.standard_normal((4, 3, 3, 3), dtype=np.float32)
    b = rng.standard_normal(4, dtype=np.float32)
    return x, w, b


def forward_request(session: int, step: int = 1) -> tuple[pb.ConvMessage, list[np.ndarray]]:
    arrays = list(conv_tensors())
    heads = [wire.tensor_header(n, a) for n, a in zip("xwb", arrays, strict=True)]
    request = pb.ConvRequest(
        phase=pb.FORWARD, session=session, step=step, layer="conv", padding=PADDING,
        tensors=heads,
    )  # fmt: skip
    return pb.ConvMessage(header=request), arrays


def backward_request(session: int, step: int = 1) -> tuple[pb.ConvMessage, list[np.ndarray]]:
    dy = np.ones((2, 4, 6, 6), np.float32)
    request = pb.ConvRequest(
        phase=pb.BACKWARD, session=session, step=step, layer="conv", need_input_grad=True,
        tensors=[wire.tensor_header("dy", dy)],
    )  # fmt: skip
    return pb.ConvMessage(header=request), [dy]


def echo_request(session: int, step: int = 1) -> tuple[pb.ConvMessage, list[np.ndarray]]:
    t = np.arange(10, dtype=np.float32)
    request = pb.ConvRequest(phase=pb.PHASE_UNSPECIFIED, tensors=[wire.tensor_header("t", t)])
    return pb.ConvMessage(header=request), [t]


def _unary(channel, name, request_type, response_type):
    return channel.unary_unary(
        f"/{SERVICE}/{name}",
        request_serializer=request_type.SerializeToString,
        response_deserializer=response_type.FromString,
    )


def _streamed(name: str, build):
    def call(channel, metadata, session):
        head, arrays = build(session)
        method = channel.stream_stream(
            f"/{SERVICE}/{name}",
            request_serializer=wire.serialize_message,
            response_deserializer=wire.deserialize_message,
        )
        messages = [head, *wire.data_chunks(arrays)]
        return list(method(iter(messages), timeout=TIMEOUT, metadata=metadata))

    return call


def _bundled(name: str, build):
    def call(channel, metadata, session):
        head, arrays = build(session)
        method = channel.unary_unary(
            f"/{SERVICE}/{name}Bundle",
            request_serializer=wire.serialize_bundle,
            response_deserializer=wire.deserialize_bundle,
        )
        segments = [v for a in arrays for v in wire.byte_segments(a)]
        return method(wire.Bundle(head, segments), timeout=TIMEOUT, metadata=metadata)

    return call


def _describe(channel, metadata, session):
    method = _unary(channel, "Describe", pb.DescribeRequest, pb.DeviceDescription)
    return method(pb.DescribeRequest(), timeout=TIMEOUT, metadata=metadata)


def _probe(channel, metadata, session):
    method = _unary(channel, "Probe", pb.ProbeRequest, pb.ProbeResult)
    request = pb.ProbeRequest(n=2, c=3, h=8, w=8, k=4, kh=3, kw=3, padding=PADDING, repeats=1)
    return method(request, timeout=TIMEOUT, metadata=metadata)


def _health_check(channel, metadata, session):
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service="")
    return stub.Check(request, timeout=TIMEOUT, metadata=metadata)


def _health_watch(channel, metadata, session):  # unary request, streamed answer
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service=SERVICE)
    return next(iter(stub.Watch(request, timeout=TIMEOUT, metadata=metadata)))


def _unknown_method(channel, metadata, session):
    method = _unary(channel, "NoSuchMethod", pb.DescribeRequest, pb.DeviceDescription)
    return method(pb.DescribeRequest(), timeout=TIMEOUT, metadata=metadata)


CALLS: dict[str, Callable] = {
    "Describe": _describe,
    "Probe": _probe,
    "Forward-stream": _streamed("Forward", forward_request),
    "Forward-bundle": _bundled("Forward", forward_request),
    "Backward-stream": _streamed("Backward", backward_request),
    "Backward-bundle": _bundled("Backward", backward_request),
    "Echo-stream": _streamed("Echo", echo_request),
    "Echo-bundle": _bundled("Echo", echo_request),
    "Health-Check": _health_check,
    "Health-Watch": _health_watch,
    "unknown-method": _unknown_method,
}

CREDENTIALS: dict[str, tuple | None] = {
    "no-token": None,
    "wrong-token": bearer_metadata("wrong-" + TOKEN),
    "token-without-Bearer": (("authorization", TOKEN),),
    "empty-authorization": (("authorization", ""),),
}


def refused(call: Callable, channel: grpc.Channel, metadata, session: int) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(channel, metadata, session)
    return info.value


def forward_with(client: WorkerClient, session: int, step: int = 1) -> None:
    """A successful Forward of ``forward_request``'s tensors, checked against the reference."""
    x, w, b = conv_tensors()
    y, _ = client.forward(session, step, "conv", x, w, b, PADDING)
    np.testing.assert_allclose(y, reference("conv_forward", x, w, b, PADDING), rtol=1e-5, atol=1e-6)


# -- calls without the right token ---------------------------------------------------------------


@pytest.mark.parametrize("credential", list(CREDENTIALS), ids=list(CREDENTIALS))
@pytest.mark.parametrize("name", list(CALLS), ids=list(CALLS))
def test_call_without_the_right_token_is_unauthenticated(channel, address, name, credential):
    session = _session()
    if name.startswith("Backward"):
        # A Backward that would succeed with the token: its Forward is there.
        client = WorkerClient(address, token=TOKEN)
        try:
            forward_with(client, session)
        finally:
            client.close()
    error = refused(CALLS[name], channel, CREDENTIALS[credential], session)
    assert error.code() == UNAUTHENTICATED, error.details()
    expected = "requires a token" if credential == "no-token" else "wrong token"
    assert expected in error.details()


def test_refused_calls_do_no_work(spawn_worker):
    """A fresh worker: every refused call, then the authorized ones; it counts only those."""
    process = spawn_worker(token_env=TOKEN)  # the token through HETCONV_TOKEN
    address = process.wait_ready()
    client = WorkerClient(address, token=TOKEN)
    session = _session()
    try:
        forward_with(client, session)  # request 1: the Forward the refused Backwards would use
        with grpc.insecure_channel(address, options=wire.channel_options()) as channel:
            for name, call in CALLS.items():
                for credential in ("no-token", "wrong-token"):
                    error = refused(call, channel, CREDENTIALS[credential], session)
                    assert error.code() == UNAUTHENTICATED, f"{name}: {error.details()}"
        # Request 2: the Backward the refused ones did not disturb, and correct.
        dy = np.ones((2, 4, 6, 6), np.float32)
        dx, dw, db, _ = client.backward(session, 1, "conv", dy, True, answer_bytes=1)
        x, w, _ = conv_tensors()
        want_dw, want_db = reference("conv_grad_kernels", x, dy, (3, 3), PADDING)
        np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(db, want_db, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            dx, reference("conv_grad_input", dy, w, (6, 6), PADDING), rtol=1e-5, atol=1e-5
        )
    finally:
        client.close()
    stdout = process.stop()
    assert f"hetconv worker on {address} stopped after 2 requests" in stdout, process.output()
    assert "security: token required, no TLS (plain text on the wire)" in stdout
    limit = [line for line in stdout.splitlines() if line.startswith("max request: ")]
    assert len(limit) == 1 and "half the" in limit[0] and "--max-request-mib" in limit[0]
    assert not any(line.startswith("WARNING") for line in process.stderr), process.stderr


class SpyBackend:
    """The cpu backend, recording every method called on it."""

    def __init__(self):
        self.inner = get_backend("cpu")
        self.calls: list[str] = []

    def __getattr__(self, name):
        attribute = getattr(self.inner, name)
        if not callable(attribute):
            return attribute

        def spy(*args, **kwargs):
            self.calls.append(name)
            return attribute(*args, **kwargs)

        return spy


def test_refused_calls_never_reach_the_service_or_its_device():
    """In process, so the device itself can be watched: not even Describe touches it."""
    backend = SpyBackend()
    service = ConvWorkerService(backend)
    server, address = start_server(service, "127.0.0.1:0", WorkerSecurity(token=TOKEN))
    try:
        with grpc.insecure_channel(address, options=wire.channel_options()) as channel:
            for name, call in CALLS.items():
                for credential, metadata in CREDENTIALS.items():
                    error = refused(call, channel, metadata, _session())
                    assert error.code() == UNAUTHENTICATED, f"{name}, {credential}"
            assert backend.calls == [] and service.requests == 0
            assert _describe(channel, bearer_metadata(TOKEN), 0).backend == "cpu"
            assert backend.calls == ["describe"]
    finally:
        server.stop(None)


def test_every_streaming_kind_is_refused_before_its_handler_runs():
    """The interceptor on a server with one method of each kind (the worker has no
    stream-unary method); the refusal matches the method's kind, so each fails cleanly."""
    ran: list[str] = []

    def unary_unary(request, context):
        ran.append("unary_unary")
        return request

    def unary_stream(request, context):
        ran.append("unary_stream")
        yield request

    def stream_unary(requests, context):
        ran.append("stream_unary")
        return b"".join(requests)

    def stream_stream(requests, context):
        ran.append("stream_stream")
        yield from requests

    handlers = {
        "UnaryUnary": grpc.unary_unary_rpc_method_handler(unary_unary),
        "UnaryStream": grpc.unary_stream_rpc_method_handler(unary_stream),
        "StreamUnary": grpc.stream_unary_rpc_method_handler(stream_unary),
        "StreamStream": grpc.stream_stream_rpc_method_handler(stream_stream),
    }
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2), interceptors=[TokenInterceptor(TOKEN)]
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    right = bearer_metadata(TOKEN)
    twice = (*right, *bearer_metadata("wrong"))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            calls = {
                "UnaryUnary": lambda md: channel.unary_unary("/t.T/UnaryUnary")(
                    b"x", timeout=TIMEOUT, metadata=md
                ),
                "UnaryStream": lambda md: list(
                    channel.unary_stream("/t.T/UnaryStream")(b"x", timeout=TIMEOUT, metadata=md)
                ),
                "StreamUnary": lambda md: channel.stream_unary("/t.T/StreamUnary")(
                    iter([b"x", b"y"]), timeout=TIMEOUT, metadata=md
                ),
                "StreamStream": lambda md: list(
                    channel.stream_stream("/t.T/StreamStream")(
                        iter([b"x", b"y"]), timeout=TIMEOUT, metadata=md
                    )
                ),
            }
            for name, call in calls.items():
                for metadata in (
                    None,
                    bearer_metadata("wrong"),
                    twice,
                    (("authorization", TOKEN),),
                ):
                    with pytest.raises(grpc.RpcError) as info:
                        call(metadata)
                    assert info.value.code() == UNAUTHENTICATED, (name, metadata)
            assert ran == []
            assert calls["UnaryUnary"](right) == b"x"
            assert calls["UnaryStream"](right) == [b"x"]
            assert calls["StreamUnary"](right) == b"xy"
            assert calls["StreamStream"](right) == [b"x", b"y"]
            assert sorted(ran) == ["stream_stream", "stream_unary", "unary_stream", "unary_unary"]
    finally:
        server.stop(None)


# -- the right token -----------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["bundle", "stream"])
def test_right_token_gives_correct_results(address, rng, size):
    # "stream": x is 1.28 MB, over the one-message limit, so both directions stream in chunks.
    n, hw = (1, 8) if size == "bundle" else (4, 100)
    x = rng.standard_normal((n, 8, hw, hw), dtype=np.float32)
    w = rng.standard_normal((5, 8, 3, 3), dtype=np.float32)
    b = rng.standard_normal(5, dtype=np.float32)
    client = WorkerClient(address, token=TOKEN)
    session = _session()
    try:
        assert client.describe().backend == "cpu"
        assert client.probe(ConvShape(2, 4, 8, 8, 6, 3, 3, Padding(1, 1, 1, 1)), repeats=1) > 0
        y, stats = client.forward(session, 3, "conv", x, w, b, PADDING)
        assert stats.bundled == (size == "bundle")
        np.testing.assert_allclose(
            y, reference("conv_forward", x, w, b, PADDING), rtol=1e-5, atol=1e-5
        )
        dy = rng.standard_normal(y.shape, dtype=np.float32)
        answer = None if size == "stream" else w.nbytes + b.nbytes + x.nbytes
        dx, dw, _, stats = client.backward(session, 3, "conv", dy, True, answer_bytes=answer)
        assert stats.bundled == (size == "bundle")
        np.testing.assert_allclose(
            dw, reference("conv_grad_kernels", x, dy, (3, 3), PADDING)[0], rtol=1e-4, atol=1e-4
        )
        np.testing.assert_allclose(
            dx, reference("conv_grad_input", dy, w, (hw, hw), PADDING), rtol=1e-4, atol=1e-4
        )
    finally:
        client.close()


def test_health_answers_with_the_token(channel):
    metadata = bearer_metadata(TOKEN)
    for call in (_health_check, _health_watch):
        assert call(channel, metadata, 0).status == health_pb2.HealthCheckResponse.SERVING


def test_wrong_token_is_one_clear_line_from_the_client(address):
    for token, message in (
        ("wrong-" + TOKEN, f"worker {address} refused the token (UNAUTHENTICATED)"),
        (None, f"worker {address} requires a token (UNAUTHENTICATED)"),
    ):
        client = WorkerClient(address, connect_timeout=5, token=token)
        try:
            with pytest.raises(WorkerAuthError) as info:
                client.describe()
            assert str(info.value).startswith(message) and "\n" not in str(info.value)
            assert info.value.code == UNAUTHENTICATED
            with pytest.raises(WorkerAuthError):  # every call, not only the first
                x, w, b = conv_tensors()
                client.forward(_session(), 0, "conv", x, w, b, PADDING)
        finally:
            client.close()


def test_training_through_the_cluster_with_a_token_matches_local(token_workers, tmp_path):
    small = dict(steps=3, batch=8, train_size=32, eval_size=16, progress=False)
    results = {}
    for name in ("local", "cluster"):
        weights = tmp_path / f"{name}.npz"
        config = TrainConfig(save=str(weights), **small)
        if name == "local":
            result = train(config, LocalConv(), log=io.StringIO())
        else:
            # Shares forced so both workers certainly compute part of both layers.
            shares = {"conv1": (3, 2, 3), "conv2": (5, 6, 5)}
            cluster_config = ClusterConfig(token=TOKEN, shares=shares)
            with Cluster(token_workers, config=cluster_config) as cluster:
                result = train(config, cluster, log=io.StringIO())
                assert {k: p.shares for k, p in cluster.plans.items()} == shares
        results[name] = result, dict(np.load(weights))
    (got, got_weights), (want, want_weights) = results["cluster"], results["local"]
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-6)
    for key, value in want_weights.items():
        np.testing.assert_allclose(got_weights[key], value, rtol=0, atol=1e-6)


def test_secrets_stay_out_of_repr(certs):
    security = WorkerSecurity.from_files(TOKEN, certs["cert"], certs["key"])
    assert security.tls and TOKEN not in repr(security) and "PRIVATE KEY" not in repr(security)


# -- TLS -----------------------------------------------------------------------------------------


def test_tls_with_the_right_ca_works(tls_worker, certs):
    client = WorkerClient(tls_worker.address, token=TOKEN, tls_ca=certs["cert"])
    try:
        info = client.describe()
        assert info.max_request_bytes == 64 << 20  # --max-request-mib overrides the default
        forward_with(client, _session())
    finally:
        client.close()
    assert "security: token required, TLS" in tls_worker.stdout
    assert "max request: 64 MiB" in tls_worker.stdout


def test_tls_worker_by_its_dns_name_works(tls_worker, certs):
    port = tls_worker.address.rsplit(":", 1)[1]
    client = WorkerClient(f"localhost:{port}", token=TOKEN, tls_ca=certs["cert"])
    try:
        assert client.describe().backend == "cpu"
    finally:
        client.close()


def test_token_flag_wins_over_the_environment(tls_worker, certs):
    client = WorkerClient(tls_worker.address, token=OTHER_TOKEN, tls_ca=certs["cert"])
    try:
        with pytest.raises(WorkerAuthError, match="refused the token"):
            client.describe()
    finally:
        client.close()
    assert resolve_token("flag", {TOKEN_ENV: "env"}) == "flag"
    assert resolve_token(None, {TOKEN_ENV: "env"}) == "env"
    assert resolve_token(None, {TOKEN_ENV: ""}) is None
    assert resolve_token(None, {}) is None


@pytest.mark.parametrize(
    "ca, match",
    [("other", "its certificate is not signed by the CA in"), (None, "needs --tls-ca")],
    ids=["wrong-ca", "no-tls-at-all"],
)
def test_tls_without_the_right_ca_fails_at_once_with_unavailable(tls_worker, certs, ca, match):
    tls_ca = certs[ca] if ca else None
    start = time.monotonic()
    client = WorkerClient(tls_worker.address, connect_timeout=2, token=TOKEN, tls_ca=tls_ca)
    try:
        with pytest.raises(WorkerUnavailable) as info:
            client.describe()
    finally:
        client.close()
    message = str(info.value)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert message.startswith(f"worker {tls_worker.address}: ") and "\n" not in message
    assert match in message, message
    if ca:  # a certificate problem is reported at once, not after connect_timeout
        assert time.monotonic() - start < 1.5
        assert "TLS handshake failed (UNAVAILABLE)" in message


def test_wrong_ca_fails_every_call_not_only_describe(tls_worker, certs):
    client = WorkerClient(tls_worker.address, token=TOKEN, tls_ca=certs["other"])
    try:
        with pytest.raises(WorkerUnavailable, match="TLS handshake failed") as info:
            x, w, b = conv_tensors()
            client.forward(_session(), 0, "conv", x, w, b, PADDING, timeout=5)
    finally:
        client.close()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_certificate_for_another_host_is_refused(spawn_worker, certs):
    process = spawn_worker(
        "--tls-cert", str(certs["elsewhere"]), "--tls-key", str(certs["elsewhere_key"])
    )
    address = process.wait_ready()
    client = WorkerClient(address, connect_timeout=2, tls_ca=certs["elsewhere"])
    try:
        with pytest.raises(WorkerUnavailable, match="does not name 127.0.0.1"):
            client.describe()
    finally:
        client.close()


def test_tls_client_to_a_plain_worker_says_it_serves_no_tls(address, certs):
    client = WorkerClient(address, connect_timeout=2, token=TOKEN, tls_ca=certs["cert"])
    try:
        with pytest.raises(WorkerUnavailable, match="does not serve TLS"):
            client.describe()
    finally:
        client.close()


# -- the open-worker warning ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "listen, loopback",
    [
        ("127.0.0.1:5", True), ("127.8.9.1:5", True), ("[::1]:5", True), ("localhost:5", True),
        ("LocalHost:5", True), ("0.0.0.0:5", False), ("[::]:5", False), ("192.168.1.7:5", False),
        ("10.0.0.1:5", False), ("laptop.lan:5", False),
    ],
)  # fmt: skip
def test_is_loopback(listen, loopback):
    assert is_loopback(listen) is loopback
    warning = open_worker_warning(listen, WorkerSecurity())
    assert (warning is None) is loopback
    assert open_worker_warning(listen, WorkerSecurity(token=TOKEN)) is None


def test_worker_open_to_the_network_without_a_token_warns_loudly(spawn_worker):
    process = spawn_worker(listen="0.0.0.0:0")
    port = process.wait_ready().rsplit(":", 1)[1]
    client = WorkerClient(f"127.0.0.1:{port}")  # it serves, and anyone may call
    try:
        assert client.describe().backend == "cpu"
    finally:
        client.close()
    process.stop()
    warning = [line for line in process.stderr if line.startswith("WARNING: ")]
    assert len(warning) >= 3, process.output()
    text = "\n".join(warning)
    assert "WITHOUT A TOKEN" in text and "anyone on the network" in text
    assert TOKEN_ENV in text and "--token" in text
    assert not any("WARNING" in line for line in process.stdout)  # on stderr only
    assert "security: no token (anyone may call)" in "\n".join(process.stdout)


@pytest.mark.slow
def test_worker_open_to_the_network_with_a_token_does_not_warn(spawn_worker):
    process = spawn_worker("--token", TOKEN, listen="0.0.0.0:0")
    process.wait_ready()
    process.stop()
    assert not any("WARNING" in line for line in process.stderr), process.output()


# -- request size --------------------------------------------------------------------------------


def test_default_request_limit_is_half_the_available_memory_at_most_2_gib(tmp_path):
    assert default_max_request_bytes(64 << 30) == 2 << 30
    assert default_max_request_bytes(3 << 30) == 3 << 29
    assert default_max_request_bytes(1 << 10) == 1 << 20  # never below 1 MiB
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  8000000 kB\nMemFree:  100 kB\nMemAvailable:  3000000 kB\n")
    assert available_memory_bytes(meminfo) == 3_000_000 * 1024
    fallback = available_memory_bytes(tmp_path / "absent")  # sysconf, or None where it has none
    assert fallback is None or fallback > 0


def test_worker_prints_its_default_request_limit(address):
    client = WorkerClient(address, token=TOKEN)
    try:
        limit = client.describe().max_request_bytes
    finally:
        client.close()
    available = available_memory_bytes()
    assert limit <= 2 << 30
    if available is not None and available > 4 << 30:
        assert limit == 2 << 30


# -- nothing from the wire is unpickled or evaluated ---------------------------------------------

PACKAGES = ("hetconv", "master", "worker", "simulations")
UNPICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal"}


def _forbidden(path: Path) -> list[str]:
    """Code (not comments or strings) that unpickles or evaluates: pickle-like modules,
    builtin ``eval(``/``exec(`` (``model.eval()`` and ``def eval(`` are a method, not the
    builtin), and
    ``allow_pickle=True``."""
    found = []
    with path.open("rb") as f:
        tokens = [
            t for t in tokenize.tokenize(f.readline) if t.type in (tokenize.NAME, tokenize.OP)
        ]
    for i, token in enumerate(tokens):
        before = tokens[i - 1].string if i else ""
        after = [t.string for t in tokens[i + 1 : i + 3]]
        where = f"{path.relative_to(ROOT)}:{token.start[0]}"
        if token.string in UNPICKLERS:
            found.append(f"{where}: {token.string}")
        elif token.string in ("eval", "exec") and after[:1] == ["("] and before not in (".", "def"):
            found.append(f"{where}: {token.string}(")
        elif token.string == "allow_pickle" and after[:1] == ["="] and after[1:] != ["False"]:
            found.append(f"{where}: allow_pickle={''.join(after[1:])}")
    return found


def test_no_package_source_unpickles_or_evaluates_anything():
    sources = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    assert len(sources) > 20, "the package sources were not found"
    found = [hit for path in sources for hit in _forbidden(path)]
    allowed = [hit for hit in found if hit.startswith(os.path.join("hetconv", "cifar.py") + ":")]
    assert [hit for hit in found if hit not in allowed] == []
    # hetconv/cifar.py unpickles the CIFAR-10 files (their official format), and only those:
    # one function, reading a local file, in a module that has no way to the network.
    assert allowed and all(hit.endswith(": pickle") for hit in allowed), allowed
    tree = ast.parse((ROOT / "hetconv" / "cifar.py").read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (
            node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]
        )
    }
    # Files only: the CIFAR tarball is read with tarfile, .npz with numpy (never pickled data:
    # allow_pickle=False) and zipfile's check, images with Pillow.
    assert imported <= {
        "__future__", "os", "pickle", "dataclasses", "pathlib", "numpy", "typing", "math",
        "tarfile", "zipfile", "collections", "PIL",
    }  # fmt: skip
    # No plain pickle.load/loads: the one unpickler is _CifarUnpickler, a pickle.Unpickler
    # whose find_class admits only the globals genuine CIFAR-10 files name, and only
    # _read_cifar_batch uses it.
    uses = [
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name) and node.value.id == "pickle"
    ]  # fmt: skip
    assert uses == ["Unpickler"], uses
    unpicklers = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and any(ast.unparse(base) == "pickle.Unpickler" for base in node.bases)
    ]
    assert [node.name for node in unpicklers] == ["_CifarUnpickler"]
    assert "find_class" in {f.name for f in unpicklers[0].body if isinstance(f, ast.FunctionDef)}
    loaders = [
        function.name
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef)
        for node in ast.walk(function)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and node.func.id == "_CifarUnpickler"
    ]  # fmt: skip
    assert loaders == ["_read_cifar_batch"]
    # The worker side never loads a dataset.
    for path in (ROOT / "worker").rglob("*.py"):
        assert "hetconv.data" not in path.read_text() and "from .data" not in path.read_text()


# -- the command line ----------------------------------------------------------------------------


def hetconv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetconv", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env or _env(),
        timeout=TIMEOUT * 2,
    )


# What hetconv itself says starts with its name, and the command's when it has one.
COMMAND_PREFIXES = ("hetconv: ", "hetconv train: ", "hetconv worker: ")


def _one_error_line(run: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in run.stderr + run.stdout, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith(COMMAND_PREFIXES)]
    assert len(errors) == 1, run.stderr
    assert run.stderr.rstrip().endswith(errors[0])
    return errors[0]


def test_worker_with_a_missing_certificate_is_a_one_line_error(certs, tmp_path):
    missing = tmp_path / "missing.pem"
    run = hetconv(
        "worker", "--listen", "127.0.0.1:0", "--no-startup-probe", "--backend", "cpu",
        "--tls-cert", str(missing), "--tls-key", str(certs["key"]),
    )  # fmt: skip
    assert run.returncode == 2
    line = _one_error_line(run)
    assert line == (
        f"hetconv worker: error: cannot read TLS certificate (--tls-cert) {missing}: "
        "No such file or directory"
    )
    assert READY not in run.stdout


@pytest.mark.parametrize(
    "args, match",
    [
        (["--tls-cert", "CERT"], "TLS needs both --tls-cert and --tls-key"),
        (["--tls-cert", "CERT", "--tls-key", "NOTPEM"], "is not a PEM file"),
        (["--tls-cert", "CERT", "--tls-key", "OTHERKEY"], "does not belong to the certificate"),
        (["--token", ""], "--token is empty"),
        (["--token", "two words"], "visible ASCII without spaces"),
    ],
    ids=["cert-without-key", "key-not-pem", "key-of-another-cert", "empty-token", "space"],
)
def test_worker_security_mistakes_are_one_line_errors(certs, tmp_path, args, match):
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    files = {
        "CERT": str(certs["cert"]),
        "NOTPEM": str(not_pem),
        "OTHERKEY": str(certs["elsewhere_key"]),
    }
    args = [files.get(a, a) for a in args]
    run = hetconv("worker", "--listen", "127.0.0.1:0", "--no-startup-probe", "--backend", "cpu",
                  *args)  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert match in _one_error_line(run)


def test_train_with_a_missing_ca_file_is_a_one_line_error(tmp_path):
    missing = tmp_path / "ca.pem"
    run = hetconv("train", "--worker", "127.0.0.1:9", "--tls-ca", str(missing), "--steps", "1")
    assert run.returncode == 2
    assert _one_error_line(run) == (
        f"hetconv train: error: cannot read TLS CA certificate (--tls-ca) {missing}: "
        "No such file or directory"
    )


def test_train_with_a_wrong_token_is_a_one_line_error(address):
    run = hetconv(
        "train", "--worker", address, "--steps", "1", "--batch", "4", "--train-size", "8",
        "--eval-size", "4", "--no-progress", env=_env("wrong-" + TOKEN),
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert _one_error_line(run) == (
        f"hetconv train: error: worker {address} refused the token (UNAUTHENTICATED)"
    )


def test_embedded_default_with_a_token_trains():
    """`hetconv train` with no worker named and HETCONV_TOKEN set: its local workers require
    the token (given through their environment) and the master sends it."""
    run = hetconv(
        "train", "--local-workers", "1", "--steps", "2", "--batch", "4", "--train-size", "8",
        "--eval-size", "4", "--no-progress", env=_env(TOKEN),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    output = run.stdout + run.stderr
    assert "starting 1 local worker" in output and "127.0.0.1:" in output, output
