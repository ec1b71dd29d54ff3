"""The master's cluster against real worker processes on loopback.

Exactness is the invariant: training through the cluster gives local training's losses step by
step and its final weights, to float32 round-off. The tolerance: losses within rtol 1e-6 and
weights within atol 1e-6 after the run (observed: losses identical, weights within ~1e-8; the
only difference is the order in which the input-gradient parts are summed).
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from hetconv.conv import LocalConv
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.model import Model, reference_spec
from hetconv.training import TrainConfig, train

SMALL = dict(steps=5, batch=8, train_size=64, eval_size=16, progress=False)


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(3) as launched:
        yield launched.addresses


def _train(tmp_path, name, executor, **overrides):
    weights = tmp_path / f"{name}.npz"
    config = TrainConfig(save=str(weights), **{**SMALL, **overrides})
    result = train(config, executor, log=io.StringIO())
    return result, dict(np.load(weights))


def _assert_same_training(got, want):
    (result, weights), (ref_result, ref_weights) = got, want
    np.testing.assert_allclose(result.losses, ref_result.losses, rtol=1e-6)
    assert weights.keys() == ref_weights.keys()
    for name in weights:
        np.testing.assert_allclose(weights[name], ref_weights[name], rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("local"), "local", LocalConv())


def test_two_workers_and_master_train_exactly_like_local(workers, local_run, tmp_path):
    # Shares forced so every node certainly computes part of both layers (the probe might
    # legitimately give a slow node nothing); the probe-driven split is tested below.
    config = ClusterConfig(shares={"conv1": (3, 2, 3), "conv2": (5, 6, 5)})
    with Cluster(workers[:2], config=config) as cluster:
        got = _train(tmp_path, "cluster", cluster)
        plans = {name: plan.shares for name, plan in cluster.plans.items()}
    assert plans == {"conv1": (3, 2, 3), "conv2": (5, 6, 5)}
    _assert_same_training(got, local_run)


def test_probe_driven_shares_train_exactly_like_local(workers, local_run, tmp_path):
    with Cluster(workers[:2]) as cluster:
        got = _train(tmp_path, "probed", cluster)
        for plan in cluster.plans.values():
            assert sum(plan.shares) == plan.shape.k
            assert plan.shape.n == SMALL["batch"]
        for node in cluster.nodes:
            assert set(node.probe_seconds) == {"conv1", "conv2"}
            assert all(t > 0 for t in node.probe_seconds.values())
    _assert_same_training(got, local_run)


def test_worker_given_zero_kernels_and_master_off(workers, local_run, tmp_path):
    config = ClusterConfig(master_compute=False, shares={"conv1": (0, 8, 0), "conv2": (0, 0, 16)})
    with Cluster(workers[:2], config=config) as cluster:
        got = _train(tmp_path, "zero", cluster)
        assert all(plan.shares[0] == 0 for plan in cluster.plans.values())
    _assert_same_training(got, local_run)


def test_more_workers_than_kernels(workers, tmp_path):
    spec = [
        {"type": "conv", "out": 2, "kernel": 3, "padding": "same"},
        {"type": "relu"},
        {"type": "conv", "out": 3, "kernel": 3, "padding": 1},
        {"type": "relu"},
        {"type": "maxpool", "kernel": 4},
        {"type": "fc", "out": 10},
    ]
    preset = tmp_path / "narrow.json"
    preset.write_text(json.dumps(spec))
    local = _train(tmp_path, "narrow-local", LocalConv(), preset=str(preset))
    with Cluster(workers) as cluster:  # 4 nodes, 2 and 3 kernels: someone gets none
        got = _train(tmp_path, "narrow-cluster", cluster, preset=str(preset))
        shares = [plan.shares for plan in cluster.plans.values()]
    assert all(len(s) == 4 and sum(s) in (2, 3) for s in shares)
    assert 0 in shares[0]
    _assert_same_training(got, local)


def test_trace_carries_per_node_and_layer_figures(workers, tmp_path):
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(shares={"conv1": (2, 3, 3), "conv2": (4, 6, 6)})
    with Cluster(workers[:2], config=config) as cluster:
        train(TrainConfig(**{**SMALL, "steps": 3}, trace=str(trace)), cluster, log=io.StringIO())
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    records = [r for r in records if "step" in r]  # the plan record comes first
    assert [r["step"] for r in records] == [0, 1, 2]
    x_bytes = 8 * 3 * 32 * 32 * 4  # conv1's input: batch 8 of 3 x 32 x 32 float32
    for r in records:
        assert r["comm_seconds"] > 0 and r["conv_seconds"] > 0 and r["comp_seconds"] >= 0
        total = r["comm_seconds"] + r["conv_seconds"] + r["comp_seconds"]
        assert total == pytest.approx(r["seconds"], rel=1e-6)
        assert set(r["nodes"]) == {"master", *workers[:2]}
        for address in workers[:2]:
            conv1 = r["nodes"][address]["conv1"]
            assert conv1["kernels"] == 3
            fwd, bwd = conv1["forward"], conv1["backward"]
            # Forward sends x and 3 kernels (+ biases + header), receives 3 feature maps.
            assert x_bytes + 3 * 3 * 25 * 4 < fwd["bytes_sent"] < x_bytes + 3 * 3 * 25 * 4 + 1024
            assert 8 * 3 * 32 * 32 * 4 <= fwd["bytes_received"] < 8 * 3 * 32 * 32 * 4 + 1024
            # Backward sends only the gradient slice (the worker kept x) and gets no dx back
            # for the first layer.
            assert bwd["bytes_sent"] < 8 * 3 * 32 * 32 * 4 + 1024
            assert bwd["bytes_received"] < 1024
            for phase in (fwd, bwd):
                assert phase["compute_seconds"] > 0
                assert 0 < phase["send_seconds"] <= phase["wall_seconds"]
                assert 0 < phase["receive_seconds"] <= phase["wall_seconds"]
            assert r["nodes"][address]["conv2"]["backward"]["bytes_received"] > 8 * 8 * 16 * 16 * 4


def test_unknown_layer_shape_is_split_by_mean_speed(workers):
    # Evaluation batches differ from the probed batch; a layer never probed still works.
    rng = np.random.default_rng(0)
    with Cluster(workers[:2]) as cluster:
        model = Model(reference_spec(4, 6), seed=0, executor=cluster)
        cluster.prepare(model.conv_specs(), batch=2, log=None)
        cluster.begin_step(0)
        x = rng.standard_normal((5, 3, 32, 32), dtype=np.float32)
        got = model.forward(x)
    want = Model(reference_spec(4, 6), seed=0).forward(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bad_cluster_settings_are_refused(workers):
    with pytest.raises(ValueError, match="named twice"):
        Cluster([workers[0], workers[0]])
    with pytest.raises(ValueError, match="nothing would compute"):
        Cluster([], config=ClusterConfig(master_compute=False))
    with pytest.raises(ValueError, match="share policy 'fastest' is not one of compute, link"):
        Cluster(workers[:1], config=ClusterConfig(share_policy="fastest"))
    with pytest.raises(ValueError, match="network 'lte' is not one of switched, wifi"):
        Cluster(workers[:1], config=ClusterConfig(network="lte"))
    config = ClusterConfig(shares={"conv1": (1, 1, 1)})
    with Cluster(workers[:2], config=config) as cluster:
        model = Model(reference_spec(8, 16), seed=0, executor=cluster)
        with pytest.raises(ValueError, match="summing to its 8 kernels"):
            cluster.prepare(model.conv_specs(), batch=2, log=None)


def test_plan_record_carries_probes_links_and_shares(workers):
    """What the trace's first record says of the plan, as data (nothing parses the console)."""
    import json

    with Cluster(workers[:2], config=ClusterConfig(master_compute=False)) as cluster:
        model = Model(reference_spec(8, 16), seed=0, executor=cluster)
        cluster.prepare(model.conv_specs(), batch=4, log=None)
        record = json.loads(json.dumps(cluster.plan_record()))  # JSON as it is
        nodes = cluster.nodes
        plans = {name: list(plan.shares) for name, plan in cluster.plans.items()}
    assert [n["name"] for n in record["nodes"]] == [n.name for n in nodes]
    assert record["shares"] == plans and set(plans) == {"conv1", "conv2"}
    master, *rest = record["nodes"]
    assert master["probe_seconds"] == {} and master["link_bytes_per_second"] is None
    for entry, node in zip(rest, nodes[1:], strict=True):
        assert entry["probe_seconds"] == pytest.approx(node.probe_seconds)
        assert entry["link_bytes_per_second"] == pytest.approx(node.link_bytes_per_second)
        assert entry["link_latency_seconds"] == pytest.approx(node.link_latency)
        assert entry["description"] == node.description


