"""The cluster simulator: its bytes against a real run, its timing model's laws, its inputs and
outputs (scenario files, traces, the command, the plots)."""

from __future__ import annotations

import argparse
import io
import json
import math
import sys

import numpy as np
import pytest

from hetconv.balance import (
    COMPUTE,
    LINK,
    POLICIES,
    compute_shares,
    link_aware_shares,
    shares_for,
)
from hetconv.cli.simulate import add_arguments, main
from hetconv.costmodel import (
    MBIT,
    SWITCHED,
    WIFI,
    SimCluster,
    SimNode,
    WireCosts,
    WorkerCall,
    local_step_seconds,
    simulate_phase,
    simulate_step,
)
from hetconv.master.cluster import Cluster as RealCluster
from hetconv.master.cluster import ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.model import PRESETS, Model
from hetconv.simulations.calibrate import calibrate, read_plan
from hetconv.simulations.cli import POLICIES as CLI_POLICIES
from hetconv.simulations.cli import run
from hetconv.simulations.scenario import (
    Population,
    load_scenario,
    parse_scenario,
    shipped_scenarios,
)
from hetconv.simulations.sweep import run_scenario
from hetconv.simulations.trace import is_plan, read_records, read_steps
from hetconv.simulations.validate import predict
from hetconv.training import TrainConfig, train
from hetconv.wire import BUNDLE_BYTES
from hetconv.workload import BACKWARD, FORWARD, call_bytes, network_layers

# A real run whose calls are a mix: at batch 48 the tiny network's conv1 forward (x 590 kB + y
# of 3 kernels 590 kB) streams, every other call goes as one message each way.
TRACE_BATCH = 48
TRACE_SHARES = {"conv1": (3, 3, 2), "conv2": (6, 5, 5)}


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "steps.jsonl"
    config = TrainConfig(
        preset="tiny",
        steps=3,
        batch=TRACE_BATCH,
        train_size=2 * TRACE_BATCH,
        eval_size=0,
        trace=str(path),
        progress=False,
    )
    with LocalWorkers(2) as workers:
        with RealCluster(workers.addresses, config=ClusterConfig(shares=TRACE_SHARES)) as cluster:
            train(config, cluster, log=io.StringIO())
    return path


def _records(path):
    return read_steps(str(path))  # the step records (a plan record has no "step")


# -- bytes ---------------------------------------------------------------------------------------


def test_call_bytes_equal_what_a_real_two_worker_run_recorded(real_trace):
    layers = {layer.name: layer for layer in network_layers("tiny", TRACE_BATCH)}
    seen_streamed = seen_bundled = 0
    for record in _records(real_trace):
        names = list(record["nodes"])
        assert names[0] == "master" and len(names) == 3
        for layer_name, shares in TRACE_SHARES.items():
            layer, offset = layers[layer_name], shares[0]
            for node, share in zip(names[1:], shares[1:], strict=True):
                entry = record["nodes"][node][layer_name]
                assert entry["kernels"] == share
                for phase in (FORWARD, BACKWARD):
                    got = entry[phase]
                    want = call_bytes(layer, phase, share, offset, record["step"])
                    assert (got["bytes_sent"], got["bytes_received"], got["bundled"]) == (
                        want.sent,
                        want.received,
                        want.bundled,
                    ), (node, layer_name, phase, record["step"])
                    seen_bundled += got["bundled"]
                    seen_streamed += not got["bundled"]
                offset += share
    assert seen_streamed and seen_bundled  # both kinds of call were compared


