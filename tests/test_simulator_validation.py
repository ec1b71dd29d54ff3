"""The simulator against real runs over tc-shaped links (``hetconv.simulations.validate``).

The runs need root, ``ip`` and ``tc`` (network namespaces, veth pairs, token buckets) and take a
minute or two: they are marked slow (``pytest -m slow``) and skipped, with the reason, where the
machine cannot build the testbed. The first tests check, without any of that, the pieces the
validation rests on: the goodput arithmetic, the probe figures read from the trace's plan record
and the cost model's wait of streamed calls on the master's own convolution.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from hetconv.costmodel import (
    SWITCHED,
    SimCluster,
    SimNode,
    WireCosts,
    WorkerCall,
    simulate_phase,
    simulate_step,
)
from hetconv.simulations import testbed
from hetconv.simulations.calibrate import read_plan, read_trace
from hetconv.simulations.scenario import parse_scenario
from hetconv.simulations.trace import read_steps
from hetconv.simulations.validate import TARGET_ERROR, probe_speeds, run_case
from hetconv.workload import call_bytes, network_layers

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


# A trace by hand: plan and step records, with only the fields the readers need.

WORKER = "10.213.1.2:50051"
PROBES = ({"conv1": 9.9e-3, "conv2": 11.5e-3}, {"conv1": 6.1e-3, "conv2": 9.6e-3})  # per node
SHARES = {"conv1": [3, 5], "conv2": [7, 9]}  # the tiny network: 8 and 16 kernels


def _plan(start_step: int, master: dict, worker: dict, shares: dict) -> dict:
    """A plan record as the master writes it where a run starts (nodes in order, master
    first); no "step" key."""
    return {
        "event": "plan",
        "start_step": start_step,
        "nodes": [
            {"name": "master", "description": "AMD EPYC (cpu)", "probe_seconds": master,
             "link_bytes_per_second": None, "link_latency_seconds": None},
            {"name": WORKER, "description": "AMD EPYC (cpu, 2 cores)", "probe_seconds": worker,
             "link_bytes_per_second": 1e6, "link_latency_seconds": 6e-4},
        ],
        "shares": shares,
    }  # fmt: skip


def _step(step: int) -> dict:
    """A step record of a run with :data:`SHARES` (the figures the readers need)."""
    nodes: dict[str, dict] = {"master": {}, WORKER: {}}
    for layer, (mine, theirs) in SHARES.items():
        nodes["master"][layer] = {"kernels": mine}
        nodes[WORKER][layer] = {"kernels": theirs}
    return {"step": step, "batch": 16, "seconds": 0.1, "nodes": nodes}


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def test_probe_figures_are_read_from_the_traces_plan_record(tmp_path):
    trace = _write(tmp_path / "run.jsonl", [_plan(0, *PROBES, SHARES), _step(0), _step(1)])
    plan = read_plan(trace)
    assert list(plan.probe_seconds().values()) == [
        {"conv1": pytest.approx(9.9e-3), "conv2": pytest.approx(11.5e-3)},
        {"conv1": pytest.approx(6.1e-3), "conv2": pytest.approx(9.6e-3)},
    ]
    assert plan.node_names == ["master", WORKER] and plan.start_step == 0
    assert plan.shares == {"conv1": (3, 5), "conv2": (7, 9)}
    assert plan.nodes[1].link_bytes_per_second == 1e6
    assert plan.nodes[0].link_latency_seconds is None
    # A master that computes no share has no figures.
    off = _plan(0, {}, PROBES[1], {"conv1": [0, 8], "conv2": [0, 16]})
    assert read_plan(_write(tmp_path / "off.jsonl", [off, _step(0)])).nodes[0].probe_seconds == {}
    with pytest.raises(ValueError, match="has no plan record: written by an older hetconv"):
        read_plan(_write(tmp_path / "old.jsonl", [_step(0), _step(1)]))
    bad = _plan(0, *PROBES, {"conv1": [3]})  # one share for two nodes
    with pytest.raises(ValueError, match=r"bad.jsonl:1: plan record: shares of conv1"):
        read_plan(_write(tmp_path / "bad.jsonl", [bad, _step(0)]))


def test_step_readers_skip_plan_records_and_each_step_has_its_runs_plan(tmp_path):
    # A run, then a resumed one from step 2 (probed again: another plan record).
    resumed = {"conv1": 5.0e-3, "conv2": 8.0e-3}
    trace = _write(
        tmp_path / "run.jsonl",
        [_plan(0, *PROBES, SHARES), _step(0), _step(1),
         _plan(2, PROBES[0], resumed, SHARES), _step(2), _step(3)],
    )  # fmt: skip
    assert [r["step"] for r in read_steps(trace)] == [0, 1, 2, 3]
    assert [r["step"] for r in read_trace(trace)] == [0, 1, 2, 3]
    assert read_plan(trace, 1).nodes[1].probe_seconds == PROBES[1]
    assert read_plan(trace, 2).nodes[1].probe_seconds == resumed
    assert read_plan(trace).start_step == 2  # without a step: the latest
    late = _write(tmp_path / "late.jsonl", [_plan(5, *PROBES, SHARES), _step(5)])
    with pytest.raises(ValueError, match="no plan record at or before step 2"):
        read_plan(late, 2)
    only_plan = _write(tmp_path / "plan.jsonl", [_plan(0, *PROBES, SHARES)])
    with pytest.raises(ValueError, match="holds no steps"):
        read_trace(only_plan)


def test_probe_speeds_are_the_plan_records_probes(tmp_path):
    layers = network_layers("tiny", 16)
    cal = SimpleNamespace(node_names=["master", WORKER], step_numbers=[1, 2])
    trace = _write(tmp_path / "run.jsonl", [_plan(0, *PROBES, SHARES), _step(0), _step(1)])
    gflops = probe_speeds(trace, cal, layers)
    for per_layer, probes in zip(gflops, PROBES, strict=True):
        for layer in layers:
            flops = layer.shape.flops_forward * layer.step_passes
            assert per_layer[layer.name] == pytest.approx(flops / probes[layer.name] / 1e9)
    # A master with no probe (it computes nothing) gets the others' median.
    off = _write(tmp_path / "off.jsonl", [_plan(0, {}, PROBES[1], SHARES), _step(0)])
    master, worker = probe_speeds(off, cal, layers)
    assert master == {
        layer.name: pytest.approx(np.median(list(worker.values()))) for layer in layers
    }
    stranger = SimpleNamespace(node_names=["master", "10.213.9.2:50051"], step_numbers=[1])
    with pytest.raises(ValueError, match="names no node 10.213.9.2:50051"):
        probe_speeds(trace, stranger, layers)
    old = _write(tmp_path / "old.jsonl", [_step(0), _step(1)])
    with pytest.raises(ValueError, match="written by an older hetconv"):
        probe_speeds(old, cal, layers)


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
    master, worker = SimNode("m", 50.0), SimNode("w", 50.0, bytes_per_s=12.5e6, rtt_s=1e-4)

    def step(stall: float):
        cluster = SimCluster(master, (worker,), SWITCHED, wire=WireCosts(compute_stall=stall))
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