def test_link_policy_gives_a_worker_behind_a_slow_link_no_kernels(workers):
    # Both workers are real and probed; the second one's link is then set to what a 5 Mbit/s
    # Wi-Fi link measures (the measurement is the policy's input; loopback cannot be slow).
    def prepared(policy):
        cluster = Cluster(workers[:2], config=ClusterConfig(share_policy=policy))
        model = Model(reference_spec(8, 64), seed=0, executor=cluster)
        cluster.prepare(model.conv_specs(), batch=16, log=None)
        cluster.nodes[2].link_bytes_per_second = 5e6 / 8
        cluster.nodes[2].link_latency = 0.005
        cluster.replan()
        return cluster

    with prepared("link") as cluster:
        link = {name: plan.shares for name, plan in cluster.plans.items()}
        slow = cluster.nodes[2].name
    with prepared("compute") as cluster:
        compute = {name: plan.shares for name, plan in cluster.plans.items()}
    assert all(shares[2] == 0 for shares in link.values()), (slow, link)
    assert all(shares[2] > 0 for shares in compute.values()), compute  # links play no part
    assert all(sum(link[name]) == sum(compute[name]) for name in link)


@pytest.mark.parametrize("network", ["switched", "wifi"])
def test_link_policy_models_the_network_it_is_told(workers, monkeypatch, network):
    from hetconv import balance as policies

    seen = []

    def spy(model, layer, *fused):
        seen.append(model)
        return real(model, layer, *fused)

    real = policies.link_aware_shares
    monkeypatch.setattr(policies, "link_aware_shares", spy)
    config = ClusterConfig(share_policy="link", network=network)
    with Cluster(workers[:2], config=config) as cluster:
        model = Model(reference_spec(4, 6), seed=0, executor=cluster)
        cluster.prepare(model.conv_specs(), batch=4, log=None)
        links = [node.link_bytes_per_second for node in cluster.nodes[1:]]
    assert seen and all(m.fabric == network for m in seen)
    assert all(m.medium_bytes_per_s == max(links) for m in seen)
    assert all([w.bytes_per_s for w in m.workers] == links for m in seen)