def test_tensor_bytes_by_hand():
    conv1, conv2 = network_layers("tiny", 48)  # 3->8 then 8->16 kernels, 5x5 "same"
    forward = call_bytes(conv1, FORWARD, 3)
    assert forward.tensors_sent == 4 * (48 * 3 * 32 * 32 + 3 * 3 * 5 * 5 + 3)
    assert forward.tensors_received == 4 * 48 * 3 * 32 * 32
    assert not forward.bundled  # 1.18 MB > BUNDLE_BYTES
    backward = call_bytes(conv2, BACKWARD, 5)
    assert backward.tensors_sent == 4 * 48 * 5 * 16 * 16  # dy only: the worker kept x and w
    # dw, db and the full-size dx part (conv2 is not the first layer).
    assert backward.tensors_received == 4 * (5 * 8 * 5 * 5 + 5 + 48 * 8 * 16 * 16)
    assert backward.bundled == (backward.tensors_sent + backward.tensors_received <= BUNDLE_BYTES)
    first = call_bytes(conv1, BACKWARD, 3)
    assert first.tensors_received == 4 * (3 * 3 * 5 * 5 + 3)  # no dx for the first layer
    for call in (forward, backward, first):  # headers: small, but counted
        assert 0 < call.sent - call.tensors_sent < 200
        assert 0 < call.received - call.tensors_received < 200


@pytest.mark.parametrize("preset", ["tiny", "paper-50-500"])
def test_conv_layers_have_the_models_geometry(preset):
    model = Model(PRESETS[preset])
    layers = network_layers(preset, 4)
    assert [layer.name for layer in layers] == [c.name for c in model.conv_layers()]
    for layer, conv in zip(layers, model.conv_layers(), strict=True):
        s = layer.shape
        assert (s.c, s.h, s.w) == conv.input_shape
        assert (s.k, s.c, s.kh, s.kw) == conv.params["weight"].shape
        assert layer.need_input_grad == conv.need_input_grad


# -- the timing model ----------------------------------------------------------------------------


def _cluster(workers=3, mbps=100.0, fabric=SWITCHED, gflops=100.0, master_gflops=100.0):
    nodes = tuple(
        SimNode(f"w{i}", gflops, bytes_per_s=MBIT * mbps, rtt_s=1e-3) for i in range(workers)
    )
    master = SimNode("master", master_gflops, bytes_per_s=MBIT * mbps)
    return SimCluster(master, nodes, fabric, medium_bytes_per_s=MBIT * mbps)


def test_one_node_is_local_training():
    cluster = _cluster(workers=0)
    layers = network_layers("paper-150-800", 64)
    for policy in (COMPUTE, LINK):
        result = simulate_step(cluster, layers, shares_for(cluster, layers, policy), 0.5)
        assert result.comm_s == 0 and result.bytes == 0
        assert result.speedup == 1.0
        assert result.step_s == pytest.approx(local_step_seconds(cluster.master, layers, 0.5))
    rows = run_scenario(load_scenario("cpu-cluster"), nodes=[1])
    assert rows and all(r.speedup == 1.0 and r.comm_s == 0 for r in rows)


@pytest.mark.parametrize("name", ["gigabit-lan", "this-machine", "low-mid-range"])
def test_speedup_respects_amdahl_and_the_breakdown_adds_up(name):
    scenario = load_scenario(name)
    rows = run_scenario(scenario, networks=scenario.networks[:2], batches=scenario.batches[:1])
    assert any(r.speedup > 1.2 for r in rows)  # these clusters do pay somewhere
    for r in rows:
        assert r.step_s == pytest.approx(r.comm_s + r.conv_s + r.comp_s)
        assert r.amdahl_bound == pytest.approx(r.local_s / r.comp_s)
        assert r.speedup <= r.amdahl_bound
        assert r.comm_s >= 0 and r.conv_s > 0


@pytest.mark.parametrize("fabric", [SWITCHED, WIFI])
@pytest.mark.parametrize("policy", [COMPUTE, LINK])
def test_more_bandwidth_is_never_slower(fabric, policy):
    layers = network_layers("paper-300-1000", 64)
    for workers in (1, 3, 7):
        steps = []
        for mbps in (1, 5, 20, 100, 1000, 10_000, 100_000):
            cluster = _cluster(workers, mbps, fabric, gflops=60.0 + 10 * workers)
            shares = shares_for(cluster, layers, policy)
            steps.append(simulate_step(cluster, layers, shares, 1.0).step_s)
        assert all(b <= a * (1 + 1e-9) for a, b in zip(steps, steps[1:], strict=False)), steps


