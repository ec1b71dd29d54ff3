"""A replicated block split by images (hetconv.split): real worker processes on loopback that
compute the block on their own images and exchange the parts node to node.

The workers' stage outputs equal the ones computed here from the whole block, their block
gradients sum to the whole block's, also when one worker of the split is gone and the master
resends its parts and fetches the rows meant for it; bad parts are refused, naming what was
wrong.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent import futures

import exactness
import grpc
import numpy as np
import pytest
from exactness import FAST, same_as_local, train_strong_lrn

from hetconv.backends import get_backend
from hetconv.cli.simulate import main as simulate_main
from hetconv.conv import LocalConv
from hetconv.costmodel import SimCluster, SimNode, resident_layer_bytes, simulate_step
from hetconv.master.client import WorkerClient, WorkerError
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.replica import ReplicaBlock
from hetconv.simulations.calibrate import calibrate
from hetconv.split import SplitPlan, split_images
from hetconv.stages import StageSpec, stage_backward, stage_forward
from hetconv.workload import network_layers, split_part

BATCH, K1, K2 = 7, 4, 6
PAD = (1, 1, 1, 1)
LRN = StageSpec.from_entries(
    [{"type": "relu"}, {"type": "lrn", "size": 3}, {"type": "maxpool", "kernel": 2}]
)
RELU = StageSpec.from_entries([{"type": "relu"}])
GONE = "127.0.0.1:1"  # nothing listens there: a worker that is gone


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(3) as started:
        yield started


def _case():
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, (BATCH, 3, 8, 8)).astype(np.float32) / 255  # 8-bit pixels
    block = ReplicaBlock(
        "conv1", x, rng.standard_normal((K1, 3, 3, 3)).astype(np.float32),
        rng.standard_normal(K1).astype(np.float32), PAD, LRN,
    )  # fmt: skip
    w2 = rng.standard_normal((K2, K1, 3, 3)).astype(np.float32)
    b2 = rng.standard_normal(K2).astype(np.float32)
    return block, w2, b2, rng


def _forward_everywhere(clients, block, plan, session, step):
    """Each live worker's ReplicaForward of ``plan``, started as the cluster starts them."""
    pool = futures.ThreadPoolExecutor(len(clients))
    for c in clients:
        block.started[c.address] = pool.submit(c.replica_forward, session, step, block, 60.0, plan)
    return pool


