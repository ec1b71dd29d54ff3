"""Nothing lost: workers that die, hang, restart, join or lie mid-training cost time, never a
step or a weight.

Real worker processes on loopback (one liar is a real gRPC server in this process). Each run
is disturbed at a chosen step and layer through a hook in the cluster, and must end with the
weights and per-step losses of undisturbed local training. Tolerance: losses rtol 1e-5 and
weights atol 1e-5; the only differences are float32 summation orders (the master recomputing
a lost worker's slice adds its input-gradient part in another order).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from hetconv.backends import get_backend
from hetconv.calls import READY as READY_LINE
from hetconv.conv import LocalConv
from hetconv.master import connecting
from hetconv.master.cluster import ACTIVE, READY, Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.training import TrainConfig, train
from hetconv.worker.service import ConvWorkerService, start_server

pytestmark = pytest.mark.skipif(os.name != "posix", reason="stops and kills with POSIX signals")

RUN = dict(steps=10, batch=8, train_size=64, eval_size=16, progress=False)
FAST = dict(deadline_floor=1.0, deadline_factor=5.0, retry_min=0.2, retry_max=1.0)


class Disturbed(Cluster):
    """A cluster that runs ``actions[(step, layer)]`` just before that layer's forward call
    (layer None: before the step begins)."""

    def __init__(self, addresses, actions, **config):
        super().__init__(addresses, config=ClusterConfig(**{**FAST, **config}))
        self.actions = actions

    def begin_step(self, step):
        action = self.actions.get((step, None))
        if action:
            action(self)
        super().begin_step(step)

    def forward(self, layer, x, w, b, padding):
        action = self.actions.get((self.step, layer))
        if action and x.shape[0] == RUN["batch"]:  # training, not the final evaluation
            action(self)
        return super().forward(layer, x, w, b, padding)


def _train(tmp_path, name, executor, trace=None, **overrides):
    weights = tmp_path / f"{name}.npz"
    config = TrainConfig(save=str(weights), trace=trace, **{**RUN, **overrides})
    result = train(config, executor, log=io.StringIO())
    return result.losses, dict(np.load(weights))


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("local"), "local", LocalConv())


def _same_as_local(got, local):
    losses, weights = got
    np.testing.assert_allclose(losses, local[0], rtol=1e-5)
    for name in weights:
        np.testing.assert_allclose(weights[name], local[1][name], rtol=0, atol=1e-5)


def _wait_for(cluster, address, states=(READY, ACTIVE), timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for node in cluster.nodes + cluster._pending:
            if node.name == address and node.state in states:
                return
        time.sleep(0.05)
    raise AssertionError(f"{address} did not come back within {timeout} s")


def _kinds(cluster):
    return [(e["event"], e.get("worker"), e["step"]) for e in cluster.events]


SHARES = {"conv1": (3, 3, 2), "conv2": (6, 5, 5)}


def test_worker_killed_mid_step(local, tmp_path):
    with LocalWorkers(2) as workers:
        victim = workers.processes[1]

        def kill(cluster):
            victim.kill()
            victim.wait()

        # Killed after conv1's forward at step 3: its conv2 forward and both backward calls
        # of that step fail and the master covers them.
        with Disturbed(workers.addresses, {(3, "conv2"): kill}, shares=SHARES) as cluster:
            got = _train(tmp_path, "killed", cluster)
            events = _kinds(cluster)
            plans = {name: plan.shares for name, plan in cluster.plans.items()}
    _same_as_local(got, local)
    assert ("worker_lost", workers.addresses[1], 3) in events
    assert all(shares[2] == 0 for shares in plans.values())  # dropped from the shares


def test_worker_hung_then_resumed_rejoins(local, tmp_path):
    with LocalWorkers(2) as workers:
        pid = workers.processes[0].pid
        address = workers.addresses[0]

        def hang(cluster):
            os.kill(pid, signal.SIGSTOP)

        def resume(cluster):
            os.kill(pid, signal.SIGCONT)
            _wait_for(cluster, address)

        actions = {(2, "conv1"): hang, (5, None): resume}
        trace = tmp_path / "trace.jsonl"
        with Disturbed(workers.addresses, actions, shares=SHARES) as cluster:
            got = _train(tmp_path, "hung", cluster, trace=str(trace))
            events = _kinds(cluster)
            shares_after = cluster.plans["conv2"].shares
    _same_as_local(got, local)
    assert ("worker_lost", address, 2) in events
    assert ("worker_rejoined", address, 5) in events
    assert shares_after[1] > 0  # computing again (probe-driven shares after the rejoin)
    records = [__import__("json").loads(line) for line in trace.read_text().splitlines()]
    assert any(e["event"] == "worker_lost" for r in records for e in r.get("events", []))
    steps = [r for r in records if "step" in r]  # the final evaluation's record comes last
    assert address in steps[-1]["nodes"]


def test_worker_restarted_on_its_port_rejoins(local, tmp_path):
    with LocalWorkers(2) as workers:
        address = workers.addresses[1]
        port = address.rsplit(":", 1)[1]
        replacement = []

        def kill(cluster):
            workers.processes[1].kill()
            workers.processes[1].wait()

        def restart(cluster):
            process = subprocess.Popen(
                [sys.executable, "-I", "-m", "hetconv", "worker", "--listen",
                 f"127.0.0.1:{port}", "--backend", "cpu", "--no-startup-probe"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            replacement.append(process)
            for line in process.stdout:
                if line.startswith(READY_LINE):
                    break
            _wait_for(cluster, address)

        actions = {(2, "conv2"): kill, (4, None): restart}
        try:
            with Disturbed(workers.addresses, actions, shares=SHARES) as cluster:
                got = _train(tmp_path, "restarted", cluster)
                events = _kinds(cluster)
        finally:
            for process in replacement:
                process.terminate()
                process.wait(10)
    _same_as_local(got, local)
    assert ("worker_lost", address, 2) in events
    assert ("worker_rejoined", address, 4) in events


def test_worker_added_to_the_workers_file_joins(local, tmp_path):
    listing = tmp_path / "workers.txt"
    with LocalWorkers(2) as workers:
        first, second = workers.addresses
        listing.write_text(f"{first}\n")

        def add(cluster):
            listing.write_text(f"{first}\n{second}\n")
            os.utime(listing, (time.time() + 5, time.time() + 5))  # an mtime surely new
            _wait_for(cluster, second)

        with Disturbed([first], {(3, None): add}, workers_file=str(listing)) as cluster:
            got = _train(tmp_path, "joined", cluster)
            events = _kinds(cluster)
            names = [node.name for node in cluster.nodes]
            shares = cluster.plans["conv2"].shares
    _same_as_local(got, local)
    assert ("worker_joined", second, 3) in events
    assert names == ["master", first, second] and shares[2] > 0


def test_worker_removed_from_the_workers_file_leaves(local, tmp_path):
    listing = tmp_path / "workers.txt"
    with LocalWorkers(3) as workers:
        named, listed, staying = workers.addresses
        listing.write_text(f"{listed}\n{staying}\n")

        def remove(cluster):
            # The file no longer names ``listed``; ``named`` came from --worker, never the file.
            listing.write_text(f"# {listed} went home\n{staying}\n")
            os.utime(listing, (time.time() + 5, time.time() + 5))
            deadline = time.monotonic() + 30
            while not any(n.leaving for n in cluster.nodes):
                assert time.monotonic() < deadline, "the file change was not noticed in 30 s"
                time.sleep(0.05)

        addresses = [named, listed, staying]  # as the command line passes them
        with Disturbed(addresses, {(3, None): remove}, workers_file=str(listing)) as cluster:
            got = _train(tmp_path, "removed", cluster)
            events = _kinds(cluster)
            names = [node.name for node in cluster.nodes]
            shares = cluster.plans["conv2"].shares
        # It left the training, not the machine: still serving, for whoever wants it.
        assert workers.processes[1].poll() is None
    _same_as_local(got, local)
    assert ("worker_removed", listed, 3) in events
    assert not any(kind == "worker_lost" for kind, _, _ in events)
    assert names == ["master", named, staying] and len(shares) == 3 and sum(shares) == 16


# A real worker process that computes correctly, but once the file named by its argument
# exists takes four times as long and more (a laptop whose owner started something heavy).
BUSY_WORKER = """
import os, sys, time
from hetconv.backends import get_backend
from hetconv.calls import READY
from hetconv.worker.service import ConvWorkerService, start_server