def test_link_aware_shares_give_a_terrible_link_nothing():
    good = [SimNode(f"good{i}", 200.0, bytes_per_s=MBIT * 1000, rtt_s=3e-4) for i in range(2)]
    awful = SimNode("awful", 2000.0, bytes_per_s=MBIT * 0.05, rtt_s=0.05)  # fast, but on 50 kbit/s
    cluster = SimCluster(
        SimNode("master", 100.0, bytes_per_s=MBIT * 1000), (*good, awful), SWITCHED
    )
    for layer in network_layers("paper-300-1000", 64):
        assert compute_shares(cluster, layer)[3] > 0  # the paper's rule sees only its speed
        shares = link_aware_shares(cluster, layer)
        assert shares[3] == 0
        assert sum(shares) == layer.kernels
    layers = network_layers("paper-300-1000", 64)
    by_policy = {
        p: simulate_step(cluster, layers, shares_for(cluster, layers, p), 1.0)
        for p in (COMPUTE, LINK)
    }
    assert by_policy[LINK].step_s < by_policy[COMPUTE].step_s
    assert by_policy[LINK].speedup > 1


def test_link_aware_shares_planned_fused_give_workers_more_and_predict_faster():
    # Fused, a kernel's maps travel pooled (4x fewer bytes with a 2x2 pool): on a link where
    # bytes decide, the rule hands the workers more kernels, and the step it predicts with
    # those shares run fused is faster than with the shares planned for the unfused bytes.
    cluster = _cluster(workers=3, mbps=100.0)
    layers = network_layers("paper-150-800", 16)
    assert all(layer.stage is not None for layer in layers)
    unfused = shares_for(cluster, layers, LINK)
    fused = shares_for(cluster, layers, LINK, stages="fused")
    for layer in layers:
        assert sum(fused[layer.name]) == layer.kernels
        assert sum(fused[layer.name][1:]) >= sum(unfused[layer.name][1:])
    assert any(sum(fused[n][1:]) > sum(unfused[n][1:]) for n in fused)
    with_fused = simulate_step(cluster, layers, fused, 0.5, stages="fused")
    with_unfused = simulate_step(cluster, layers, unfused, 0.5, stages="fused")
    assert with_fused.step_s < with_unfused.step_s
    with pytest.raises(ValueError, match="stages 'sideways'"):
        shares_for(cluster, layers, LINK, stages="sideways")


@pytest.mark.slow
def test_link_aware_shares_are_never_predicted_slower_than_the_master_alone():
    scenario = load_scenario("bandwidth-sweep")
    for r in run_scenario(scenario, policies=[LINK]):
        assert r.speedup >= 1 - 1e-9, r


def test_wifi_shares_one_medium_where_a_switch_separates_directions():
    megabyte = 1e6
    # Call A moves 1 MB each way; call B sends 2 MB. Until t=2 both requests share the master's
    # upstream (0.5 MB/s each). Then on a switch A's answer has the downstream to itself and B's
    # request the upstream: both end at t=3. On Wi-Fi they share the one medium: both end at t=4.
    calls = [
        WorkerCall(megabyte, megabyte, 0.0, 0.0, 0.0, math.inf),
        WorkerCall(2 * megabyte, 0.0, 0.0, 0.0, 0.0, math.inf),
    ]
    np.testing.assert_allclose(simulate_phase(calls, SWITCHED, megabyte, megabyte), [3.0, 3.0])
    np.testing.assert_allclose(simulate_phase(calls, WIFI, megabyte, megabyte), [4.0, 4.0])
    # A worker's own slower link caps its flow; the other takes the capacity left.
    capped = [
        WorkerCall(megabyte, 0.0, 0.0, 0.0, 0.0, 0.25 * megabyte),
        WorkerCall(megabyte, 0.0, 0.0, 0.0, 0.0, math.inf),
    ]
    np.testing.assert_allclose(
        simulate_phase(capped, SWITCHED, megabyte, megabyte), [4.0, 1 / 0.75]
    )


