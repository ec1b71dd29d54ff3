"""The simulator against real runs over tc-shaped links (``hetconv.simulations.validate``).

The runs need root, ``ip`` and ``tc`` (network namespaces, veth pairs, token buckets) and take a
minute or two: they are marked slow (``pytest -m slow``) and skipped, with the reason, where the
machine cannot build the testbed. The first tests check, without any of that, the pieces the
validation rests on: the goodput arithmetic, the probe figures read from the master's log and the
cost model's wait of streamed calls on the master's own convolution.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetconv.costmodel import (
    SWITCHED,
    Cluster,
    Node,
    WireCosts,
    WorkerCall,
    call_bytes,
    network_layers,
    simulate_phase,
    simulate_step,
)
from hetconv.simulations import testbed
from hetconv.simulations.scenario import parse_scenario
from hetconv.simulations.validate import TARGET_ERROR, probe_seconds_from_log, run_case

# (Through the module: pytest would collect names that start with "test".)
tcp_goodput_mbps = testbed.tcp_goodput_mbps
UNAVAILABLE = testbed.testbed_unavailable()
needs_testbed = pytest.mark.skipif(
    UNAVAILABLE is not None, reason=f"shaped-link testbed: {UNAVAILABLE}"
)

# -- without the testbed -------------------------------------------------------------------------


def test_goodput_is_the_payload_share_of_ethernet_frames():
    # 1448 bytes of payload (1500 - 20 IP - 32 TCP with timestamps) in 1514 bytes on the wire.
    assert tcp_goodput_mbps(100) == pytest.approx(100 * 1448 / 1514)
    assert tcp_goodput_mbps(5, mtu=9000) == pytest.approx(5 * 8948 / 9014)


def test_probe_figures_are_read_from_the_masters_log():
    log = (
        "kernel shares (probe: forward + backward of the layer's real shape):\n"
        "  master                AMD EPYC (cpu)\n"
        "                        conv1 3/8 (probe 9.9 ms), conv2 7/16 (probe 11.5 ms)\n"
        "  10.213.1.2:50051      AMD EPYC (cpu, 2 cores), link 1 MB/s rtt 0.6 ms\n"
        "                        conv1 5/8 (probe 6.1 ms), conv2 9/16 (probe 9.6 ms)\n"
        "training tiny on synthetic (1000 images, 0 held out): 6 steps of batch 16\n"
    )
    assert probe_seconds_from_log(log) == [
        {"conv1": pytest.approx(9.9e-3), "conv2": pytest.approx(11.5e-3)},
        {"conv1": pytest.approx(6.1e-3), "conv2": pytest.approx(9.6e-3)},
    ]
    mine = "conv1 3/8 (probe 9.9 ms), conv2 7/16 (probe 11.5 ms)"
    off = log.replace(mine, "conv1 0/8 (probe off), conv2 0/16 (probe off)")
    assert probe_seconds_from_log(off)[0] == {}
    assert probe_seconds_from_log("no table here") == []


def test_streamed_transfers_slow_down_while_the_master_computes():
    megabyte = 1e6
    # 1 MB each way at 1 MB/s; the master computes for 1 s, during which a streamed transfer
    # moves at 0.6 MB/s: 0.6 MB by t=1, the rest 0.4 s later, then the answer: ends at 2.4.
    streamed = WorkerCall(megabyte, megabyte, 0.0, 0.0, 0.0, megabyte, streamed=True)
    bundled = WorkerCall(megabyte, megabyte, 0.0, 0.0, 0.0, megabyte)
    ends = simulate_phase([streamed, bundled], SWITCHED, math.inf, math.inf, 1.0, 0.4)
    np.testing.assert_allclose(ends, [2.4, 2.0])
    # No stall without it, and a full stall holds even an unlimited flow until the master is done.
    np.testing.assert_allclose(
        simulate_phase([streamed], SWITCHED, math.inf, math.inf, 1.0, 0.0), [2.0]
    )
    unlimited = WorkerCall(megabyte, 0.0, 0.0, 0.0, 0.0, math.inf, streamed=True)
    np.testing.assert_allclose(
        simulate_phase([unlimited], SWITCHED, math.inf, math.inf, 1.0, 1.0), [1.0]
    )


def test_a_step_with_streamed_calls_pays_the_stall_and_bundled_ones_do_not():
    layers = network_layers("paper-50-500", 8)
    shares = {"conv1": (25, 25), "conv2": (250, 250)}
    assert call_bytes(layers[0], "forward", 25).bundled
    assert not call_bytes(layers[1], "forward", 250).bundled
    master, worker = Node("m", 50.0), Node("w", 50.0, bytes_per_s=12.5e6, rtt_s=1e-4)

    def step(stall: float):
        cluster = Cluster(master, (worker,), SWITCHED, wire=WireCosts(compute_stall=stall))
        return simulate_step(cluster, layers, shares, 0.0)

    for plain, stalled in zip(step(0.0).phases, step(0.4).phases, strict=True):
        layer = layers[0 if plain.layer == "conv1" else 1]
        if layer.name == "conv1":
            assert stalled.wall_s == pytest.approx(plain.wall_s)
        else:
            # Each request starts after the call's fixed cost and outlasts the master's compute:
            # it loses 0.4 of the rest of that compute.
            master_s = master.conv_seconds(layer, 250, layer.passes(plain.phase))
            start = WireCosts().stream_call_s + worker.rtt_s / 2
            assert stalled.wall_s == pytest.approx(plain.wall_s + 0.4 * (master_s - start))


def test_scenarios_set_the_stall_and_refuse_more_than_a_full_one():
    data = {
        "network": {"kind": "switched", "bandwidth_mbps": 100},
        "sweep": {"nodes": [1], "networks": ["tiny"], "batches": [8]},
        "master": {"gflops": 10},
        "wire": {"compute_stall": 0.0},
    }
    assert parse_scenario(data, "x.toml").wire.compute_stall == 0.0
    data["wire"]["compute_stall"] = 1.5
    with pytest.raises(ValueError, match=r"x.toml: \[wire\] compute_stall must be at most 1"):
        parse_scenario(data, "x.toml")
    with pytest.raises(ValueError, match="compute stall"):
        WireCosts(compute_stall=-0.1)


# -- with the testbed ----------------------------------------------------------------------------


@pytest.mark.slow
@needs_testbed
def test_testbed_shapes_both_directions_and_leaves_nothing_behind():
    bed = testbed.Testbed(2, 20.0)
    with pytest.raises(KeyboardInterrupt):
        with bed:
            assert len(bed.leftovers()) == 4  # two namespaces, two root-side veth ends
            for link in bed.links:
                assert 0 < bed.ping(link) < 0.005
            assert bed.goodput_mbps(bed.links[0], seconds=0.5) == pytest.approx(
                tcp_goodput_mbps(20.0), rel=0.1
            )
            bed.start_workers()
            processes = list(bed.processes)
            raise KeyboardInterrupt  # as Ctrl-C would, mid-run
    assert bed.leftovers() == []
    assert all(p.poll() is not None for p in processes)


@pytest.mark.slow
@needs_testbed
@pytest.mark.parametrize(
    ("preset", "workers", "rate", "steps"),
    [
        ("tiny", 2, 5.0, 5),  # bandwidth-bound: ~2 s per step, every call bundled
        # ~0.1 s steps: per-call costs and compute count, and this machine's noise (a slow step
        # moves a short mean: more steps)
        ("tiny", 1, 100.0, 9),
        ("paper-50-500", 1, 100.0, 5),  # streamed calls, and their wait on the master
    ],
)
def test_the_simulator_predicts_a_real_run_on_shaped_links(preset, workers, rate, steps):
    batch = 16 if preset == "tiny" else 8
    case = run_case(preset, batch, steps, workers, rate, check_link=False)
    assert case.steps == steps - 1
    assert case.tbf_drops == 0
    shown = (
        f"{preset} {workers} worker(s) {rate:g} Mbit/s: measured {case.measured_s:.3f} s, "
        f"predicted {case.predicted_s:.3f} s ({100 * case.error:+.1f} %)"
    )
    assert abs(case.error) <= TARGET_ERROR, shown
    comm_error = case.predicted_comm_s / case.measured_comm_s - 1
    assert abs(comm_error) <= TARGET_ERROR, shown + f"; comm {100 * comm_error:+.1f} %"


@pytest.mark.slow
@needs_testbed
def test_link_policy_leaves_out_a_worker_behind_a_slow_real_link():
    # Measurement to shares, end to end: the master measures each worker's link at connect
    # (echo over the shaped veth), and --shares link gives the 5 Mbit/s worker nothing while
    # the 1000 Mbit/s one keeps kernels; the paper's rule, blind to links, gives both some.
    from hetconv.master.cluster import Cluster, ClusterConfig
    from hetconv.model import Model, load_spec

    with testbed.Testbed(2, 1000) as bed:
        bed.shape(bed.links[1], 5)
        fast, slow = bed.start_workers()
        shares = {}
        for policy in ("compute", "link"):
            config = ClusterConfig(share_policy=policy, token=bed.token, connect_timeout=60)
            with Cluster([fast, slow], config=config) as cluster:
                model = Model(load_spec("paper-50-500"), seed=0, executor=cluster)
                cluster.prepare(model.conv_layers(), batch=16, log=None)
                assert cluster.nodes[2].link_bytes_per_second < 1e6  # 5 Mbit/s: 0.6 MB/s
                shares[policy] = {name: plan.shares for name, plan in cluster.plans.items()}
    assert all(s[2] == 0 for s in shares["link"].values()), shares
    assert sum(s[1] for s in shares["link"].values()) > 0, shares
    assert all(s[1] > 0 and s[2] > 0 for s in shares["compute"].values()), shares