class Busy(ConvWorkerService):
    def _slow(self, compute):
        if not os.path.exists(sys.argv[1]):
            return compute
        extra = 3 * compute + 0.02
        time.sleep(extra)
        return compute + extra

    def forward(self, messages):
        tensors, compute, receive = super().forward(messages)
        return tensors, self._slow(compute), receive

    def backward(self, messages):
        tensors, compute, receive = super().backward(messages)
        return tensors, self._slow(compute), receive

server, address = start_server(Busy(get_backend("cpu")), "127.0.0.1:0")
print(READY, address, flush=True)
server.wait_for_termination()
"""


@pytest.mark.slow
def test_a_worker_that_gets_busy_gets_fewer_kernels(tmp_path):
    # Shares are re-planned every 8 steps from measured speeds: each node's baseline is its
    # median compute in the first period after the shares were planned (step 0 only warms
    # up). The worker gets busy at step 24 and is measured busy from step 32 on. Only a
    # doubling or more counts here, and the master computes no share: its figures, taken
    # beside two workers on this shared 2-core machine, swing by 2x from period to period,
    # and any re-plan makes the next period the baseline.
    steps = 48
    reference = _train(tmp_path, "local48", LocalConv(), steps=steps)
    flag = tmp_path / "busy"
    process = subprocess.Popen(
        [sys.executable, "-c", BUSY_WORKER, str(flag)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, OPENBLAS_NUM_THREADS="1"),
    )  # fmt: skip
    busy = None
    for line in process.stdout:
        if line.startswith(READY_LINE):
            busy = line[len(READY_LINE) :].strip()
            break
    assert busy, "the busy worker did not start"
    kernels_when_busy = []

    def get_busy(cluster):
        flag.touch()
        kernels_when_busy.append(cluster.plans["conv2"].shares[2])  # master (0), worker, busy

    try:
        with LocalWorkers(1) as workers:
            addresses = workers.addresses + [busy]
            actions = {(24, None): get_busy}
            # (no settling: every change of shares here is the rebalancer's)
            config = dict(
                rebalance_every=8, rebalance_change=1.0, master_compute=False, settle_steps=0
            )
            with Disturbed(addresses, actions, **config) as cluster:
                got = _train(tmp_path, "busy", cluster, steps=steps)
                events = list(cluster.events)
                after = cluster.plans["conv2"].shares
    finally:
        process.terminate()
        process.wait(10)
    _same_as_local(got, reference)
    assert not any(e["event"] == "worker_lost" for e in events)
    changes = [e for e in events if e["event"] == "shares_changed"]
    assert all(e["step"] >= 16 for e in changes)  # nothing before a baseline was compared
    reasons = [(e["step"], e["reason"]) for e in changes]
    assert any(step >= 32 and f"{busy} " in reason for step, reason in reasons), reasons
    assert sum(after) == 16 and after[2] < kernels_when_busy[0], (kernels_when_busy, after)


class _Liar(ConvWorkerService):
    """Answers Forward with feature maps of the wrong shape."""

    def forward(self, messages):
        tensors, compute, receive = super().forward(messages)
        (name, y), *_ = tensors
        return [(name, np.ascontiguousarray(y[:, :-1]))], compute, receive


def test_worker_answering_the_wrong_shape_is_dropped(local, tmp_path):
    server, liar = start_server(_Liar(get_backend("cpu")), "127.0.0.1:0")
    try:
        with LocalWorkers(1) as workers:
            addresses = workers.addresses + [liar]
            with Disturbed(addresses, {}, shares=SHARES) as cluster:
                got = _train(tmp_path, "lied", cluster)
                events = _kinds(cluster)
    finally:
        server.stop(0)
    _same_as_local(got, local)
    lost = [e for e in events if e[0] == "worker_lost"]
    assert lost and lost[0][1] == liar and lost[0][2] == 0


# -- one worker under two names --------------------------------------------------------------


def _alias(address):
    """The same worker, named by host name instead of IP address."""
    return "localhost:" + address.rsplit(":", 1)[1]


def test_one_worker_under_two_names_is_refused_at_start(tmp_path):
    with LocalWorkers(1) as workers:
        (address,) = workers.addresses
        names = [address, _alias(address)]
        with Disturbed(names, {}, master_compute=False) as cluster:
            with pytest.raises(ValueError, match="one worker process") as info:
                _train(tmp_path, "aliased", cluster)
    assert address in str(info.value) and _alias(address) in str(info.value)


def test_one_worker_under_two_names_still_trains_exactly(local, tmp_path, monkeypatch):
    # A master that cannot tell (a worker too old to send its instance id): both names get 4
    # and 8 kernels, so the worker holds two slices of each layer at once, told apart by their
    # kernel offsets. Before, the second Forward replaced the first's kernels and the first
    # name's Backward returned the input gradient of the other slice.
    monkeypatch.setattr(connecting, "refuse_aliases", lambda nodes: None)
    with LocalWorkers(1) as workers:
        (address,) = workers.addresses
        shares = {"conv1": (0, 4, 4), "conv2": (0, 8, 8)}
        names = [address, _alias(address)]
        with Disturbed(names, {}, master_compute=False, shares=shares) as cluster:
            got = _train(tmp_path, "aliased-old", cluster)
            events = _kinds(cluster)
            plans = {name: plan.shares for name, plan in cluster.plans.items()}
    _same_as_local(got, local)
    assert not any(kind == "worker_lost" for kind, _, _ in events)
    assert plans == shares


def test_an_alias_added_to_the_workers_file_is_not_admitted(local, tmp_path):
    listing = tmp_path / "workers.txt"
    with LocalWorkers(1) as workers:
        (address,) = workers.addresses
        listing.write_text(f"{address}\n")

        def add(cluster):
            listing.write_text(f"{address}\n{_alias(address)}\n")
            os.utime(listing, (time.time() + 5, time.time() + 5))
            deadline = time.monotonic() + 30
            while not any(e["event"] == "worker_alias" for e in cluster.events):
                assert time.monotonic() < deadline, "the alias was not refused in 30 s"
                time.sleep(0.05)

        with Disturbed([address], {(3, None): add}, workers_file=str(listing)) as cluster:
            got = _train(tmp_path, "alias-joined", cluster)
            events = list(cluster.events)
            names = [node.name for node in cluster.nodes]
            pending = list(cluster._pending)
    _same_as_local(got, local)
    (refused,) = [e for e in events if e["event"] == "worker_alias"]
    assert refused["worker"] == _alias(address) and refused["of"] == address
    assert "same worker process" in refused["reason"]
    assert names == ["master", address] and not pending
    assert not any(e["event"] == "worker_joined" for e in events)


# -- a worker answering NaN or Inf -----------------------------------------------------------

# A real worker process that computes correctly but, at the step and phase its arguments name,
# answers with a NaN (forward: in the feature maps) or an Inf (backward: in the last tensor, the
# input gradient where there is one), well-formed on the wire.
POISONED_WORKER = """
import sys
import numpy as np
from hetconv.backends import get_backend
from hetconv.calls import READY
from hetconv.worker.service import ConvWorkerService, start_server