def test_a_phase_pays_call_costs_round_trips_and_compute():
    layer = network_layers("tiny", 8)[1]
    wire = WireCosts(bundle_call_s=1e-3, stream_call_s=5e-3, software_bytes_per_s=math.inf)
    worker = SimNode("w", 1.0, bytes_per_s=math.inf, rtt_s=0.01)
    cluster = SimCluster(SimNode("m", 1.0), (worker,), SWITCHED, wire=wire)
    shares = {layer.name: (8, 8)}
    phase = simulate_step(cluster, [layer], shares, 0.0).phases[0]
    compute = worker.conv_seconds(layer, 8, 1)
    assert call_bytes(layer, FORWARD, 8).bundled
    assert phase.wall_s == pytest.approx(max(compute + 1e-3 + 0.01, compute))
    assert phase.conv_s == pytest.approx(compute)
    assert phase.comm_s == pytest.approx(1e-3 + 0.01)


# -- scenarios -----------------------------------------------------------------------------------


def test_population_is_seeded_clipped_and_nested():
    population = Population(10.0, 50.0, sigma=0.5, seed=7)
    first = [d.gflops for d in population.draw(40)]
    assert first == [d.gflops for d in Population(10.0, 50.0, sigma=0.5, seed=7).draw(40)]
    assert first != [d.gflops for d in Population(10.0, 50.0, sigma=0.5, seed=8).draw(40)]
    assert [d.gflops for d in population.draw(10)] == first[:10]
    assert min(first) >= 10 and max(first) <= 50
    assert min(first) == 10 or max(first) == 50  # sigma 0.5 of the range: some get clipped
    scenario = load_scenario("cpu-cluster")
    one, two = scenario.cluster(32), scenario.cluster(32)
    assert [w.gflops for w in one.workers] == [w.gflops for w in two.workers]
    assert [w.name for w in one.workers[:3]] == ["i7-4700HQ", "i7-5500U", "i7-6700HQ"]


def test_every_shipped_scenario_loads_and_runs():
    names = shipped_scenarios()
    assert {
        "cpu-cluster", "gpu-cluster", "bandwidth-sweep", "mobile-gpus", "low-mid-range",
        "high-end",
    } <= set(names)  # fmt: skip
    for name, description in names.items():
        assert description, name
        scenario = load_scenario(name)
        rows = run_scenario(
            scenario,
            networks=scenario.networks[:1],
            batches=scenario.batches[:1],
            bandwidths_mbps=scenario.sweep_bandwidths()[:1],
        )
        assert len(rows) == len(scenario.nodes) * len(scenario.policies)
        for r in rows:
            assert math.isfinite(r.step_s) and r.step_s > 0 and r.speedup > 0
    assert max(load_scenario("mobile-gpus").nodes) == 128


def _write(tmp_path, text, name="bad.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


GOOD = """
[network]
kind = "switched"
bandwidth_mbps = 100
[sweep]
nodes = [1, 2]
networks = ["tiny"]
batches = [8]
[master]
gflops = 10
[[workers]]
gflops = 5
"""


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda t: t.replace("bandwidth_mbps = 100", "bandwith_mbps = 100"), "bandwith_mbps"),
        (lambda t: t.replace('kind = "switched"', 'kind = "ethernet"'), "kind"),
        (lambda t: t.replace("[master]\ngflops = 10", "[master]\nname = 'm'"), "gflops"),
        (lambda t: t.replace("gflops = 5", "gflops = -5"), "gflops"),
        (lambda t: t.replace("nodes = [1, 2]", "nodes = [1, 3]"), "nodes"),
        (lambda t: t.replace('networks = ["tiny"]', 'networks = ["nope"]'), "networks"),
        (lambda t: t.replace("[sweep]", "[sweeep]"), "sweeep"),
        (lambda t: t + "\n[comp]\ntiny = { per_image = 1 }\n", "per_image"),
        (lambda t: t.replace("batches = [8]", "batches = [8, 'x']"), "batches"),
        (lambda t: t.replace("[network]", "[network\n"), "TOML"),
    ],
)
def test_a_bad_scenario_file_is_a_value_error_naming_file_and_key(tmp_path, edit, named):
    assert load_scenario(str(_write(tmp_path, GOOD, "good.toml"))).nodes == (1, 2)
    path = _write(tmp_path, edit(GOOD))
    with pytest.raises(ValueError, match=named) as caught:
        load_scenario(str(path))
    assert str(path) in str(caught.value)


