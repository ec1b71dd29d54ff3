"""The data-parallel peer: its cost model (:mod:`hetconv.dataparallel`), its rows in
``hetconv simulate``, and the exactness of ``benchmarks/ddp_rank.py``'s weighted DDP step
(real gloo processes on loopback) and of its torch model built from hetconv's spec."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hetconv.cli.simulate import main as simulate_main
from hetconv.costmodel import SWITCHED, WIFI, SimCluster, SimNode
from hetconv.dataparallel import (
    PARAMETER_SERVER,
    RING,
    CollectiveCosts,
    batch_weights,
    buckets,
    exchange_seconds,
    master_link_bytes,
    parameter_bytes,
    proportional_batches,
    simulate_data_parallel,
)
from hetconv.imagecost import simulate_image_split
from hetconv.model import PRESETS, Model, load_spec

ROOT = Path(__file__).resolve().parents[1]
RANK = ROOT / "benchmarks" / "ddp_rank.py"
MBYTE = 1e6
#: Costs with no latency, no software limit and free sums: the links alone.
LINKS_ONLY = CollectiveCosts(message_s=0.0, tcp_bytes_per_s=math.inf, sum_bytes_per_s=math.inf)


def _switched(workers: int, rate: float = 100 * MBYTE, gflops=(50.0,)) -> SimCluster:
    speeds = [gflops[i % len(gflops)] for i in range(workers + 1)]
    master = SimNode("m", speeds[0], bytes_per_s=rate)
    nodes = tuple(SimNode(f"w{i}", s, bytes_per_s=rate) for i, s in enumerate(speeds[1:]))
    return SimCluster(master, nodes, SWITCHED)


def _wifi(workers: int, rate: float = 100 * MBYTE) -> SimCluster:
    return SimCluster(
        SimNode("m", 50.0), tuple(SimNode(f"w{i}", 50.0) for i in range(workers)), WIFI, rate
    )


# -- the model's parameters and batches ---------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "paper-50-500"])
def test_gradient_bytes_are_the_models_parameters(preset):
    parameters = Model(PRESETS[preset]).parameters().values()
    assert parameter_bytes(load_spec(preset)) == sum(4 * p.size for p in parameters)


def test_buckets_follow_ddp_first_small_then_capped_and_hold_every_gradient():
    spec = load_spec("paper-500-1500")
    sizes = buckets(spec, CollectiveCosts())
    assert sum(size for size, _ in sizes) == parameter_bytes(spec)
    # fc first (backward reaches it first), conv2's 75 MB weight alone past the cap, conv1 last
    assert [block for _, block in sizes] == [1, 1, 0]
    assert sizes[1][0] > CollectiveCosts().bucket_bytes


@pytest.mark.parametrize(
    "batch, seconds, expected",
    [(16, [1, 0.5, 1], [4, 8, 4]), (7, [1, 1], [4, 3]), (10, [3, 1, 1], [2, 4, 4])],
)
def test_batches_are_proportional_to_speed_and_sum_exactly(batch, seconds, expected):
    batches = proportional_batches(batch, seconds)
    assert batches == expected and sum(batches) == batch
    assert sum(batch_weights(batches)) == pytest.approx(1.0)


def test_a_twice_as_fast_rank_gets_twice_the_images_and_finishes_with_the_others():
    cluster = _switched(2, gflops=(50.0, 100.0, 50.0))
    r = simulate_data_parallel(cluster, "paper-50-500", 16, 0.0, overlap=False)
    assert r.batches == (4, 8, 4)
    alone = simulate_data_parallel(_switched(0), "paper-50-500", 16, 0.0)
    assert alone.step_s == pytest.approx(alone.local_s)  # one rank: no exchange at all
    assert r.compute_s == pytest.approx(alone.local_s / 4)


# -- the exchange -------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2, 4, 7])
def test_ring_moves_2_n_minus_1_over_n_per_rank_and_the_server_n_minus_1_times(workers):
    n, size, rate = workers + 1, 80 * MBYTE, 100 * MBYTE
    cluster = _switched(workers, rate)
    ring = exchange_seconds(cluster, size, RING, LINKS_ONLY)
    server = exchange_seconds(cluster, size, PARAMETER_SERVER, LINKS_ONLY)
    assert ring == pytest.approx(2 * (n - 1) / n * size / rate)
    assert server == pytest.approx(2 * (n - 1) * size / rate)  # in through its port, then out
    assert master_link_bytes(cluster, size, RING) == pytest.approx(4 * (n - 1) / n * size)
    assert master_link_bytes(cluster, size, PARAMETER_SERVER) == pytest.approx(2 * (n - 1) * size)
    assert ring <= server


@pytest.mark.parametrize("algorithm", [RING, PARAMETER_SERVER])
@pytest.mark.parametrize("workers", [1, 3])
def test_a_shared_medium_is_slower_than_switched_links_at_the_same_rate(algorithm, workers):
    size = 40 * MBYTE
    switched = exchange_seconds(_switched(workers), size, algorithm, LINKS_ONLY)
    wifi = exchange_seconds(_wifi(workers), size, algorithm, LINKS_ONLY)
    assert wifi >= switched
    if algorithm == RING and workers > 1:
        assert wifi > switched  # every round moves the whole gradient through one medium
    step = {
        name: simulate_data_parallel(cluster, "paper-50-500", 16, 0.1, algorithm).step_s
        for name, cluster in (("switched", _switched(workers)), ("wifi", _wifi(workers)))
    }
    assert step["wifi"] >= step["switched"]


def test_latency_and_software_costs_only_add():
    cluster = _switched(3)
    free = exchange_seconds(cluster, 10 * MBYTE, RING, LINKS_ONLY)
    assert exchange_seconds(cluster, 10 * MBYTE, RING, CollectiveCosts()) > free
    slow = CollectiveCosts().scaled(0.25)
    assert exchange_seconds(cluster, 10 * MBYTE, RING, slow) > exchange_seconds(
        cluster, 10 * MBYTE, RING, CollectiveCosts()
    )


@pytest.mark.parametrize("network", ["tiny", "paper-50-500", "paper-500-1500"])
@pytest.mark.parametrize("batch", [8, 64])
@pytest.mark.parametrize("algorithm", [RING, PARAMETER_SERVER])
@pytest.mark.parametrize("make", [_switched, _wifi])
def test_overlap_is_never_slower_and_never_beats_compute(network, batch, algorithm, make):
    cluster = make(3, 20 * MBYTE)
    on = simulate_data_parallel(cluster, network, batch, 0.05, algorithm, overlap=True)
    off = simulate_data_parallel(cluster, network, batch, 0.05, algorithm, overlap=False)
    assert on.step_s <= off.step_s * (1 + 1e-9)
    assert on.step_s >= max(on.compute_s, on.bucket_ends_s[-1]) - 1e-12
    assert off.step_s == pytest.approx(off.compute_s + off.exchange_s)
    assert on.conv_s + on.other_s == pytest.approx(on.compute_s)


@pytest.mark.parametrize("network", ["paper-150-800", "paper-500-1500"])
def test_kernel_gradients_first_make_buckets_ready_before_backward_has_passed_the_layer(network):
    """hetconv's split by images computes a convolution's kernel gradient before its input
    gradient (``kernels_first``): each bucket of a convolution's weights is ready earlier, so
    its ring ends no later and the last one sooner where the last convolution's input
    gradient follows it; the compute is the same."""
    cluster = _switched(3, 20 * MBYTE)
    plain = simulate_data_parallel(cluster, network, 64, 0.05, RING, overlap=True)
    first = simulate_data_parallel(cluster, network, 64, 0.05, RING, overlap=True,
                                   kernels_first=True)  # fmt: skip
    assert first.compute_s == pytest.approx(plain.compute_s)
    pairs = zip(first.bucket_ends_s, plain.bucket_ends_s, strict=True)
    assert all(a <= b + 1e-12 for a, b in pairs)
    assert first.bucket_ends_s[0] < plain.bucket_ends_s[0]  # conv2's: before its input grad
    assert first.step_s <= plain.step_s + 1e-12


def test_measured_speeds_replace_the_modelled_ones():
    cluster = _switched(1, rate=math.inf)
    r = simulate_data_parallel(
        cluster, "tiny", 10, 0.0, costs=LINKS_ONLY, image_seconds=[0.1, 0.4], overlap=False
    )
    assert r.batches == (8, 2)
    assert r.compute_s == pytest.approx(0.8)
    assert r.local_s == pytest.approx(1.0)
    with pytest.raises(ValueError, match="one per rank"):
        simulate_data_parallel(cluster, "tiny", 10, 0.0, image_seconds=[0.1])
    with pytest.raises(ValueError, match="summing to 10"):
        simulate_data_parallel(cluster, "tiny", 10, 0.0, batches=[5, 4])
    with pytest.raises(ValueError, match="not one of"):
        exchange_seconds(cluster, 1.0, "tree")


# -- hetconv simulate ---------------------------------------------------------------------------


def test_simulate_shows_the_data_parallel_rows_beside_the_kernel_split(capsys, tmp_path):
    path = tmp_path / "rows.json"
    argv = ["this-machine", "--nodes", "3", "--batch", "16", "--network", "paper-50-500",
            "--quiet", "--json", str(path)]  # fmt: skip
    assert simulate_main(argv) == 0
    table = capsys.readouterr().out
    for policy in ("compute", "link", "dp-ring", "dp-ring-seq", "dp-ps", "dp-ps-seq"):
        assert f" {policy} " in table, policy
    assert table.count("*") == 1  # one fastest, data parallelism competing
    rows = {r["policy"]: r for r in json.loads(path.read_text())}
    assert sum(rows["dp-ring"]["shares"]["batch"]) == 16
    assert rows["dp-ring"]["step_s"] <= rows["dp-ring-seq"]["step_s"]
    assert simulate_main([*argv[:-2], "--no-data-parallel"]) == 0
    assert "dp-" not in capsys.readouterr().out


# -- the DDP peer: real processes ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torch_twin_built_from_the_spec_computes_hetconvs_model():
    torch = pytest.importorskip("torch", reason="PyTorch is the DDP peer; install the dev extra")
    sys.path.insert(0, str(RANK.parent))
    try:
        from ddp_rank import torch_model
    finally:
        sys.path.remove(str(RANK.parent))
    for preset in ("tiny",):
        model = Model(PRESETS[preset], seed=3)
        net = torch_model(preset)
        state = {k: torch.from_numpy(v.copy()) for k, v in model.parameters().items()}
        net.load_state_dict(state, strict=True)
        x = np.random.default_rng(0).standard_normal((3, 3, 32, 32), dtype=np.float32)
        ours, theirs = model.forward(x), net(torch.from_numpy(x)).detach().numpy()
        assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max()


def _ddp_and_alone_step(tmp_path, network: str, *flags: str) -> tuple:
    """One SGD step of DDP on 2 ranks (slices of 3 and 5 images) and of one process on the
    8: (DDP rank 0's state after it, the process's, the initial state)."""
    port = str(_free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    common = [sys.executable, str(RANK), "--network", network, "--batch", "8", "--lr", "0.5",
              "--seed", "4", *flags]  # fmt: skip
    ranks = [
        subprocess.Popen(
            [
                *common,
                "--world",
                "2",
                "--rank",
                str(rank),
                "--port",
                port,
                "--ifname",
                "lo",
                "--batches",
                "3,5",
                "--check",
                str(tmp_path / f"ddp{rank}.npz"),
                "--timeout",
                "60",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    for rank, process in enumerate(ranks):
        try:
            output, _ = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for other in ranks:
                other.kill()
            pytest.fail(f"ddp rank {rank} still running after 120 s: {process.communicate()[0]}")
        assert process.returncode == 0, output
    alone = subprocess.run(
        [*common, "--alone", "--check", str(tmp_path / "alone.npz")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    sys.path.insert(0, str(RANK.parent))
    try:
        from ddp_rank import torch_model
    finally:
        sys.path.remove(str(RANK.parent))
    initial = {k: v.detach().numpy() for k, v in torch_model(network, 4).state_dict().items()}
    return np.load(tmp_path / "ddp0.npz"), np.load(tmp_path / "alone.npz"), initial


def _step_errors(ddp, one, initial) -> dict[str, float]:
    """Per state entry: how far DDP's change in the step is from one process's, relative to
    the latter's largest."""
    assert set(ddp) == set(one) == set(initial)
    errors = {}
    for name in one:  # the step's change must agree, not just the (much larger) weights
        moved = one[name] - initial[name]
        assert np.abs(moved).max() > 0, name
        error = np.abs((ddp[name] - initial[name]) - moved).max()
        errors[name] = error / (np.abs(moved).max() + 1e-2)
    return errors