def same_block_gradients(parts, want_rw, want_rb, master=None) -> None:
    """The workers' block gradient parts, each (rw, rb), plus the master's (mw, mb) when given,
    sum to the whole block's gradients."""
    mw, mb = master if master is not None else (0, 0)
    np.testing.assert_allclose(mw + sum(p[0] for p in parts), want_rw, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(mb + sum(p[1] for p in parts), want_rb, rtol=1e-4, atol=1e-4)


def test_split_images_follow_the_weights():
    assert split_images(16, [1, 1, 1, 1]) == [4, 4, 4, 4]
    assert split_images(7, [1, 1, 1]) == [3, 2, 2]
    assert sum(split_images(64, [2.0, 1.0, 1.0, 0.5])) == 64
    assert split_images(3, [100, 1, 1]) == [1, 1, 1]  # at least one each
    with pytest.raises(ValueError, match="cannot be split among 3"):
        split_images(2, [1, 1, 1])
    with pytest.raises(ValueError, match="positive"):
        split_images(8, [1, 0])


def _local(block, w2, b2, slices):
    """Here: the whole block, each slice's stage forward, and their runs."""
    backend = get_backend("cpu")
    y1, run1 = stage_forward(backend, block.x, block.w, block.b, PAD, block.stage, slice(0, K1))
    outs = [stage_forward(backend, y1, w2[s], b2[s], PAD, RELU, slice(0, s.stop - s.start))
            for s in slices]  # fmt: skip
    return backend, y1, run1, outs


def test_split_workers_equal_the_whole_block(workers):
    block, w2, b2, rng = _case()
    clients = [WorkerClient(a) for a in workers.addresses]
    plan = SplitPlan.of(workers.addresses, split_images(BATCH, [1, 1, 1]))
    slices = [slice(0, 2), slice(2, 4), slice(4, 6)]
    backend, y1, run1, outs = _local(block, w2, b2, slices)
    try:
        pool = _forward_everywhere(clients, block, plan, 21, 4)
        got = list(pool.map(
            lambda cs: cs[0].stage_forward(
                21, 4, "conv2", y1, w2[cs[1]], b2[cs[1]], PAD, RELU, slice(0, 2), replica=block
            ),
            zip(clients, slices, strict=False),
        ))  # fmt: skip
        for (y, _, _), (want, _) in zip(got, outs, strict=True):
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
        # only the worker's own images went out: fewer bytes than the whole batch's
        own = clients[0].replica_forward(29, 1, block, 60.0, plan).bytes_sent
        assert own < clients[0].replica_forward(29, 1, block, 60.0).bytes_sent - 2 * 3 * 8 * 8
        dys = [rng.standard_normal(want.shape).astype(np.float32) for want, _ in outs]
        parts = [(np.empty_like(block.w), np.empty_like(block.b)) for _ in clients]
        back = list(pool.map(
            lambda c, dy, p: c.stage_backward(21, 4, "conv2", dy, 0, True, replica=("conv1", *p)),
            clients, dys, parts,
        ))  # fmt: skip
        dx = sum(stage_backward(backend, run, dy, slice(0, 2), True)[0]
                 for (_, run), dy in zip(outs, dys, strict=True))  # fmt: skip
        _, want_rw, want_rb = stage_backward(backend, run1, dx, slice(0, K1), False)
        assert all(b[0] is None for b in back)  # no input gradient travelled to the master
        same_block_gradients(parts, want_rw, want_rb)
        # each worker keeps the rows it sent the others, for a master that lost one
        rows, _ = clients[0].fetch_part(21, 4, "conv1", 2)
        mine = stage_backward(backend, outs[0][1], dys[0], slice(0, 2), True)[0]
        np.testing.assert_allclose(rows, mine[plan.images(workers.addresses[2])], rtol=1e-5)
    finally:
        for c in clients:
            c.close()


def test_a_lost_workers_parts_come_from_the_master(workers):
    """Worker 2 of the split is gone before the step: the master sends its block output and,
    backward, its slice's input-gradient rows to the others as it; it fetches their rows of
    the lost worker's images and back-propagates them through its own block there."""
    block, w2, b2, rng = _case()
    addresses = [*workers.addresses[:2], GONE]
    clients = [WorkerClient(a) for a in addresses[:2]]
    plan = SplitPlan.of(addresses, split_images(BATCH, [1, 1, 1]))
    lost = plan.images(GONE)
    slices = [slice(0, 2), slice(2, 4), slice(4, 6)]  # the third, the lost worker's
    backend, y1, run1, outs = _local(block, w2, b2, slices)
    try:
        pool = _forward_everywhere(clients, block, plan, 22, 9)
        for c in clients:  # as the lost worker: its images' output, from the master's block
            c.put_part(22, 9, "conv1", 2, np.ascontiguousarray(y1[lost]), False)
        # a part from a source that came already is not taken twice
        clients[0].put_part(22, 9, "conv1", 2, np.zeros_like(y1[lost]), False)
        got = list(pool.map(
            lambda cs: cs[0].stage_forward(
                22, 9, "conv2", y1, w2[cs[1]], b2[cs[1]], PAD, RELU, slice(0, 2), replica=block
            ),
            zip(clients, slices, strict=False),
        ))  # fmt: skip
        for (y, _, _), (want, _) in zip(got, outs[:2], strict=True):
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
        dys = [rng.standard_normal(want.shape).astype(np.float32) for want, _ in outs]
        dxs = [stage_backward(backend, run, dy, slice(0, 2), True)[0]
               for (_, run), dy in zip(outs, dys, strict=True)]  # fmt: skip
        parts = [(np.empty_like(block.w), np.empty_like(block.b)) for _ in clients]
        pending = [pool.submit(c.stage_backward, 22, 9, "conv2", dy, 0, True,
                               replica=("conv1", *p))
                   for c, dy, p in zip(clients, dys, parts, strict=False)]  # fmt: skip
        for c, address in zip(clients, addresses, strict=False):  # the lost slice's rows
            c.put_part(22, 9, "conv1", 2, np.ascontiguousarray(dxs[2][plan.images(address)]), True)
        for p in pending:
            p.result()
        # the rows of the lost worker's images: the others', fetched, and its own slice's
        fetched = [c.fetch_part(22, 9, "conv1", 2)[0] for c in clients]
        rows = np.zeros_like(dxs[0])
        rows[lost] = dxs[2][lost] + sum(fetched)
        _, mw, mb = stage_backward(backend, run1, rows, slice(0, K1), False)
        _, want_rw, want_rb = stage_backward(backend, run1, sum(dxs), slice(0, K1), False)
        same_block_gradients(parts, want_rw, want_rb, (mw, mb))
    finally:
        for c in clients:
            c.close()


def test_bad_parts_are_refused_naming_what_was_wrong(workers):
    block, *_ = _case()
    client = WorkerClient(workers.addresses[0])
    plan = SplitPlan.of(workers.addresses[:2] + [GONE], split_images(BATCH, [1, 1, 1]))
    try:
        client.replica_forward(23, 5, block, 60.0, plan)
        part = np.zeros((2, K1, 4, 4), np.float32)
        with pytest.raises(WorkerError, match=r"expected 2 images' rows|expected \(2, 4, 4, 4\)"):
            client.put_part(23, 5, "conv1", 1, part[:1], False)
        with pytest.raises(WorkerError, match="this worker is node 0 of 3"):
            client.put_part(23, 5, "conv1", 0, part, False)
        with pytest.raises(WorkerError, match="at step 5 round 0 of it already"):
            client.put_part(23, 4, "conv1", 1, part, False)
        nan = part.copy()
        nan[0, 0, 0, 0] = np.nan
        with pytest.raises(WorkerError, match="NaN or Inf"):
            client.put_part(23, 5, "conv1", 1, nan, False)
        with pytest.raises(WorkerError, match="no backward of split block 'conv1' at step 5"):
            client.fetch_part(23, 5, "conv1", 1)
        holes = SplitPlan((plan.peers[0], (plan.peers[1][0], 4, 2)))
        with pytest.raises(WorkerError, match="must tile the batch in order"):
            client.replica_forward(23, 6, block, 60.0, holes)
    finally:
        client.close()


def test_a_part_naming_a_far_step_is_refused_and_never_blocks_the_block(workers):
    """A peer's part may name at most the step after the session's latest here; one that only
    parts made (a session the worker has not seen) gives way to the master's own call."""
    block, *_ = _case()
    client = WorkerClient(workers.addresses[0])
    plan = SplitPlan.of(workers.addresses[:2] + [GONE], split_images(BATCH, [1, 1, 1]))
    part = np.zeros((2, K1, 4, 4), np.float32)
    try:
        client.replica_forward(31, 5, block, 60.0, plan)
        with pytest.raises(WorkerError, match="session 31 is at step 5 here, and a part may"):
            client.put_part(31, 2**64 - 1, "conv1", 1, part, False)
        client.put_part(31, 6, "conv1", 1, part, False)  # the next step's may come first
        client.replica_forward(31, 6, block, 60.0, plan)
        client.put_part(32, 2**64 - 1, "conv1", 1, part, False)  # no call of session 32 yet
        client.replica_forward(32, 1, block, 60.0, plan)
        client.put_part(32, 1, "conv1", 1, part, False)
    finally:
        client.close()


@pytest.mark.slow
def test_a_fetch_that_waits_ends_with_its_caller_and_frees_the_worker():
    """FetchParts for a part that never comes end with their callers, hold no call slot
    after, end at the idle timeout when their callers wait on, and SIGTERM stops the worker
    at once while one waits."""
    from test_worker_process import WorkerProcess

    worker = WorkerProcess("--backend", "cpu", "--max-calls", "4", "--idle-timeout", "2")
    try:
        client = WorkerClient(worker.wait_ready())
        with futures.ThreadPoolExecutor(5) as pool:
            fetches = [pool.submit(client.fetch_part, 41, 1, "conv1", 0, 1.0, False)
                       for _ in range(4)]  # fmt: skip
            for f in fetches:
                with pytest.raises(WorkerError, match="DEADLINE_EXCEEDED|[Dd]eadline"):
                    f.result(timeout=30)
            x = np.ones((1, 1, 4, 4), np.float32)
            w, b = np.ones((1, 1, 3, 3), np.float32), np.zeros(1, np.float32)
            y, _ = client.forward(42, 1, "conv", x, w, b, PAD, timeout=10.0)  # a slot is free
            assert y[0, 0, 1, 1] == 9
            started = time.monotonic()
            with pytest.raises(WorkerError, match="--idle-timeout"):
                client.fetch_part(41, 1, "conv1", 0, 30.0, False)
            assert time.monotonic() - started < 10
            waiting = pool.submit(client.fetch_part, 41, 1, "conv1", 0, 60.0, False)
            time.sleep(0.5)
            started = time.monotonic()
            worker.popen.terminate()
            worker.popen.wait(timeout=10)
            assert time.monotonic() - started < 5, worker.output()
            with pytest.raises(WorkerError):
                waiting.result(timeout=10)
        client.close()
    finally:
        worker.stop()


def test_a_tarpit_peer_holds_only_its_own_sessions_senders(workers):
    """ReplicaForwards naming a peer that never answers hold that session's sender threads
    only (each put ends at its deadline): a legitimate split through the same worker runs."""
    block, w2, b2, rng = _case()
    tarpit, hole, release = _tarpit()
    clients = [WorkerClient(a) for a in workers.addresses[:2]]
    try:
        for step in range(1, 9):  # more puts to the tarpit than a session has senders
            bad = SplitPlan.of([workers.addresses[0], hole], split_images(BATCH, [1, 1]))
            clients[0].replica_forward(51, step, block, 60.0, bad)
        plan = SplitPlan.of(workers.addresses[:2], split_images(BATCH, [1, 1]))
        slices = [slice(0, 3), slice(3, 6)]
        _, y1, _, outs = _local(block, w2, b2, slices)
        pool = _forward_everywhere(clients, block, plan, 52, 1)
        got = list(pool.map(
            lambda cs: cs[0].stage_forward(
                52, 1, "conv2", y1, w2[cs[1]], b2[cs[1]], PAD, RELU, slice(0, 3), replica=block,
                timeout=20.0,
            ),
            zip(clients, slices, strict=True),
        ))  # fmt: skip
        for (y, _, _), (want, _) in zip(got, outs, strict=True):
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    finally:
        for c in clients:
            c.close()
        release.set()
        tarpit.stop(0)


def _tarpit():
    """A gRPC server that takes every call and answers none (until the event is set)."""
    release = threading.Event()

    def hold(request, context):
        release.wait()
        return b""

    class Holds(grpc.GenericRpcHandler):
        def service(self, details):
            if details.method.endswith("Bundle"):
                return grpc.unary_unary_rpc_method_handler(hold)
            return grpc.stream_stream_rpc_method_handler(lambda it, c: iter([hold(it, c)]))

    server = grpc.server(futures.ThreadPoolExecutor(32), handlers=[Holds()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}", release


# -- training through a cluster -------------------------------------------------------------

SHARES = {"conv1": (0, 1, 1, 6), "conv2": (4, 4, 4, 4)}
SPLIT = dict(**FAST, shares=SHARES, stages="fused", replicate="split")


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return train_strong_lrn(tmp_path_factory.mktemp("local"), "local", LocalConv())


@pytest.mark.parametrize("kernels", [pytest.param("sent", marks=pytest.mark.slow), "resident"])
def test_a_split_block_trains_as_local(local, workers, tmp_path, kernels):
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**SPLIT, kernels=kernels)
    with Cluster(workers.addresses, config=config) as cluster:
        got = train_strong_lrn(tmp_path, "split", cluster, trace=str(trace))
    same_as_local(got, local)
    assert "split by images among the workers" in cluster.describe_replica()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    assert all(r["stage_modes"] == {"conv1": "replicated", "conv2": "fused"} for r in steps)
    # resident: from the second step conv2's stage forward started with the block's
    assert all(r.get("started_ahead") == ["conv2"] for r in steps[1:]) == (kernels == "resident")
    # the batch of 8 split among the three workers (by their probes), nothing covered
    for record in steps:
        split = record["replica_split"]["conv1"]
        assert len(split["images"]) == 3 and sum(split["images"]) == 8, split
        assert split["covered_bytes"] == 0
    assert not [e for e in cluster.events if e["event"] == "worker_lost"]
    # the simulator reads the trace: every call moved what the model counts for its images
    cal = calibrate(str(trace))
    assert cal.replica_split == {"conv1": split["images"]}
    assert cal.check()["step_s"] > 0


@pytest.mark.parametrize("replicate", ["split", "split_all"])
def test_a_deterministic_split_takes_equal_shares_whatever_the_probes(
    workers, tmp_path, monkeypatch, replicate
):
    """--deterministic: no timing splits the images (a worker that probes three times slower
    still gets its equal share), so the same run twice gives the same weights bitwise."""
    from hetconv.master import probing

    real = probing.probe

    def skewed(node, layer, *args):
        slow = node.client is not None and node.client.address == workers.addresses[1]
        return real(node, layer, *args) * (3.0 if slow else 1.0)

    monkeypatch.setattr(probing, "probe", skewed)
    config = ClusterConfig(**{**SPLIT, "replicate": replicate}, deterministic=True)
    runs = []
    for i in range(2):
        trace = tmp_path / f"trace{i}.jsonl"
        with Cluster(workers.addresses, config=config) as cluster:
            runs.append(train_strong_lrn(tmp_path, f"d{i}", cluster, trace=str(trace), steps=3))
        steps = [json.loads(line) for line in trace.read_text().splitlines()]
        images = {tuple(r["replica_split"]["conv1"]["images"]) for r in steps if "step" in r}
        assert images == ({(3, 3, 2)} if replicate == "split" else {(2, 2, 2, 2)}), images
    for name in runs[0][1]:
        assert np.array_equal(runs[0][1][name], runs[1][1][name]), name


@pytest.mark.parametrize("kernels", [pytest.param("sent", marks=pytest.mark.slow), "resident"])
def test_a_peer_that_puts_wrong_block_outputs_is_the_one_dropped(local, workers, tmp_path, kernels):
    """A peer that puts its images' block output x1.5 into the others (its own answers right):
    each receiver's sample of the parts it got, compared with the master's block output, blames
    the sender; the honest receivers stay, the liar is kept out, training equals local."""
    from test_spot_checks import lying_worker

    from hetconv.master.spotcheck import SpotCheckConfig

    with lying_worker("parts") as liar:
        addresses = [*workers.addresses[:2], liar]
        checks = SpotCheckConfig(every=1)
        config = ClusterConfig(**SPLIT, kernels=kernels, spot_checks=checks)
        with Cluster(addresses, config=config) as cluster:
            got = train_strong_lrn(tmp_path, "parts", cluster)
            events = list(cluster.events)
            states = {node.name: node.state for node in cluster.nodes}
    same_as_local(got, local)
    lost = [(e["worker"], e["reason"]) for e in events if e["event"] == "worker_lost"]
    assert [w for w, _ in lost] == [liar], lost
    assert "the block output it put into worker" in lost[0][1]
    assert states[liar] == "distrusted"
    assert all(states[a] == "active" for a in workers.addresses[:2])


@pytest.mark.parametrize(
    "kernels, head",
    [
        pytest.param("sent", "master", marks=pytest.mark.slow),
        ("resident", "master"),
        ("resident", "split"),
    ],
)
def test_a_peer_that_puts_wrong_gradient_rows_is_the_one_dropped(
    local, workers, tmp_path, kernels, head
):
    """A peer that puts its input-gradient rows of the others' images x1.5 (its own answers
    right): on a due step each receiver's sample of one image's rows, against the master's
    recomputation of every sender's rows of that image (sent kernels; resident: the sender's
    slice fetched after its update and taken back a step, a split head's columns too), blames
    the sender; the honest receivers stay, training equals local."""
    from test_spot_checks import lying_worker

    from hetconv.master.spotcheck import SpotCheckConfig

    with lying_worker("rows", from_step=2) as liar:
        addresses = [*workers.addresses[:2], liar]
        checks = SpotCheckConfig(every=1)
        config = ClusterConfig(**SPLIT, kernels=kernels, head=head, spot_checks=checks)
        with Cluster(addresses, config=config) as cluster:
            got = train_strong_lrn(tmp_path, "rows", cluster)
            events = list(cluster.events)
            states = {node.name: node.state for node in cluster.nodes}
    same_as_local(got, local)
    lost = [(e["worker"], e["step"], e["reason"]) for e in events if e["event"] == "worker_lost"]
    assert [(w, step) for w, step, _ in lost] == [(liar, 2)], lost
    assert "backward conv1: the input-gradient rows it put into worker" in lost[0][2]
    assert states[liar] == "distrusted"
    assert all(states[a] == "active" for a in workers.addresses[:2])


def test_a_peer_that_withholds_its_parts_is_the_one_dropped(local, workers, tmp_path):
    """A peer that computes its images' block output but puts it into nobody: the receivers
    say which parts they lack, and the peer whose own stage forward answered before is
    dropped (its parts put by the master as it), not the receivers waiting for it."""
    from test_spot_checks import lying_worker

    with lying_worker("withhold") as liar:
        addresses = [*workers.addresses[:2], liar]
        config = ClusterConfig(**{**SPLIT, "deadline_floor": 5.0}, kernels="resident")
        with Cluster(addresses, config=config) as cluster:
            started = time.monotonic()
            got = train_strong_lrn(tmp_path, "withheld", cluster)
            took = time.monotonic() - started
            events = list(cluster.events)
    same_as_local(got, local)
    lost = [(e["worker"], e["step"], e["reason"]) for e in events if e["event"] == "worker_lost"]
    assert [(w, step) for w, step, _ in lost] == [(liar, 0)], lost
    assert "never got its part" in lost[0][2]
    assert took < 60, took


class Killing(exactness.Killing):
    # the honest workers' calls wait while the master covers the victim (its slice replayed
    # and computed, its rows put; more with spot checks due): 1 s was short on a busy machine
    BASE = {**SPLIT, "deadline_floor": 5.0}


@pytest.mark.parametrize(
    "kernels, when",
    [
        ("sent", "backward"),
        ("resident", "backward"),
        # a kill in forward: also tests/test_split_all.py's [resident-forward-*] in the fast run
        pytest.param("resident", "forward", marks=pytest.mark.slow),
    ],
)
def test_a_worker_killed_mid_step_stays_exact(local, tmp_path, kernels, when):
    trace = tmp_path / "trace.jsonl"
    with LocalWorkers(3) as started:
        victim = started.processes[1]
        with Killing(
            started.addresses, victim, 4, when, kernels=kernels, resident_sync_every=3
        ) as cluster:
            got = train_strong_lrn(tmp_path, "killed", cluster, trace=str(trace))
            lost = [e for e in cluster.events if e["event"] == "worker_lost"]
    same_as_local(got, local)
    assert [(e["worker"], e["step"]) for e in lost] == [(started.addresses[1], 4)]
    steps = {r["step"]: r for r in map(json.loads, trace.read_text().splitlines()) if "step" in r}
    # at step 4 the master put the lost worker's parts into the other two: lost in forward,
    # its images' block output, to each; then (lost in forward or backward) its slice's
    # gradient rows of their images. From step 5 the two split the batch alone.
    covered = steps[4]["replica_split"]["conv1"]
    images = covered["images"][1]  # the victim's
    per_image = 8 * 16 * 16 * 4  # the block's output on one image, float32
    put = (2 * images if when == "forward" else 0) + 8 - images
    assert covered["covered_bytes"] == put * per_image, covered
    after = steps[5]["replica_split"]["conv1"]
    assert len(after["images"]) == 2 and sum(after["images"]) == 8, after
    assert after["covered_bytes"] == 0


def test_the_simulator_models_the_split():
    """Each worker's ReplicaForward moves its images only and it computes the block on them,
    plus the exchange on its link; the master's side is unchanged."""
    layers = network_layers("paper-150-800", 16)
    conv1, conv2 = layers
    nodes = [SimNode(f"w{i}", 5.0, bytes_per_s=1e9) for i in range(4)]
    cluster = SimCluster(SimNode("master", 5.0, bytes_per_s=1e9), tuple(nodes))
    shares = {"conv1": (150, 0, 0, 0, 0), "conv2": (160, 160, 160, 160, 160)}
    args = (cluster, layers, shares, 0.1, {"conv2": "fused"}, "resident")
    whole = simulate_step(*args, replicate="first")
    split = simulate_step(*args, replicate="split")
    # as a trace says it: the block "replicated", its split's images
    traced = {"conv1": "replicated", "conv2": "fused"}
    given = simulate_step(*args[:4], traced, "resident", split_images={"conv1": [4, 4, 4, 4]})
    assert given == split  # equal workers: 4 images each
    (f_whole, b_whole), (f_split, b_split) = (
        [p for p in r.phases if p.layer == "conv2"] for r in (whole, split)
    )
    # 3/4 of the images stay off each worker's link: 12 x 3 x 32 x 32 palette8 bytes each
    assert f_whole.bytes - f_split.bytes == pytest.approx(4 * 12 * 3 * 32 * 32, abs=4 * 200)
    # forward, the block and the exchange run as the master computes its own block; backward
    # each worker's block on a quarter of the images, with the exchange, is shorter
    assert max(b_split.worker_ends_s) < max(b_whole.worker_ends_s)
    assert split.step_s < whole.step_s
    part = split_part(conv1, SplitPlan.of(["w0", "w1"], [5, 11]), "w1")
    assert part.shape.n == 11 and part.split_of[1] == "w1"


def test_a_stage_backward_gives_the_peers_rows_first():
    """rows_first: the named images' input gradient comes first, each handed over as it is,
    and the whole is what one pass gives (the input gradient is per image)."""
    block, w2, b2, rng = _case()
    backend, y1, _, outs = _local(block, w2, b2, [slice(0, K2)])
    want, run = outs[0]
    dy = rng.standard_normal(want.shape).astype(np.float32)
    handed = []
    first = [(slice(3, 5), lambda i, r: handed.append((i, r.copy()))),
             (slice(0, 2), lambda i, r: handed.append((i, r.copy())))]  # fmt: skip
    dx, dw, db = stage_backward(backend, run, dy, slice(0, K2), True, rows_first=first)
    dx1, dw1, db1 = stage_backward(backend, run, dy, slice(0, K2), True)
    np.testing.assert_allclose(dx, dx1, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(dw, dw1)
    assert [i for i, _ in handed] == [slice(3, 5), slice(0, 2)]
    for images, rows in handed:
        np.testing.assert_array_equal(rows, dx[images])


def test_simulate_models_the_split_block(tmp_path, capsys):
    rows = {}
    for replicate in ("first", "split"):
        out = tmp_path / f"{replicate}.json"
        argv = ["gigabit-lan", "--preset", "paper-150-800", "--batch", "16", "--nodes", "5"]
        argv += ["--stages", "fused", "--kernels", "resident", "--policy", "compute"]
        assert simulate_main([*argv, "--replicate", replicate, "--json", str(out)]) == 0
        (rows[replicate],) = [r for r in json.loads(out.read_text()) if r["policy"] == "compute"]
    assert rows["split"]["replicate"] == "split"
    assert rows["split"]["shares"] == rows["first"]["shares"]
    # each worker's images only: 3/4 of the palette8 images stay off the master's link
    saved = rows["first"]["mbytes_per_step"] - rows["split"]["mbytes_per_step"]
    assert saved == pytest.approx(4 * 12 * 3 * 32 * 32 / 1e6, abs=0.01)
    capsys.readouterr()
    assert simulate_main(["gigabit-lan", "--stages", "unfused", "--replicate", "split"]) == 2
    assert "--replicate split feeds the second layer" in capsys.readouterr().err


def test_a_split_is_refused_where_the_exchange_cannot_go(workers, tmp_path):
    """On one shared medium (wifi) the block is replicated whole; with TLS not at all split."""
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**{**SPLIT, "network": "wifi"}, kernels="resident")
    with Cluster(workers.addresses, config=config) as cluster:
        train_strong_lrn(tmp_path, "wifi", cluster, trace=str(trace), steps=2)
    assert "not split: the workers share one medium (wifi)" in cluster.describe_replica()
    steps = [r for r in map(json.loads, trace.read_text().splitlines()) if "step" in r]
    assert steps and all("replica_split" not in r for r in steps)
    assert all(r["stage_modes"]["conv1"] == "replicated" for r in steps)
    with pytest.raises(ValueError, match="TLS"):
        ClusterConfig(replicate="split", tls_ca="ca.pem")


def test_the_master_link_carries_each_workers_images_only():
    """What `benchmarks/wire_bytes.py` counts for the split: 3/4 of the images less per worker
    (12 of 16, palette8), the rest of every call the same."""
    conv1, conv2 = network_layers("paper-150-800", 16)
    shares = (160, 160, 160, 160, 160)
    whole = resident_layer_bytes(conv2, shares, replica=conv1, head=conv2.head)
    split = resident_layer_bytes(conv2, shares, replica=conv1, head=conv2.head, split=True)
    assert whole - split == pytest.approx(4 * 12 * 3 * 32 * 32, abs=4 * 200)


# split_all with a 16-bit wire: tests/test_split_all.py.
@pytest.mark.parametrize("replicate", ["first", "split"])
def test_16_bit_wire_spot_checks_pass_honest_workers_of_a_replicated_block(
    workers, tmp_path, replicate
):
    """A worker computes a replicated block's output itself in float32 (split by images, the
    peers' rows come as float32 parts): nothing of it crossed the 16-bit wire, so the spot
    checks recompute its stage from that input unrounded, and honest workers pass (before,
    rounding it flipped max-pool choices and every honest worker was dropped at step 0)."""
    from hetconv.formats import BFLOAT16
    from hetconv.master.spotcheck import SpotCheckConfig

    checks = SpotCheckConfig(every=1, unpredictable=False)
    options = {**SPLIT, "replicate": replicate}
    config = ClusterConfig(**options, kernels="sent", wire_format=BFLOAT16, spot_checks=checks)
    with Cluster(workers.addresses, config=config) as cluster:
        train_strong_lrn(tmp_path, f"bf16-{replicate}", cluster, steps=3)
        lost = [(e["worker"], e["reason"]) for e in cluster.events if e["event"] == "worker_lost"]
    assert lost == []