def test_unknown_scenario_names_the_shipped_ones():
    with pytest.raises(ValueError, match="cpu-cluster"):
        load_scenario("no-such-scenario")


def test_comp_figures_per_image_or_as_the_convolutions_share():
    data = {
        "network": {"kind": "wifi", "bandwidth_mbps": 5},
        "sweep": {"nodes": [1], "networks": ["paper-50-500"], "batches": [64]},
        "master": {"gflops": 50},
        "comp": {"paper-50-500": {"conv_fraction": 0.75}},
    }
    scenario = parse_scenario(data)
    assert scenario.comp_seconds("paper-50-500", 64, 3.0) == pytest.approx(1.0)
    data["comp"] = {"paper-50-500": {"per_image_ms": 2.0, "fixed_ms": 10}}
    assert parse_scenario(data).comp_seconds("paper-50-500", 64, 3.0) == pytest.approx(0.138)
    del data["comp"]  # the measured default
    assert parse_scenario(data).comp_seconds("paper-50-500", 64, 3.0) == pytest.approx(0.32)


# -- from a trace --------------------------------------------------------------------------------


def test_calibration_from_a_real_trace(real_trace):
    cal = calibrate(str(real_trace))
    assert cal.network == "tiny" and cal.batch == TRACE_BATCH and cal.steps == 2
    assert cal.shares == TRACE_SHARES
    assert cal.node_names[0] == "master" and len(cal.node_names) == 3
    for per_layer in cal.layer_gflops:
        assert set(per_layer) == {"conv1", "conv2"}
        assert all(0 < g < 1e4 for g in per_layer.values())
    assert cal.link_mbps[0] is None and all(m > 0 for m in cal.link_mbps[1:])
    assert cal.comp_per_image_s > 0
    check = cal.check()
    assert check["comp_s"] == pytest.approx(cal.measured["comp_s"])
    # The conv time is each call's slowest node, which the calibration reproduces closely.
    assert check["conv_s"] == pytest.approx(cal.measured["conv_s"], rel=0.35)
    scenario = cal.scenario()
    assert scenario.nodes == (1, 2, 3) and scenario.networks == ("tiny",)
    rows = run_scenario(scenario, nodes=[1, 3, 6])  # 6: workers drawn between the traced two
    assert {r.nodes for r in rows} == {1, 3, 6}


def test_calibration_uses_the_most_frequent_split(real_trace, tmp_path):
    # A resumed run is probed again, and a lost or joining worker changes the split: such
    # steps are skipped (with a note), not a reason to refuse the whole trace.
    records = _records(real_trace)
    odd = json.loads(json.dumps(records[-1]))
    for node in odd["nodes"].values():
        for entry in node.values():
            entry["kernels"] += 1  # a split that occurs once
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join(json.dumps(r) for r in [*records, *records[1:], odd]) + "\n")
    cal = calibrate(str(mixed))
    assert cal.shares == TRACE_SHARES
    assert cal.steps == 2 * (len(records) - 1)
    assert any("most frequent split" in note for note in cal.notes)


def _plan_record(start_step: int, names: list[str], probe_seconds: dict[str, float]) -> dict:
    """A plan record as training writes it where a run starts (no "step" key)."""
    return {
        "event": "plan",
        "start_step": start_step,
        "nodes": [
            {"name": name, "description": "cpu", "probe_seconds": probe_seconds,
             "link_bytes_per_second": None if name == "master" else 1.25e8,
             "link_latency_seconds": None if name == "master" else 1e-4}
            for name in names
        ],
        "shares": {layer: list(shares) for layer, shares in TRACE_SHARES.items()},
    }  # fmt: skip


