"""One memory budget for a whole worker: calls in flight, saved forward states, scratch.

The budget's rules are tested on :class:`MemoryBudget` directly; what they are for -- a worker
whose memory stays bounded under concurrent oversize requests, answers nobody reads and one
session saving under ever new layer names -- against real ``hetconv worker`` processes, reading
the worker's own accounting (Describe's ``hetconv-memory`` trailing metadata) and its resident
memory (``/proc/PID/status``, Linux).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from test_worker_process import (
    SERVICE,
    TIMEOUT,
    WorkerProcess,
    _env,
    _session,
    forward_messages,
    reference,
    stream_method,
)

from hetconv import wire
from hetconv.calls import DESCRIBE
from hetconv.master.client import WorkerClient, WorkerError
from hetconv.proto import worker_pb2 as pb
from hetconv.worker.budget import Holding, MemoryBudget, OverBudget
from hetconv.worker.service import MEMORY_METADATA, WorkerConfig

MIB = 1 << 20


@dataclass
class _State:
    step: int
    x: np.ndarray


def _state(mib: float, step: int = 1) -> _State:
    return _State(step, np.zeros(int(mib * MIB) // 4, np.float32))


# -- the budget's rules --------------------------------------------------------------------------


def test_a_call_that_does_not_fit_is_refused_naming_the_budget_and_what_it_holds():
    budget = MemoryBudget(10 * MIB, sessions=2, max_calls=4)
    with budget.call("Forward") as first:
        first.reserve(6 * MIB, "the first Forward")
        with budget.call("Forward") as second, pytest.raises(OverBudget) as info:
            second.reserve(5 * MIB, "this Forward")
        assert budget.holding().in_flight == 6 * MIB
    message = str(info.value)
    assert "this Forward needs 5.0 MiB more" in message
    assert "memory budget of 10.0 MiB (--memory-mib)" in message
    assert "6.0 MiB for 2 calls in flight" in message
    assert info.value.status == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert budget.holding() == Holding(10 * MIB, 0, 0, 0, 0, 0, 0)  # all released


def test_calls_over_the_limit_are_refused_and_their_slots_come_back():
    budget = MemoryBudget(10 * MIB, sessions=1, max_calls=2)
    with budget.call("Forward"), budget.call("Backward"):
        with pytest.raises(OverBudget, match=r"2 calls in flight.*--max-calls 2"):
            with budget.call("Echo"):
                pass
    with budget.call("Echo"), budget.call("Echo"):
        assert budget.holding().calls == 2


def test_a_saved_state_moves_from_its_call_and_is_never_counted_twice():
    budget = MemoryBudget(10 * MIB, sessions=1, max_calls=1)
    with budget.call("Forward") as call:
        call.reserve(7 * MIB, "this Forward")  # x, w and the answer
        budget.save(1, ("conv", 0), _state(4))  # x and w stay
        assert budget.holding().in_flight == 3 * MIB
        assert budget.holding().saved == 4 * MIB
    held = budget.holding()
    assert (held.in_flight, held.saved, held.states) == (0, 4 * MIB, 1)


def test_one_session_saving_under_new_names_drops_only_its_own_oldest_states():
    budget = MemoryBudget(12 * MIB, sessions=3, max_calls=4)  # 4 MiB per session
    other = _session()
    budget.save(other, ("conv1", 0), _state(3))
    session = _session()
    for i in range(50):
        budget.save(session, (f"layer{i}", 0), _state(1))
    assert budget.keys(session) == [(f"layer{i}", 0) for i in range(46, 50)]
    assert budget.saved(other, ("conv1", 0)) is not None  # another master's state stays
    assert budget.dropped(session, ("layer0", 0)).cause == "share"
    assert budget.dropped(session, ("layer49", 0)) is None
    held = budget.holding()
    assert held.saved == 7 * MIB and held.sessions == 2


def test_more_sessions_than_kept_evict_the_least_recently_used():
    budget = MemoryBudget(30 * MIB, sessions=2, max_calls=4)
    first, second, third = _session(), _session(), _session()
    for session in (first, second, third):
        budget.save(session, ("conv", 0), _state(1))
    assert budget.saved(first, ("conv", 0)) is None
    assert budget.dropped(first, ("conv", 0)).cause == "session"
    budget.save(first, ("conv", 0), _state(1))  # seen again: no longer remembered as dropped
    assert budget.dropped(first, ("conv", 0)) is None
    assert budget.saved(second, ("conv", 0)) is None  # now the least recently used went


def test_a_call_evicts_other_sessions_states_but_never_its_own():
    budget = MemoryBudget(10 * MIB, sessions=2, max_calls=4)
    mine, theirs = _session(), _session()
    budget.save(theirs, ("conv", 0), _state(4))
    budget.save(mine, ("conv", 0), _state(4))
    with budget.call("Forward") as call:
        call.reserve(2 * MIB, "a Forward that fits beside both")
        call.reserve(1 * MIB, "a Forward that needs their room", session=mine)
    assert budget.saved(theirs, ("conv", 0)) is None
    assert budget.dropped(theirs, ("conv", 0)).cause == "session"
    with budget.call("Forward") as call, pytest.raises(OverBudget, match="needs 7.0 MiB"):
        call.reserve(7 * MIB, "a Forward as big as everything but its own state", session=mine)
    assert budget.saved(mine, ("conv", 0)) is not None


def test_a_state_larger_than_a_sessions_share_is_refused_before_any_work():
    budget = MemoryBudget(10 * MIB, sessions=4, max_calls=1, reserved_bytes=2 * MIB)
    with pytest.raises(OverBudget) as info:
        budget.check_state(3 * MIB, "this Forward")
    assert "8.0 MiB of --memory-mib 10.0 MiB beside the device scratch, / 4 sessions" in str(
        info.value
    )
    with pytest.raises(OverBudget):
        budget.save(_session(), ("conv", 0), _state(3))
    assert budget.holding().saved == 0


def test_the_request_limit_may_not_exceed_the_memory_budget():
    with pytest.raises(ValueError, match="more than the whole memory budget of 64 MiB"):
        WorkerConfig(max_request_bytes=100 * MIB, memory_bytes=64 * MIB)
    run = subprocess.run(
        [sys.executable, "-m", "hetconv", "worker", "--memory-mib", "64",
         "--max-request-mib", "100", "--no-startup-probe", "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60, env=_env(),
    )  # fmt: skip
    assert run.returncode != 0
    assert "--max-request-mib 100 is more than --memory-mib 64" in run.stderr


# -- real worker processes -----------------------------------------------------------------------


def worker_memory(channel: grpc.Channel) -> dict[str, int]:
    """What the worker says it holds: Describe's ``hetconv-memory`` metadata, as numbers."""
    describe = channel.unary_unary(
        f"/{SERVICE}/{DESCRIBE.name}",
        request_serializer=pb.DescribeRequest.SerializeToString,
        response_deserializer=pb.DeviceDescription.FromString,
    )
    _, call = describe.with_call(pb.DescribeRequest(), timeout=TIMEOUT)
    (text,) = [value for key, value in call.trailing_metadata() if key == MEMORY_METADATA]
    return {k: int(v) for k, v in (item.split("=") for item in text.split(","))}


