"""Clients that stall cannot starve a worker: real ``hetconv worker`` processes on loopback.

A stalled client sends a header and then nothing, or never reads its answer. Each such call is
ended after the worker's ``--idle-timeout`` with DEADLINE_EXCEEDED naming it, and while they
last, health checks, Describe and a well-behaved master's calls are still answered: the handler
pool is larger than the calls in flight (``--max-calls``), one connection may hold at most a
few calls (``grpc.max_concurrent_streams``), and a call over the limit is refused at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_worker_budget import wait_for, worker_memory
from test_worker_process import (
    PADDING,
    TIMEOUT,
    WorkerProcess,
    _session,
    conv_tensors,
    forward_messages,
    reference,
    stream_method,
)

from hetconv import wire
from hetconv.master.client import WorkerClient

IDLE = 4.0  # the workers' --idle-timeout here, seconds


class Stalled:
    """A Forward stream that sends its header (and ``chunks`` data messages) and then blocks
    until :meth:`release`; its status is read on a thread of its own."""

    def __init__(self, channel: grpc.Channel, chunks: int = 0):
        self._release = threading.Event()
        messages = forward_messages(_session(), _big_request())
        self.call = stream_method(channel, "Forward")(self._messages(messages[: 1 + chunks]))

    def _messages(self, messages: list) -> Iterator:
        yield from messages
        self._release.wait()

    def release(self) -> None:
        self._release.set()


def _big_request() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = np.zeros((4, 16, 64, 64), np.float32)  # 1 MiB: header first, data in chunks after
    w = np.zeros((8, 16, 3, 3), np.float32)
    return x, w, np.zeros(8, np.float32)


def hostile_channel(address: str) -> grpc.Channel:
    """A channel with a connection of its own, as another machine's would have: channels of
    equal arguments in one process share their connection (gRPC's global subchannel pool)."""
    options = [*wire.channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    return grpc.insecure_channel(address, options=options)


def _health(channel: grpc.Channel, timeout: float) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout).status


@pytest.fixture
def worker() -> Iterator[WorkerProcess]:
    process = WorkerProcess("--backend", "cpu", "--idle-timeout", str(IDLE))
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.mark.slow
def test_stalled_streams_leave_health_and_a_real_master_served_and_end_named(worker):
    """Eight streams on one connection send a header and stall (the issue: they took every
    handler thread, health timed out and a master's Forward waited 30 s). Health answers within
    a second, a second client's Forward is answered correctly, and every stalled stream ends
    with DEADLINE_EXCEEDED naming the idle timeout, after which the worker holds nothing."""
    hostile = hostile_channel(worker.address)
    stalled = [Stalled(hostile, chunks=i % 2) for i in range(8)]
    try:
        with grpc.insecure_channel(worker.address) as channel:
            wait_for(lambda: worker_memory(channel)["calls"] == 8, "eight stalled calls in flight")
            assert _health(channel, timeout=1.0) == health_pb2.HealthCheckResponse.SERVING
            client = WorkerClient(worker.address)
            try:
                x, w, b = conv_tensors()
                y, _ = client.forward(_session(), 1, "conv", x, w, b, PADDING, timeout=TIMEOUT)
            finally:
                client.close()
            # answered while every stalled stream still held its call: it waited for none
            assert worker_memory(channel)["idle_ended"] == 0
            assert not any(s.call.done() for s in stalled)
            np.testing.assert_allclose(
                y, reference("conv_forward", x, w, b, PADDING), rtol=1e-5, atol=1e-6
            )
            for s in stalled:
                assert s.call.code() == grpc.StatusCode.DEADLINE_EXCEEDED, s.call.details()
                assert f"--idle-timeout is {IDLE:g} s" in s.call.details()
                assert s.call.details().startswith("Forward: no message from the client")
            held = wait_for(
                lambda: (m := worker_memory(channel))["calls"] == 0 and m, "the calls gone"
            )
            assert held["in_flight"] == 0 and held["idle_ended"] == 8
    finally:
        for s in stalled:
            s.release()
        hostile.close()


@pytest.mark.slow
def test_a_client_that_never_reads_its_answer_is_ended_and_its_memory_released(worker):
    """A Forward whose 16 MiB answer the client never reads: the handler blocks on flow
    control, is ended after the idle timeout, and its reservation comes back."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 16, 64, 64), dtype=np.float32)
    w = rng.standard_normal((128, 16, 3, 3), dtype=np.float32)
    with hostile_channel(worker.address) as silent:
        call = stream_method(silent, "Forward")(
            iter(forward_messages(_session(), (x, w, np.zeros(128, np.float32))))
        )
        with grpc.insecure_channel(worker.address) as channel:
            held = wait_for(
                lambda: (m := worker_memory(channel))["in_flight"] > 0 and m, "the call admitted"
            )
            assert held["calls"] == 1
            held = wait_for(
                lambda: (m := worker_memory(channel))["calls"] == 0 and m,
                "the unread call ended by the worker",
            )
            assert held["in_flight"] == 0 and held["idle_ended"] == 1
        # What the client finally reads: the chunks sent before the stall, then the status.
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
        assert "none taken from it" in info.value.details()


def test_calls_over_the_limit_are_refused_at_once_naming_it():
    process = WorkerProcess("--backend", "cpu", "--max-calls", "2", "--idle-timeout", "30")
    channels = [hostile_channel(process.wait_ready()) for _ in range(3)]
    stalled = [Stalled(ch) for ch in channels[:2]]
    try:
        wait_for(lambda: worker_memory(channels[2])["calls"] == 2, "two stalled calls in flight")
        third = stream_method(channels[2], "Forward")(iter(forward_messages(_session())))
        with pytest.raises(grpc.RpcError) as info:
            list(third)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 calls in flight" in info.value.details()
        assert "--max-calls 2" in info.value.details()
        # answered beside the full slots, and saying no call can be taken now
        assert _health(channels[2], timeout=1.0) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        for s in stalled:
            s.release()
            s.call.cancel()
        for ch in channels:
            ch.close()
        process.stop()