def test_plan_records_are_skipped_by_calibration_and_give_the_probes(real_trace, tmp_path, capsys):
    # The real run's steps (whatever plan record training wrote left out), with a plan record
    # before them and another where a resumed run would have started (step 2).
    records = _records(real_trace)
    names = list(records[0]["nodes"])
    first, resumed = {"conv1": 1e-3, "conv2": 2e-3}, {"conv1": 4e-3, "conv2": 8e-3}
    planned = tmp_path / "planned.jsonl"
    lines = [_plan_record(0, names, first), *records[:2], _plan_record(2, names, resumed)]
    planned.write_text("".join(json.dumps(r) + "\n" for r in [*lines, *records[2:]]))
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in records))

    cal, without = calibrate(str(planned)), calibrate(str(plain))
    assert cal.shares == TRACE_SHARES and cal.step_numbers == [1, 2]
    assert (cal.node_names, cal.layer_gflops, cal.measured, cal.link_mbps) == (
        without.node_names, without.layer_gflops, without.measured, without.link_mbps
    )  # fmt: skip
    assert main(["--from-trace", str(planned), "--nodes", "1..2", "--quiet"]) == 0
    assert "tiny" in capsys.readouterr().out

    # Probe speeds: the plan record the steps used (from step 1) were trained under.
    _, gflops, _ = predict(str(planned), 100.0, 1e-4, speeds="probe")
    layers = network_layers("tiny", TRACE_BATCH)
    for per_layer in gflops:
        for layer in layers:
            flops = layer.shape.flops_forward * layer.step_passes
            assert per_layer[layer.name] == pytest.approx(flops / first[layer.name] / 1e9)
    with pytest.raises(ValueError, match="no plan record: written by an older hetconv"):
        predict(str(plain), 100.0, 1e-4, speeds="probe")


def test_a_real_runs_plan_record_names_its_nodes_and_shares(real_trace):
    if not any(is_plan(r) for r in read_records(str(real_trace))):
        pytest.skip("training writes no plan record into its trace yet")
    plan = read_plan(str(real_trace))
    assert plan.start_step == 0 and plan.shares == TRACE_SHARES
    assert plan.node_names == calibrate(str(real_trace)).node_names


def test_a_local_runs_trace_is_refused(tmp_path):
    path = tmp_path / "local.jsonl"
    train(
        TrainConfig(steps=1, batch=4, train_size=8, eval_size=0, trace=str(path), progress=False),
        log=io.StringIO(),
    )
    with pytest.raises(ValueError, match="--local"):
        calibrate(str(path))


def test_simulate_from_trace_command(real_trace, capsys):
    assert main(["--from-trace", str(real_trace), "--nodes", "1..4"]) == 0
    out = capsys.readouterr().out
    assert "calibrated from" in out and "measured / simulated" in out
    assert "tiny" in out


def test_a_trace_records_its_model_so_simulate_needs_nothing_else(real_trace, tmp_path, capsys):
    (plan,) = [r for r in read_records(str(real_trace)) if is_plan(r)]
    assert plan["model"]["name"] == "tiny" and plan["model"]["batch"] == TRACE_BATCH
    assert plan["model"]["input_shape"] == [3, 32, 32] and plan["model"]["spec"][0]["type"]
    # A network of the user's own, its spec file gone by the time the trace is simulated: no
    # preset matches it, and the trace alone says what ran.
    spec = [
        {"type": "conv", "name": "c1", "out": 6, "kernel": 3, "padding": 1},
        {"type": "relu"},
        {"type": "maxpool", "kernel": 2},
        {"type": "conv", "name": "c2", "out": 10, "kernel": 3, "padding": 1},
        {"type": "fc", "out": 10},
    ]
    path, trace = tmp_path / "mine.json", tmp_path / "mine.jsonl"
    path.write_text(json.dumps(spec))
    config = TrainConfig(preset=str(path), steps=1, batch=8, train_size=8, eval_size=0,
                         trace=str(trace), progress=False)  # fmt: skip
    with LocalWorkers(1) as workers:
        with RealCluster(workers.addresses) as cluster:
            train(config, cluster, log=io.StringIO())
    path.unlink()
    assert main(["--from-trace", str(trace), "--nodes", "1..2"]) == 0
    out = capsys.readouterr().out
    assert "calibrated from" in out and f"note: network {path} as the trace recorded it" in out
    assert calibrate(str(trace)).network.endswith("mine.json")
    with pytest.raises(ValueError, match="does not match network tiny"):  # still an override
        calibrate(str(trace), "tiny")