def rss_mib(pid: int) -> float | None:
    """Resident memory of process ``pid`` in MiB (Linux); None elsewhere."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def wait_for(condition, what: str, timeout: float = TIMEOUT):
    """Poll ``condition()`` until it returns something true (returned); fail naming ``what``
    after ``timeout`` seconds (a bound for a hang, not a speed claim)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"{what}: not after {timeout:g} s")


@pytest.fixture
def small_worker():
    """A worker with a 96 MiB budget (24 MiB of it device scratch), 4 sessions of 18 MiB."""
    process = WorkerProcess("--backend", "cpu", "--memory-mib", "96", "--idle-timeout", "30")
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def _big_answer_layer(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x 2 MiB, y 16 MiB (128 kernels, 'same' padding): 34 MiB reserved per call."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 16, 64, 64), dtype=np.float32)
    w = rng.standard_normal((128, 16, 3, 3), dtype=np.float32)
    return x, w, np.zeros(128, np.float32)


def test_concurrent_answers_nobody_reads_are_bounded_and_released(small_worker):
    """Eight clients send a 34 MiB Forward (2 MiB sent, 16 MiB answered) at once and never read
    the answer. The 72 MiB the budget leaves beside the scratch take two; the others are
    refused with RESOURCE_EXHAUSTED naming the budget, before anything is allocated. Once the
    silent clients cancel, the worker holds nothing again and answers correctly."""
    assert "memory: 96 MiB" in small_worker.output()
    channels = [
        grpc.insecure_channel(small_worker.address, options=wire.channel_options())
        for _ in range(8)
    ]
    try:
        calls = [
            stream_method(ch, "Forward")(iter(forward_messages(_session(), _big_answer_layer(i))))
            for i, ch in enumerate(channels)
        ]
        with grpc.insecure_channel(small_worker.address) as probe_channel:
            # Settled: every call refused, or in flight waiting for a reader that never comes,
            # its 34 MiB held (in flight, or its forward's state saved for a backward). A call
            # counts in "calls" from the moment it comes in: one still being admitted, to be
            # refused, once made "calls" read 3.
            held = wait_for(
                lambda: (
                    (m := worker_memory(probe_channel))["calls"] + sum(c.done() for c in calls)
                    == len(calls)
                    and m["in_flight"] + m["saved"] >= m["calls"] * 34 * MIB
                    and m
                ),
                "every call refused or held",
            )
            refused = [c for c in calls if c.done()]
            for call in refused:
                assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, call.details()
                assert "memory budget of 96.0 MiB (--memory-mib) holds" in call.details()
            assert 1 <= held["calls"] <= 2 and len(refused) >= 6
            assert 0 < held["in_flight"] <= held["budget"] - held["reserved"]
            rss = rss_mib(small_worker.popen.pid)
            # The process, not only its books: ~100 MiB here with two calls held; all eight held
            # (the worker before the budget) measured 524 MiB
            if rss is not None:
                assert rss < 200, rss
            for call in calls:
                call.cancel()
            wait_for(
                lambda: (m := worker_memory(probe_channel))["calls"] == 0 and not m["in_flight"],
                "the cancelled calls' memory released",
            )
        client = WorkerClient(small_worker.address)
        try:
            rng = np.random.default_rng(9)
            x = rng.standard_normal((2, 16, 64, 64), dtype=np.float32)
            w = rng.standard_normal((8, 16, 3, 3), dtype=np.float32)
            b = rng.standard_normal(8, dtype=np.float32)
            y, _ = client.forward(_session(), 1, "conv", x, w, b, (1, 1, 1, 1), timeout=TIMEOUT)
            np.testing.assert_allclose(
                y, reference("conv_forward", x, w, b, (1, 1, 1, 1)), rtol=1e-5, atol=1e-5
            )
        finally:
            client.close()
    finally:
        for ch in channels:
            ch.close()


def test_one_session_under_many_layer_names_stays_within_its_share(small_worker):
    """200 Forwards of one session, each under a new layer name and leaving 1 MiB for its
    Backward (200 MiB unbounded): the session keeps its 18 MiB share, its newest layer's
    Backward is answered, its oldest one's names the share as the cause, and the worker's
    resident memory does not grow by the 200 MiB."""
    client = WorkerClient(small_worker.address)
    session = _session()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 32, 32, 32), dtype=np.float32)  # 1 MiB
    w = rng.standard_normal((4, 32, 3, 3), dtype=np.float32)
    b = np.zeros(4, np.float32)
    pid = small_worker.popen.pid
    try:
        with grpc.insecure_channel(small_worker.address) as channel:
            rss_before = None
            for i in range(200):
                client.forward(session, 1, f"layer{i}", x, w, b, (1, 1, 1, 1), timeout=TIMEOUT)
                if i == 19:  # past the share: what the worker holds from here on stays
                    rss_before = rss_mib(pid)
            held = worker_memory(channel)
            share = (held["budget"] - held["reserved"]) // 4
            assert 0 < held["saved"] <= share and held["states"] <= share // (x.nbytes + w.nbytes)
            assert held["sessions"] == 1
            rss_after = rss_mib(pid)
            if rss_before is not None:
                assert rss_after - rss_before < 60, (rss_before, rss_after)
        dy = rng.standard_normal((8, 4, 32, 32), dtype=np.float32)
        _, dw, db, _ = client.backward(session, 1, "layer199", dy, False, timeout=TIMEOUT)
        want_dw, want_db = reference("conv_grad_kernels", x, dy, (3, 3), (1, 1, 1, 1))
        np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(db, want_db, rtol=1e-4, atol=1e-3)
        with pytest.raises(WorkerError) as info:
            client.backward(session, 1, "layer0", dy, False, timeout=TIMEOUT)
    finally:
        client.close()
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "share of the memory budget" in str(info.value) and "--memory-mib" in str(info.value)