def test_link_policy_trains_exactly_like_local(workers, local_run, tmp_path):
    config = ClusterConfig(share_policy="link")
    with Cluster(workers, config=config) as cluster:
        got = _train(tmp_path, "link", cluster)
    _assert_same_training(got, local_run)


# -- the command line: the embedded default and named workers ------------------------------


def _port_closed(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return True
    return False


def _worker_addresses(output: str) -> list[str]:
    return [
        line.split()[0] for line in output.splitlines() if line.strip().startswith("127.0.0.1:")
    ]


def _hetconv(*args: str) -> list[str]:
    return [sys.executable, "-m", "hetconv", *args]


TINY_RUN = ["--steps", "3", "--batch", "8", "--train-size", "64", "--eval-size", "16"]


def test_embedded_default_trains_with_two_local_workers_and_stops_them(tmp_path):
    trace = tmp_path / "t.jsonl"
    run = subprocess.run(
        _hetconv("train", *TINY_RUN, "--no-progress", "--trace", str(trace)),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr
    assert "starting 2 local worker processes" in run.stderr
    assert "kernel shares" in run.stderr
    assert "communication" in run.stderr and "convolution (slowest node)" in run.stderr
    addresses = _worker_addresses(run.stderr)
    assert len(addresses) == 2
    assert all(_port_closed(a) for a in addresses)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    records = [r for r in records if "step" in r]  # the plan record comes first
    assert len(records) == 3 and set(records[0]["nodes"]) == {"master", *addresses}


@pytest.mark.parametrize("policy", ["compute", "link"])
def test_named_workers_and_workers_file(workers, tmp_path, policy):
    listing = tmp_path / "workers.txt"
    listing.write_text(f"# the lab\n{workers[1]}  # second\n\n")
    run = subprocess.run(
        _hetconv("train", *TINY_RUN, "--no-progress", "--worker", workers[0],
                 "--workers-file", str(listing), "--no-master-compute", "--shares", policy),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "starting" not in run.stderr
    assert _worker_addresses(run.stderr) == workers[:2]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--worker", "127.0.0.1:1", "--connect-timeout", "1", "--no-master-compute"],
            "nothing listens on 127.0.0.1:1 (connection refused)",
        ),
        (["--worker", "localhost"], "is not HOST:PORT"),
        (["--workers-file", "/nonexistent/w.txt"], "cannot read workers file"),
        (["--local", "--worker", "127.0.0.1:5"], "--local runs no workers"),
    ],
)
def test_bad_worker_arguments_give_one_line_errors(args, message):
    run = subprocess.run(
        _hetconv("train", *TINY_RUN, "--no-progress", *args),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode in (1, 2)
    assert message in run.stderr
    assert "Traceback" not in run.stderr


def test_worker_down_at_start_is_reported_and_the_master_trains(tmp_path):
    trace = tmp_path / "t.jsonl"
    run = subprocess.run(
        _hetconv("train", *TINY_RUN, "--no-progress", "--worker", "127.0.0.1:1",
                 "--connect-timeout", "1", "--trace", str(trace)),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lost = "worker lost 127.0.0.1:1: reason worker 127.0.0.1:1: nothing listens on 127.0.0.1:1"
    assert lost in run.stderr
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records[0]["nodes"][1]["name"] == "127.0.0.1:1"
    assert records[0]["shares"]["conv2"][1] == 0


def test_one_worker_named_twice_is_a_one_line_error(workers):
    port = workers[0].rsplit(":", 1)[1]
    run = subprocess.run(
        _hetconv("train", *TINY_RUN, "--no-progress", "--worker", f"127.0.0.1:{port}",
                 "--worker", f"localhost:{port}", "--no-master-compute"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    (line,) = [x for x in run.stderr.splitlines() if x.startswith("hetconv train: error:")]
    assert f"workers 127.0.0.1:{port} and localhost:{port} are one worker process" in line


def _until_training(process) -> str:
    """Read the master's stderr up to its "training ..." line (the workers serve by then)."""
    lines = []
    for line in process.stderr:
        lines.append(line)
        if line.startswith("training "):
            return "".join(lines)
    raise AssertionError("the run ended before training began:\n" + "".join(lines))


def _wait_closed(addresses: list[str], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(_port_closed(a) for a in addresses):
            return True
        time.sleep(0.2)
    return False


def _long_embedded_run(*extra: str, **popen) -> subprocess.Popen:
    """``hetconv train`` on its embedded default for far longer than any test waits."""
    return subprocess.Popen(
        _hetconv("train", "--steps", "100000", "--batch", "8", "--train-size", "64",
                 "--no-progress", *extra),
        stderr=subprocess.PIPE, text=True, **popen,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="sends SIGINT, a POSIX signal")
def test_ctrl_c_stops_the_embedded_workers():
    process = _long_embedded_run()
    head = _until_training(process)
    time.sleep(1.0)
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=60)
    assert process.returncode == 130, head + rest
    addresses = _worker_addresses(head)
    assert len(addresses) == 2
    assert all(_port_closed(a) for a in addresses)


@pytest.mark.skipif(os.name != "posix", reason="sends SIGKILL, a POSIX signal")
def test_embedded_workers_end_with_a_killed_master():
    # SIGKILL leaves the master no chance to stop its workers: they notice the end of the
    # pipe to their standard input instead of serving forever.
    process = _long_embedded_run()
    try:
        addresses = _worker_addresses(_until_training(process))
        assert len(addresses) == 2 and not any(_port_closed(a) for a in addresses)
        process.kill()
    finally:
        process.kill()
        process.communicate(timeout=30)
    assert _wait_closed(addresses, 15), "a local worker outlived its master"


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="sends SIGINT to a process group")
def test_terminal_ctrl_c_finishes_the_step_and_checkpoints_with_the_workers(tmp_path):
    # A Ctrl-C at a terminal signals the whole foreground process group. The local workers
    # have their own session, so only the master sees it: it finishes the step with every
    # worker still serving (nobody is lost), checkpoints it, then stops the workers.
    folder = tmp_path / "ck"
    process = _long_embedded_run(
        "--checkpoint-dir", str(folder), "--checkpoint-every", "5000", start_new_session=True
    )
    try:
        head = _until_training(process)
        time.sleep(1.0)
        os.killpg(process.pid, signal.SIGINT)
        rest = process.communicate(timeout=60)[1]
    finally:
        process.kill()
        process.wait(timeout=30)
    output = head + rest
    assert process.returncode == 130, output
    assert "stopping after this step to write a checkpoint" in output
    step = int(output.split("hetconv: stopped after step ")[1].split()[0])
    assert (folder / f"ckpt-{step:08d}.npz").is_file(), output
    assert 0 < step < 5000
    assert "lost" not in output, output
    addresses = _worker_addresses(head)
    assert len(addresses) == 2 and _wait_closed(addresses, 15)


def test_embedded_master_leaves_its_workers_the_cores(monkeypatch):
    from threadpoolctl import threadpool_info

    from hetconv.master.launch import EmbeddedCluster

    def blas_threads():
        return {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}

    embedded = EmbeddedCluster(2, ClusterConfig())
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert embedded.master_blas_threads() == 1  # 2 cores, 2 one-thread workers: at least 1
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert embedded.master_blas_threads() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: 3)

    before = blas_threads()
    with EmbeddedCluster(2, ClusterConfig()) as embedded:
        model = Model(reference_spec(4, 6), seed=0, executor=embedded)
        embedded.prepare(model.conv_specs(), batch=2, log=None)
        assert blas_threads() == {1}  # while it trains
    assert blas_threads() == before  # given back