# -- the command ---------------------------------------------------------------------------------

ROW_FIELDS = {
    "scenario", "network", "batch", "nodes", "bandwidth_mbps", "step_s", "comm_s", "conv_s",
    "comp_s", "speedup", "policy",
}  # fmt: skip


def test_json_rows(tmp_path, capsys):
    path = tmp_path / "out" / "rows.json"
    argv = ["cpu-cluster", "--nodes", "1", "--nodes", "2,4", "--preset", "paper-50-500",
            "--batch", "64", "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(path.read_text())
    data_parallel = ("dp-ring", "dp-ring-seq", "dp-ps", "dp-ps-seq")
    images = ("images-master", "images-ring")  # --split auto (train's default) simulates both
    # nodes x (policies + the data-parallel peer's), and the split by images with workers
    assert len(rows) == 3 * (2 + 4) + 2 * 2
    for row in rows:
        assert ROW_FIELDS <= set(row)
        assert row["scenario"] == "cpu-cluster" and row["batch"] == 64
    assert {(r["nodes"], r["policy"]) for r in rows} == {
        (n, p) for n in (1, 2, 4) for p in (COMPUTE, LINK, *data_parallel)
    } | {(n, p) for n in (2, 4) for p in images}
    out = capsys.readouterr().out
    assert "network: Wi-Fi" in out and "speedup" in out and "master: i5-3210M" in out


def test_list_names_the_shipped_scenarios(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in shipped_scenarios():
        assert name in out


def test_command_errors_are_one_line(capsys):
    assert main(["no-such-scenario"]) == 2
    assert "error" in capsys.readouterr().err
    assert main([]) == 2
    with pytest.raises(SystemExit):
        main(["cpu-cluster", "--nodes", "0"])


@pytest.mark.slow
def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (hetconv[plot])")
    argv = [
        "bandwidth-sweep", "--nodes", "1,4", "--bandwidth", "5,1000", "--preset",
        "paper-50-500", "--plot", str(tmp_path), "--quiet",
    ]  # fmt: skip
    assert main(argv) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert "speedup-nodes-bandwidth-sweep-b64.png" in names
    assert {"heatmap-bandwidth-sweep-paper-50-500-b64-compute.png"} <= names
    assert "breakdown-bandwidth-sweep-paper-50-500-b64-1000mbps.png" in names
    assert all((tmp_path / n).stat().st_size > 1000 for n in names)


def test_plots_without_matplotlib_say_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now fails
    assert main(["cpu-cluster", "--nodes", "1", "--plot", str(tmp_path)]) == 2
    assert "pip install 'hetconv[plot]'" in capsys.readouterr().err


def test_wires_as_a_subcommand(capsys):
    parser = argparse.ArgumentParser(prog="hetconv")
    sub = parser.add_subparsers(dest="command", required=True)
    simulate = sub.add_parser("simulate")
    add_arguments(simulate)
    simulate.set_defaults(func=run)
    args = parser.parse_args(["simulate", "this-machine", "--nodes", "1..2", "--batch", "16"])
    assert args.func(args) == 0
    assert "this-machine" in capsys.readouterr().out
    assert CLI_POLICIES == POLICIES


def test_step_bytes_adds_every_call_of_a_step():
    from hetconv.simulations.trace import step_bytes

    call = {"bytes_sent": 3, "bytes_received": 4}
    record = {
        "step": 0,
        "nodes": {
            "master": {"conv1": {"kernels": 2, "forward": {"bytes_sent": 0, "bytes_received": 0}}},
            "w1": {"conv1": {"kernels": 2, "forward": call, "backward": call}, "conv2": {}},
        },
    }
    assert step_bytes(record) == 14
    assert step_bytes({"step": 1}) == 0