def test_scratch_grown_by_an_oversize_call_is_trimmed_after_it():
    """A Forward whose device scratch (~105 MiB: lowered input and output of one image
    (1, 32, 256, 256) with 128 kernels; the cpu backend runs a batch in cache-sized chunks,
    so only a large image still grows it past the chunk) exceeds what a 160 MiB budget keeps
    (a quarter, 40 MiB) leaves no scratch behind: the worker's resident memory grows by the
    saved state (8 MiB), not by the scratch."""
    process = WorkerProcess("--backend", "cpu", "--memory-mib", "160")
    client = WorkerClient(process.wait_ready())
    rng = np.random.default_rng(0)
    try:
        small = (
            rng.standard_normal((2, 32, 64, 64), np.float32),
            rng.standard_normal((8, 32, 3, 3), np.float32),
            np.zeros(8, np.float32),
        )
        for step in range(3):
            client.forward(1, step, "small", *small, (1, 1, 1, 1), timeout=TIMEOUT)
        before = rss_mib(process.popen.pid)
        x = rng.standard_normal((1, 32, 256, 256), np.float32)
        w = rng.standard_normal((128, 32, 3, 3), np.float32)
        b = np.zeros(128, np.float32)
        y, _ = client.forward(2, 1, "big", x, w, b, (1, 1, 1, 1), timeout=TIMEOUT)
        np.testing.assert_allclose(
            y, reference("conv_forward", x, w, b, (1, 1, 1, 1)), rtol=1e-4, atol=1e-3
        )
        del y
        after = rss_mib(process.popen.pid)
        with grpc.insecure_channel(process.address) as channel:
            held = worker_memory(channel)
    finally:
        client.close()
        process.stop()
    assert held["scratch_trimmed"] == 1 and held["reserved"] == 40 * MIB
    if before is not None:
        assert after - before < 40, (before, after)


