"""What the master says, and how soon, when a worker's address is wrong or the worker goes.

Real processes on loopback: a port nobody listens on, a plain TCP server that answers garbage,
a worker stopped with SIGINT mid-call, and a worker with more masters than ``--sessions``.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from test_worker_process import POSIX_ONLY, WorkerProcess, _env, _session, conv_tensors

from hetconv.backends import ConvShape, Padding
from hetconv.master.client import WorkerClient, WorkerError, WorkerUnavailable

TIMEOUT = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def garbage_server() -> Iterator[str]:
    """A process serving plain TCP that answers every connection with an SSH-like banner."""
    script = textwrap.dedent(
        """
        import socket, sys
        server = socket.create_server(("127.0.0.1", 0))
        print(server.getsockname()[1], flush=True)
        while True:
            conn, _ = server.accept()
            try:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6 not gRPC at all\\r\\n")
                conn.recv(1024)
            except OSError:
                pass
            conn.close()
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        port = int(process.stdout.readline())
        yield f"127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait(10)


def _describe_error(address: str, connect_timeout: float = TIMEOUT) -> tuple[str, float]:
    client = WorkerClient(address, connect_timeout=connect_timeout)
    start = time.monotonic()
    try:
        with pytest.raises(WorkerUnavailable) as info:
            client.describe()
    finally:
        client.close()
    return str(info.value), time.monotonic() - start


# -- item 1: a wrong port fails fast, saying what is there -----------------------------------


def test_a_port_nobody_listens_on_fails_fast_naming_the_refusal():
    address = f"127.0.0.1:{_free_port()}"
    message, seconds = _describe_error(address)
    assert seconds < 5.0, f"waited {seconds:.1f} s for a refused connection"
    assert message.startswith(f"worker {address}: nothing listens on {address}"), message
    assert "connection refused" in message
    assert "tls" not in message.lower() and "\n" not in message


def test_a_server_that_does_not_speak_grpc_fails_at_once_saying_so(garbage_server):
    message, seconds = _describe_error(garbage_server)
    assert seconds < 3.0, f"waited {seconds:.1f} s for a server that does not speak gRPC"
    assert f"{garbage_server} does not speak gRPC (" in message, message
    assert "HTTP/2" in message
    assert "tls" not in message.lower() and "\n" not in message


def test_a_worker_that_comes_up_within_the_grace_is_still_reached(tmp_path):
    port = _free_port()
    address = f"127.0.0.1:{port}"
    started: list[WorkerProcess] = []

    def start_late():
        time.sleep(0.3)
        started.append(WorkerProcess("--backend", "cpu", listen=address))

    thread = threading.Thread(target=start_late)
    thread.start()
    client = WorkerClient(address, connect_timeout=TIMEOUT)
    try:
        thread.join()
        started[0].wait_ready()
        assert client.describe().backend == "cpu"
    finally:
        client.close()
        for process in started:
            process.stop()


# -- item 2: event reasons are cut at a word, with an ellipsis -------------------------------


def test_event_reasons_keep_whole_words():
    from hetconv.master.events import short_reason

    detail = "worker 127.0.0.1:5: no answer; " + "last error: UNKNOWN: ipv4 refused " * 20
    short = short_reason(detail + "\nsecond line", limit=200)
    assert len(short) <= 200 and short.endswith("…")
    assert detail.startswith(short[:-1]) and detail[len(short) - 1] == " "  # a word boundary
    assert short_reason("one line\ntwo") == "one line"
    assert short_reason("x" * 500, limit=100) == "x" * 99 + "…"


def test_an_unreachable_worker_event_names_the_cause_whole(garbage_server):
    """The event line for a garbage port: the whole reason, not ``UNKNOW``."""
    from hetconv.master.events import short_reason

    client = WorkerClient(garbage_server, connect_timeout=TIMEOUT)
    try:
        with pytest.raises(WorkerUnavailable) as info:
            client.describe()
    finally:
        client.close()
    reason = short_reason(str(info.value))
    assert reason == str(info.value) or reason.endswith("…")
    assert "does not speak gRPC" in reason


# -- item 3: a worker stopped with Ctrl-C -----------------------------------------------------


@pytest.mark.slow
@POSIX_ONLY
def test_a_worker_stopped_mid_call_is_reported_as_shut_down():
    process = WorkerProcess("--backend", "cpu")
    try:
        client = WorkerClient(process.wait_ready(), connect_timeout=TIMEOUT)
        client.describe()
        # About a second a run here, twenty runs: still busy when the 5 s grace ends.
        shape = ConvShape(64, 64, 64, 64, 128, 5, 5, Padding(2, 2, 2, 2))
        threading.Timer(1.0, process.popen.send_signal, (signal.SIGINT,)).start()
        with pytest.raises(WorkerUnavailable) as info:
            client.probe(shape, repeats=20, timeout=120)
        client.close()
    finally:
        process.popen.kill()
        process.stop()
    message = str(info.value)
    assert "the worker shut down (cancelled its calls" in message, message


# -- item 4: more masters than --sessions ------------------------------------------------------


def _forward(client: WorkerClient, session: int) -> np.ndarray:
    x, w, b = conv_tensors()
    y, _ = client.forward(session, 1, "conv", x, w, b, (1, 1, 1, 1), timeout=TIMEOUT)
    return y


def test_sessions_evicted_by_other_masters_are_named_as_the_cause():
    process = WorkerProcess("--backend", "cpu", "--sessions", "2")
    try:
        client = WorkerClient(process.wait_ready(), connect_timeout=TIMEOUT)
        first, second, third = _session(), _session(), _session()
        y = _forward(client, first)
        _forward(client, second)
        client.backward(second, 1, "conv", np.ones_like(y), False, timeout=TIMEOUT)  # kept
        _forward(client, third)  # a third master: the first one's inputs go
        with pytest.raises(WorkerError) as info:
            client.backward(first, 1, "conv", np.ones_like(y), False, timeout=TIMEOUT)
        client.backward(third, 1, "conv", np.ones_like(y), False, timeout=TIMEOUT)
        # a session seen again is no longer remembered as evicted
        _forward(client, first)
        client.backward(first, 1, "conv", np.ones_like(y), False, timeout=TIMEOUT)
        client.close()
    finally:
        process.stop()
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    message = str(info.value)
    assert "make room for another master" in message and "keeps 2 sessions" in message
    assert "--sessions" in message and "have nothing" not in message
    assert "sessions: 2 masters at once" in process.output()


def test_sessions_option_is_documented_and_checked():
    run = subprocess.run(
        [sys.executable, "-m", "hetconv", "worker", "--help"],
        capture_output=True, text=True, timeout=60, env=_env(),
    )  # fmt: skip
    assert run.returncode == 0 and "--sessions N" in run.stdout
    assert "masters it serves at once" in " ".join(run.stdout.split())
    run = subprocess.run(
        [sys.executable, "-m", "hetconv", "worker", "--sessions", "0"],
        capture_output=True, text=True, timeout=60, env=_env(),
    )  # fmt: skip
    assert run.returncode == 2 and "--sessions" in run.stderr
