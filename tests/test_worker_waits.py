"""Waits that end: a call that only waits takes no call slot, health says when no call can be
taken, and SIGTERM stops a worker whatever it waits on. Real ``hetconv worker`` processes.

A FetchPart for a part that never comes is the wait a stranger can start with a hundred bytes;
before, 16 of them took every call slot for 600 s (every Forward refused while health said
SERVING) and SIGTERM waited for them.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from test_worker_budget import wait_for, worker_memory
from test_worker_process import (
    POSIX_ONLY,
    TIMEOUT,
    WorkerProcess,
    _session,
    forward_messages,
    health_status,
    probe_method,
    reference,
    stream_method,
)

from hetconv.calls import FETCH_PART
from hetconv.master.client import WorkerClient
from hetconv.proto import worker_pb2 as pb
from hetconv.wire import Bundle

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def spawn() -> Iterator:
    started: list[WorkerProcess] = []

    def start(*args: str) -> WorkerProcess:
        process = WorkerProcess("--backend", "cpu", "--threads", "1", *args)
        started.append(process)
        process.wait_ready()
        return process

    yield start
    for process in started:
        process.stop()


def _fetch_part_that_never_comes(channel: grpc.Channel, timeout: float | None = None):
    """A FetchPart of a split block this worker never ran: it waits (no deadline: as long as
    the worker lets it)."""
    request = pb.ConvRequest(
        phase=FETCH_PART.phase, session=_session(), step=1, layer="block",
        part=pb.TensorPart(source=1, gradient=False),
    )  # fmt: skip
    return FETCH_PART.bundle.stub(channel).future(
        Bundle(pb.ConvMessage(header=request), []), timeout=timeout
    )


def _forward_works(address: str) -> None:
    client = WorkerClient(address)
    try:
        rng = np.random.default_rng(1)
        x = rng.standard_normal((2, 3, 8, 8), dtype=np.float32)
        w = rng.standard_normal((4, 3, 3, 3), dtype=np.float32)
        b = np.zeros(4, np.float32)
        y, _ = client.forward(_session(), 1, "conv", x, w, b, (1, 1, 1, 1), timeout=TIMEOUT)
        np.testing.assert_allclose(
            y, reference("conv_forward", x, w, b, (1, 1, 1, 1)), rtol=1e-5, atol=1e-5
        )
    finally:
        client.close()


def test_calls_that_only_wait_take_no_call_slot(spawn):
    """Four FetchParts waiting for a part that never comes, on a worker taking 2 calls at once:
    two wait (their own bound, --max-calls), two are refused naming it, and a Forward is still
    answered while health says SERVING (before: both slots taken, the Forward refused)."""
    worker = spawn("--max-calls", "2", "--idle-timeout", "30")
    with grpc.insecure_channel(worker.address) as channel:
        calls = [_fetch_part_that_never_comes(channel) for _ in range(4)]
        held = wait_for(
            lambda: (
                (m := worker_memory(channel))["waiting"] + sum(c.done() for c in calls) == 4 and m
            ),
            "every FetchPart waiting or refused",
        )
        refused = [c for c in calls if c.done()]
        assert held["waiting"] == 2 and held["calls"] == 0 and len(refused) == 2
        for call in refused:
            assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 calls waiting on other workers' parts" in call.details()
            assert "--max-calls 2" in call.details()
        assert health_status(channel, "") == SERVING
        _forward_works(worker.address)
        for call in calls:
            call.cancel()
        wait_for(lambda: worker_memory(channel)["waiting"] == 0, "the waiting calls ended")


def test_health_says_not_serving_while_every_call_slot_is_taken(spawn):
    """Two Forwards whose clients stall after the header take both slots of --max-calls 2:
    health says NOT_SERVING (one more call would be refused), and SERVING again once one
    ends (before: SERVING throughout)."""
    worker = spawn("--max-calls", "2", "--idle-timeout", "30")
    release = threading.Event()

    def stalled() -> Iterator[pb.ConvMessage]:
        rng = np.random.default_rng(0)
        layer = (
            rng.standard_normal((2, 3, 8, 8), dtype=np.float32),
            rng.standard_normal((4, 3, 3, 3), dtype=np.float32),
            np.zeros(4, np.float32),
        )
        yield forward_messages(_session(), layer)[0]  # the header, then nothing
        release.wait(TIMEOUT)

    with grpc.insecure_channel(worker.address) as channel:
        calls = [stream_method(channel, "Forward")(stalled()) for _ in range(2)]
        try:
            wait_for(lambda: health_status(channel, "") == NOT_SERVING, "health NOT_SERVING")
            assert health_status(channel, "hetconv.v1.ConvWorker") == NOT_SERVING
            assert worker_memory(channel)["calls"] == 2
            calls[0].cancel()
            wait_for(lambda: health_status(channel, "") == SERVING, "health SERVING again")
        finally:
            release.set()
            for call in calls:
                call.cancel()
    _forward_works(worker.address)


@pytest.mark.slow
@POSIX_ONLY
def test_sigterm_stops_a_worker_that_waits_within_seconds(spawn):
    """SIGTERM while a FetchPart waits with no deadline on a worker that never ends idle calls
    (--idle-timeout 0): the worker exits 0 within a few seconds, saying it stopped (before: it
    waited out the part's 600 s)."""
    worker = spawn("--idle-timeout", "0")
    with grpc.insecure_channel(worker.address) as channel:
        call = _fetch_part_that_never_comes(channel)
        wait_for(
            lambda: (m := worker_memory(channel)).get("waiting", 0) + m["calls"] == 1,
            "the FetchPart waiting",
        )
        start = time.monotonic()
        worker.popen.send_signal(signal.SIGTERM)
        try:
            status = worker.popen.wait(15)  # a bound for a hang; measured ~3 s (the grace)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker still running 15 s after SIGTERM:\n{worker.output()}")
        seconds = time.monotonic() - start
        call.cancel()
    output = worker.output()
    assert status == 0, output
    assert "stopped after" in output and "Traceback" not in output
    assert seconds < 15


@pytest.mark.slow
def test_a_call_whose_caller_goes_while_it_waits_for_the_device_never_runs(spawn):
    """Two Forwards queued behind a long Probe on the device, their callers gone (a 1 s
    deadline: time to be received and queued on a loaded machine) before their turn: their
    jobs are dropped, never computed for nobody (Describe's ``device_dropped``), and the worker
    answers the next Forward."""
    worker = spawn()
    with grpc.insecure_channel(worker.address) as channel:
        # about 15 GFLOP a repeat: seconds on one thread, however fast the machine
        probe = probe_method(channel).future(
            pb.ProbeRequest(
                n=16, c=64, h=64, w=64, k=64, kh=3, kw=3, padding=[1, 1, 1, 1],
                repeats=16, with_grad_input=True,
            ),
            timeout=120,
        )  # fmt: skip
        wait_for(lambda: worker_memory(channel)["calls"] == 1, "the probe in flight")
        time.sleep(0.3)  # on the device

        def queued() -> grpc.StatusCode:
            call = stream_method(channel, "Forward")(
                iter(forward_messages(_session())), timeout=1.0
            )
            try:
                list(call)
            except grpc.RpcError as e:
                return e.code()
            return grpc.StatusCode.OK

        results: list[grpc.StatusCode] = []
        threads = [threading.Thread(target=lambda: results.append(queued())) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        assert results == [grpc.StatusCode.DEADLINE_EXCEEDED] * 2
        assert not probe.done()
        probe.result()
        held = wait_for(
            lambda: (m := worker_memory(channel))["calls"] == 0 and m, "the calls ended"
        )
        assert held["device_dropped"] == 2
    _forward_works(worker.address)