@pytest.mark.slow
def test_the_limits_are_documented_printed_and_checked():
    def worker(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "hetconv", "worker", *args],
            capture_output=True, text=True, timeout=60, env=_env(),
        )  # fmt: skip

    help_text = " ".join(worker("--help").stdout.split())
    for flag in ("--memory-mib MIB", "--max-calls N", "--idle-timeout S"):
        assert flag in help_text
    assert "default: half the memory available at start" in help_text
    for bad, why in (
        (("--idle-timeout", "-1"), "--idle-timeout: -1 must be at least 0"),
        (("--memory-mib", "0"), "--memory-mib: 0 must be at least 1"),
        (("--max-calls", "0"), "--max-calls: 0 must be at least 1"),
    ):
        run = worker(*bad)
        assert run.returncode == 2 and why in run.stderr, run.stderr
    process = WorkerProcess("--backend", "cpu", "--memory-mib", "300", "--idle-timeout", "0")
    try:
        process.wait_ready()
    finally:
        process.stop()
    lines = process.output().splitlines()
    (memory,) = [line for line in lines if line.startswith("memory: ")]
    assert memory.startswith("memory: 300 MiB for requests in flight")
    assert "at most 16 calls at once" in memory and "never ended for idling" in memory
    (limit,) = [line for line in lines if line.startswith("max request: ")]
    assert limit.startswith("max request: 300 MiB")  # at most the budget


def test_fused_stage_states_are_held_in_the_same_budget(small_worker):
    """Fused stage forwards (hetconv.stages) keep their state (input, widened kernels and the
    stage layers' saved arrays) in the one budget, bounded by the session's share like plain
    Forwards: 60 layer names of 1 MiB and more each stay within 18 MiB, and the oldest one's
    StageBackward names the share as the cause."""
    from hetconv.stages import StageSpec

    stage = StageSpec.from_entries([{"type": "relu"}, {"type": "maxpool", "kernel": 2}])
    client = WorkerClient(small_worker.address)
    session = _session()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 32, 32, 32), dtype=np.float32)  # 1 MiB
    w = rng.standard_normal((4, 32, 3, 3), dtype=np.float32)
    b = np.zeros(4, np.float32)
    try:
        with grpc.insecure_channel(small_worker.address) as channel:
            for i in range(60):
                client.stage_forward(
                    session, 1, f"stage{i}", x, w, b, (1, 1, 1, 1), stage, slice(0, 4),
                    timeout=TIMEOUT,
                )  # fmt: skip
                if i == 0:
                    one = worker_memory(channel)["saved"]
                    assert one > x.nbytes  # the stage's own arrays are counted too
            held = worker_memory(channel)
            share = (held["budget"] - held["reserved"]) // 4
            assert 0 < held["saved"] <= share and held["states"] <= share // one
        dy = rng.standard_normal((8, 4, 16, 16), dtype=np.float32)
        client.stage_backward(session, 1, "stage59", dy, 0, False, timeout=TIMEOUT)
        with pytest.raises(WorkerError) as info:
            client.stage_backward(session, 1, "stage0", dy, 0, False, timeout=TIMEOUT)
    finally:
        client.close()
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "share of the memory budget" in str(info.value)