PHASE, STEP = sys.argv[1], int(sys.argv[2])

class Poisoned(ConvWorkerService):
    def _receive(self, messages, call):
        request, arrays, receive = super()._receive(messages, call)
        self.step = request.step  # the master calls a worker one call at a time
        return request, arrays, receive

    def _poison(self, phase, tensors, value):
        if phase == PHASE and self.step == STEP:
            tensors[-1][1].flat[0] = value
        return tensors

    def forward(self, messages):
        tensors, compute, receive = super().forward(messages)
        return self._poison("forward", tensors, np.nan), compute, receive

    def backward(self, messages):
        tensors, compute, receive = super().backward(messages)
        return self._poison("backward", tensors, np.inf), compute, receive

server, address = start_server(Poisoned(get_backend("cpu")), "127.0.0.1:0")
print(READY, address, flush=True)
server.wait_for_termination()
"""


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_worker_answering_nan_or_inf_is_dropped(local, tmp_path, phase):
    process = subprocess.Popen(
        [sys.executable, "-c", POISONED_WORKER, phase, "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, OPENBLAS_NUM_THREADS="1"),
    )  # fmt: skip
    liar = None
    for line in process.stdout:
        if line.startswith(READY_LINE):
            liar = line[len(READY_LINE) :].strip()
            break
    assert liar, "the poisoned worker did not start"
    try:
        shares = {"conv1": (4, 4), "conv2": (8, 8)}
        with Disturbed([liar], {}, shares=shares) as cluster:
            got = _train(tmp_path, f"poisoned-{phase}", cluster)
            events = list(cluster.events)
    finally:
        process.terminate()
        process.wait(10)
    _same_as_local(got, local)
    lost = [e for e in events if e["event"] == "worker_lost"]
    assert [(e["worker"], e["step"]) for e in lost] == [(liar, 2)]
    assert f"{phase} conv" in lost[0]["reason"] and "NaN or Inf" in lost[0]["reason"]


# -- a worker that is down when training starts ----------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "master_compute",
    [pytest.param(True, marks=pytest.mark.slow), False],
    ids=["master-computes", "master-off"],
)
def test_worker_down_at_start_joins_when_it_comes_up(local, tmp_path, master_compute):
    late = f"127.0.0.1:{_free_port()}"  # nothing listens there yet
    started = []

    def start(cluster):
        process = subprocess.Popen(
            [sys.executable, "-I", "-m", "hetconv", "worker", "--listen", late,
             "--backend", "cpu", "--no-startup-probe"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, OPENBLAS_NUM_THREADS="1"),
        )  # fmt: skip
        started.append(process)
        for line in process.stdout:
            if line.startswith(READY_LINE):
                break
        _wait_for(cluster, late)

    with contextlib.ExitStack() as stack:
        # With the master off, one worker is there from the start to compute meanwhile.
        live = [] if master_compute else stack.enter_context(LocalWorkers(1)).addresses
        # Shares by compute: with link-aware shares a master slowed by a busy machine may be
        # planned no kernel of conv2 (rightly), which is not what this test is about.
        config = dict(connect_timeout=1.0, master_compute=master_compute, share_policy="compute")
        try:
            with Disturbed([*live, late], {(3, None): start}, **config) as cluster:
                got = _train(tmp_path, "late", cluster)
                events = _kinds(cluster)
                shares = cluster.plans["conv2"].shares
        finally:
            for process in started:
                process.terminate()
                process.wait(10)
    _same_as_local(got, local)
    assert ("worker_lost", late, 0) in events
    assert ("worker_joined", late, 3) in events
    assert shares[-1] > 0 and (shares[0] > 0) == master_compute


def test_no_worker_reachable_and_master_off_fails_clearly(tmp_path):
    late = f"127.0.0.1:{_free_port()}"
    with Disturbed([late], {}, connect_timeout=1.0, master_compute=False) as cluster:
        with pytest.raises(RuntimeError, match="nothing would compute") as info:
            _train(tmp_path, "nobody", cluster)
    assert f"nothing listens on {late} (connection refused)" in str(info.value)