@pytest.mark.slow
def test_weighted_ddp_step_on_unequal_slices_equals_one_process_on_the_global_batch(tmp_path):
    pytest.importorskip("torch", reason="PyTorch is the DDP peer; install the dev extra")
    errors = _step_errors(*_ddp_and_alone_step(tmp_path, "tiny"))
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.slow
def test_ddp_with_synced_batch_norm_trains_one_processs_model_and_without_it_does_not(tmp_path):
    """resnet20 (21 batch norms): with ``--synced-batchnorm`` DDP's step equals one process's
    on the whole batch, running statistics included; each rank normalising its own slice,
    it does not."""
    pytest.importorskip("torch", reason="PyTorch is the DDP peer; install the dev extra")
    synced = _step_errors(*_ddp_and_alone_step(tmp_path, "resnet20", "--synced-batchnorm"))
    assert max(synced.values()) <= 1e-4, sorted(synced.items(), key=lambda kv: -kv[1])[:5]
    local = _step_errors(*_ddp_and_alone_step(tmp_path, "resnet20"))
    assert local["bn1.running_mean"] > 1e-2 and max(local.values()) > 1e-2, local


def _vs_ddp(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vs_ddp.py"), *argv],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.slow
def test_vs_ddp_explains_itself_and_refuses_bad_input_by_name():
    helped = _vs_ddp("--help")
    assert helped.returncode == 0
    assert "DDP" in helped.stdout and "--json" in helped.stdout
    for argv, message in [
        (["--network", "nope"], "--network 'nope' is not one of"),
        (["--batch", "2", "--workers", "2"], "every DDP rank needs an image"),
        (["--mode", "warp"], "--mode: mode 'warp' is not one of"),
        (["--workers", "4", "--cap", "0.9"], "more than 1.8 cores"),
    ]:
        done = _vs_ddp(*argv)
        assert done.returncode == 2, (argv, done.stderr)
        assert message in done.stderr, (argv, done.stderr)


def _vs_ddp_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import vs_ddp
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return vs_ddp


def test_the_winner_is_the_fastest_of_hetconv_ddp_and_the_faster_engine_alone():
    winner = _vs_ddp_module().winner
    assert winner(1.0, 2.0, [3.0, 4.0]) == "hetconv"
    assert winner(2.0, 1.0, [3.0, 4.0]) == "ddp"
    assert winner(2.0, 3.0, [4.0, 1.5]) == "one machine"
    assert winner(None, 1.0, [1.0, 1.0]) is None and winner(1.0, 1.0, [None, 1.0]) is None


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the testbed needs root (namespaces, tc, cgroups)")
def test_a_tiny_vs_ddp_run_gives_a_full_row(tmp_path):
    from hetconv.simulations.testbed import cluster_testbed_unavailable

    why = cluster_testbed_unavailable("shared")
    if why is not None:
        pytest.skip(f"testbed: {why}")
    path = tmp_path / "rows.json"
    done = _vs_ddp("--network", "tiny", "--batch", "8", "--workers", "1", "--link", "shared",
                   "--steps", "2", "--json", str(path), timeout=1200)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(path.read_text())
    for key in ("hetconv_step_s", "ddp_step_s", "ratio", "predicted_winner", "measured_winner",
                "hetconv_alone_s", "torch_alone_s", "ddp_predicted_s", "hetconv_worker_mb",
                "ddp_worker_mb"):  # fmt: skip
        assert row[key] is not None, key
    assert sum(row["ddp_batches"]) == 8 and len(row["ddp_batches"]) == 2
    assert row["ratio"] == pytest.approx(row["hetconv_step_s"] / row["ddp_step_s"])


def test_the_default_mode_gives_hetconv_train_no_mode_flag():
    # vs_ddp --mode default measures what a user gets from `hetconv train` as it is: no flag,
    # not the paper's kernel split under the mode's flags.
    _vs_ddp_module()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import testbed_modes
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    modes = {mode.name: mode for mode in testbed_modes.MODES}
    assert modes["default"].arguments("switched") == []
    assert modes["fused"].arguments("switched")[:2] == ["--shares", "compute"]
    chosen, notes = testbed_modes.runnable_modes(["default"], "")
    assert [m.name for m in chosen] == ["default"] and not notes


@pytest.mark.parametrize("cluster", [_switched(3), _wifi(3)], ids=["switched", "wifi"])
def test_the_image_split_is_a_parameter_server_that_also_sends_the_images(cluster):
    # hetconv --split images: the ps exchange without overlap, plus every worker's images
    # (one byte a value) through the master's link (the medium on Wi-Fi) each step.
    ps = simulate_data_parallel(cluster, "tiny", 32, 0.01, PARAMETER_SERVER, False, LINKS_ONLY)
    got = simulate_image_split(cluster, "tiny", 32, 0.01, LINKS_ONLY)
    images = sum(got.batches[1:]) * 3 * 32 * 32
    assert got.batches == ps.batches and sum(got.batches[1:]) > 0
    assert got.master_bytes == ps.master_bytes + images
    assert got.step_s == pytest.approx(ps.step_s + images / (100 * MBYTE))
    float32 = simulate_image_split(cluster, "tiny", 32, 0.01, LINKS_ONLY, image_bytes=4 * 3072)
    assert float32.master_bytes == ps.master_bytes + 4 * images


def test_the_testbed_predicts_a_run_split_by_images_from_its_trace(tmp_path):
    # benchmarks/testbed_predict.predict reads a --split images trace: each node's measured
    # seconds per image (median after the first step) and the last step's images, through
    # simulate_image_split on the testbed's links.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import testbed_predict
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    spec = load_spec("tiny")
    names = ["master", "w1", "w2"]
    plan = {
        "event": "plan", "start_step": 0, "split": "images",
        "nodes": [{"name": n} for n in names],
        "model": {"name": "tiny", "spec": spec, "input_shape": [3, 32, 32], "batch": 16},
    }  # fmt: skip

    def step(i, images, seconds):
        figures = zip(names, images, seconds, strict=True)
        nodes = {n: {"images": k, "seconds": t} for n, k, t in figures}
        return {"step": i, "epoch": 0, "loss": 1.0, "accuracy": 0.1, "batch": 16,
                "seconds": 1.0, "comm_seconds": 0.0, "conv_seconds": 0.0, "comp_seconds": 0.0,
                "split": "images", "images": dict(zip(names, images, strict=True)), "nodes": nodes,
                "bytes_sent": 0, "bytes_received": 0}  # fmt: skip

    trace = tmp_path / "trace.jsonl"
    records = [plan, step(0, [6, 5, 5], [9.0, 9.0, 9.0]), step(1, [8, 4, 4], [0.8, 0.8, 0.4])]
    records.append(step(2, [8, 4, 4], [0.8, 0.8, 0.4]))
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    result, cal = testbed_predict.predict(str(trace), "switched", 1000.0, 1e-4, 1.0)
    assert cal.shares == {"images": [8, 4, 4]} and cal.image_seconds == [0.1, 0.2, 0.1]
    assert result.batches == (8, 4, 4) and result.algorithm == PARAMETER_SERVER
    assert not result.overlap and result.step_s > result.compute_s == pytest.approx(0.8)
    assert testbed_predict.predict_alone(cal) is None
    # a run that chose the split by images itself (--split auto) probed the master first:
    # its plan record's figure
    plan["prediction"] = {"step_s": 0.9, "alone_s": 2.5}
    trace.write_text("".join(json.dumps(r) + "\n" for r in [plan, *records[1:]]))
    _, cal = testbed_predict.predict(str(trace), "switched", 1000.0, 1e-4, 1.0)
    assert testbed_predict.predict_alone(cal) == pytest.approx(2.5)