# -- what a worker holds beyond a call: resident slices ------------------------------------------


def _place(client: WorkerClient, session: int, layer: str, w, mw=None, mf=None) -> None:
    from hetconv.optim import SGDConfig

    k = w.shape[0]
    b = np.zeros(k, np.float32)
    mw = np.zeros_like(w) if mw is None else mw
    head = None
    if mf is not None:
        head = (np.zeros_like(mf), mf)
    client.place_kernels(
        session, layer, 0, 1, w, b, mw, b.copy(), True, SGDConfig(), timeout=TIMEOUT, head=head
    )


def test_resident_slices_are_held_in_the_budget_and_refused_by_name():
    """One session placing 12 MiB resident slices (kernels and momentum) under 40 layer names
    on a worker with --memory-mib 256: the placements that fit are held (Describe's ``held``),
    the first that does not is refused with RESOURCE_EXHAUSTED naming the layer and the budget,
    before anything is copied, and the worker's resident memory stays near the budget (before:
    all 40 held, 480 MiB beyond it). The worker still serves: a held layer placed again, and a
    Forward. Momentum holding NaN or Inf is refused, as a layer beyond a session's 256."""
    process = WorkerProcess("--backend", "cpu", "--memory-mib", "256")
    client = WorkerClient(process.wait_ready())
    session = _session()
    w = np.random.default_rng(5).standard_normal((384, 256, 4, 4), dtype=np.float32)  # 6 MiB
    try:
        with grpc.insecure_channel(process.address) as channel:
            placed = 0
            with pytest.raises(WorkerError) as info:
                for placed in range(40):
                    _place(client, session, f"conv{placed}", w)
            held = worker_memory(channel)
            assert 5 <= placed < 40
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"resident slice of layer 'conv{placed}'" in str(info.value)
            assert "memory budget of 256.0 MiB (--memory-mib)" in str(info.value)
            assert held["held"] == placed * 2 * w.nbytes + placed * 2 * 384 * 4
            assert held["held"] + held["in_flight"] + held["saved"] + held["reserved"] <= 256 * MIB
            rss = rss_mib(process.popen.pid)
            if rss is not None:
                assert rss < 420, rss  # the budget, the interpreter, and the last request
            _place(client, session, "conv0", w)  # a layer held is replaced, not added
            assert worker_memory(channel)["held"] == held["held"]

            small = np.ones((2, 3, 3, 3), np.float32)
            nan = small.copy()
            nan[0, 0, 0, 0] = np.nan
            with pytest.raises(WorkerError, match=r"mw or mb \(the momentum\) holds NaN") as bad:
                _place(client, _session(), "conv", small, mw=nan)
            assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
            inf = np.full((2, 4, 10), np.inf, np.float32)
            with pytest.raises(WorkerError, match=r"mf \(the split head's columns' momentum\)"):
                _place(client, _session(), "conv", small, mf=inf)

            from hetconv.worker.resident import MAX_LAYERS

            many = _session()
            for i in range(MAX_LAYERS):
                _place(client, many, f"layer{i}", small)
            with pytest.raises(WorkerError, match="the most one session may place") as cap:
                _place(client, many, "one more", small)
            assert cap.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            _place(client, many, "layer0", small)  # placed again: no new layer
        x = np.ones((1, 3, 4, 4), np.float32)
        client.forward(_session(), 1, "plain", x, small, np.zeros(2, np.float32), (1, 1, 1, 1))
    finally:
        client.close()
        process.stop()


def test_parts_put_by_peers_are_held_in_the_budget(small_worker):
    """PutPart of 16 MiB block outputs under new block names: what the parts hold shows in
    Describe's ``held`` and counts against the one budget, so the first that does not fit is
    refused naming the budget and what it holds (before: outside the budget, up to half of
    it)."""
    client = WorkerClient(small_worker.address)
    part = np.ones((16, 16, 128, 128), np.float32)  # 16 MiB
    session = _session()
    try:
        with grpc.insecure_channel(small_worker.address) as channel:
            with pytest.raises(WorkerError) as info:
                for put in range(8):
                    client.put_part(session, 1, f"block{put}", 1, part, False, timeout=TIMEOUT)
            held = worker_memory(channel)
    finally:
        client.close()
    assert put >= 2 and held["held"] == put * part.nbytes
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "the split's parts needs" in str(info.value)
    assert "memory budget of 96.0 MiB (--memory-mib) holds" in str(info.value)
