"""``hetconv simulate`` as a new user meets it: option order, vocabulary, errors, the paper's
scenarios as the paper ran them, and the figures."""

from __future__ import annotations

import csv
import json

import pytest

from hetconv.cli import build_parser
from hetconv.cli import main as hetconv_main
from hetconv.cli.simulate import main as simulate_main
from hetconv.simulations.paper import (
    PAPER_COMP_FRACTIONS,
    PAPER_NETWORKS,
    paper_comp_fraction,
    paper_step_bytes,
)
from hetconv.simulations.scenario import load_scenario
from hetconv.simulations.sweep import run_scenario
from hetconv.workload import network_layers

FAST = ["--preset", "paper-50-500", "--batch", "64", "--quiet"]

# -- options and scenarios in any order ----------------------------------------------------------


@pytest.mark.parametrize(
    "argv, scenarios, nodes",
    [
        (["cpu-cluster", "--nodes", "1..4"], ["cpu-cluster"], [1, 2, 3, 4]),
        (["--nodes", "1..4", "cpu-cluster"], ["cpu-cluster"], [1, 2, 3, 4]),
        (["--preset", "paper-50-500", "cpu-cluster"], ["cpu-cluster"], None),
        (["--bandwidth", "5,100", "--batch", "64", "gpu-cluster"], ["gpu-cluster"], None),
        (["cpu-cluster", "--nodes", "2", "gpu-cluster"], ["cpu-cluster", "gpu-cluster"], [2]),
        (["--nodes", "1", "--nodes", "2,4", "cpu-cluster"], ["cpu-cluster"], [1, 2, 4]),
        (["--quiet", "cpu-cluster", "--comp", "paper", "gpu-cluster", "--nodes", "2"],
         ["cpu-cluster", "gpu-cluster"], [2]),
    ],
)  # fmt: skip
def test_options_and_scenarios_parse_in_any_order(argv, scenarios, nodes):
    args = build_parser().parse_args(["simulate", *argv])
    assert args.scenario == scenarios
    assert args.nodes == nodes


def test_options_before_the_scenario_run_it(tmp_path):
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    assert hetconv_main(["simulate", "--nodes", "1..2", *FAST, "cpu-cluster", "--json",
                         str(before)]) == 0  # fmt: skip
    assert hetconv_main(["simulate", "cpu-cluster", "--nodes", "1..2", *FAST, "--json",
                         str(after)]) == 0  # fmt: skip
    rows = json.loads(before.read_text())
    assert rows == json.loads(after.read_text())
    assert {(r["scenario"], r["nodes"]) for r in rows} == {("cpu-cluster", 1), ("cpu-cluster", 2)}
    assert simulate_main(["--nodes", "1..2", *FAST, "cpu-cluster"]) == 0  # alone, the same


def test_preset_lists_the_networks_as_train_names_them(tmp_path):
    path = tmp_path / "rows.json"
    argv = ["simulate", "cpu-cluster", "--nodes", "1", "--batch", "64", "--quiet",
            "--preset", "paper-50-500,paper-150-800", "--preset", "paper-500-1500",
            "--json", str(path)]  # fmt: skip
    assert hetconv_main(argv) == 0
    networks = {r["network"] for r in json.loads(path.read_text())}
    assert networks == {"paper-50-500", "paper-150-800", "paper-500-1500"}


def test_network_still_works_once_with_a_note_pointing_to_preset(tmp_path, capsys):
    path = tmp_path / "rows.json"
    argv = ["--network", "paper-50-500", "cpu-cluster", "--nodes", "1", "--batch", "64",
            "--quiet", "--json", str(path)]  # fmt: skip
    assert simulate_main(argv) == 0
    assert {r["network"] for r in json.loads(path.read_text())} == {"paper-50-500"}
    (note,) = capsys.readouterr().err.splitlines()
    assert note.startswith("hetconv simulate: note: --network is now --preset")


def test_the_old_several_values_habit_is_named(capsys):
    assert simulate_main(["cpu-cluster", "--nodes", "1", "2,4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hetconv simulate: error: '2,4' is no scenario")
    assert "--nodes 1,2,4" in err


# -- one way to report an error ------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "no-such-scenario"],  # bad input, found when run
        ["simulate"],  # nothing to simulate
        ["simulate", "cpu-cluster", "--nodes", "0"],  # a usage error, found by the parser
        ["simulate", "tiny-cluster", "--comp", "nope"],
        ["train", "--local", "--preset", "no-such-preset"],
        ["train", "--epochs", "x"],
        [
            "export",
            "/nonexistent/model.npz",
            "--preset",
            "tiny",
            "--input-shape",
            "3,32,32",
            "-o",
            "/nonexistent/m.onnx",
        ],
    ],
)
def test_every_command_reports_errors_as_hetconv_command_error(argv, capsys):
    try:
        status = hetconv_main(argv)
    except SystemExit as e:  # argparse's usage errors
        status = e.code
    assert status == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"hetconv {argv[0]}: error: "), lines
    assert not any("Traceback" in line for line in lines)


def test_simulate_alone_reports_errors_as_the_subcommand_does(capsys):
    assert simulate_main(["no-such-scenario"]) == 2
    alone = capsys.readouterr().err
    assert hetconv_main(["simulate", "no-such-scenario"]) == 2
    assert capsys.readouterr().err == alone


# -- the paper's scenarios as the paper ran them -------------------------------------------------


@pytest.mark.parametrize(
    "name, slowest",
    [("cpu-cluster", "i5-3210M"), ("gpu-cluster", "GeForce 840M"), ("bandwidth-sweep", "i5-3210M")],
)
def test_the_paper_scenarios_master_is_its_slowest_device(name, slowest):
    scenario = load_scenario(name)
    assert scenario.paper
    assert scenario.master.name == slowest
    assert all(w.gflops > scenario.master.gflops for w in scenario.workers)
    assert scenario.population.slowest_gflops == scenario.master.gflops
    if name != "bandwidth-sweep":
        assert max(scenario.batches) == 1024


def test_paper_comp_gives_the_papers_shares_of_a_one_cpu_step_at_batch_1024():
    scenario = load_scenario("cpu-cluster")
    networks = list(PAPER_NETWORKS)
    paper = scenario.with_paper_comp(networks)
    rows = run_scenario(paper, nodes=[1], batches=[64, 1024], policies=["compute"])
    share = {(r.network, r.batch): r.comp_s / r.local_s for r in rows}
    assert share[("paper-50-500", 1024)] == pytest.approx(0.25)
    assert share[("paper-500-1500", 1024)] == pytest.approx(0.13)
    for network in networks:  # the same share at every batch
        assert share[(network, 64)] == pytest.approx(share[(network, 1024)])
    interpolated = [share[(n, 1024)] for n in networks]
    assert interpolated == sorted(interpolated, reverse=True)  # larger network, smaller share
    assert {r.comp_basis for r in rows} == {"paper"}
    measured = run_scenario(scenario, nodes=[1], batches=[1024], networks=["paper-50-500"])
    assert measured[0].comp_basis == "scenario"
    assert measured[0].comp_s / measured[0].local_s != pytest.approx(0.25)


def test_paper_comp_knows_only_the_papers_networks():
    assert paper_comp_fraction("paper-50-500") == PAPER_COMP_FRACTIONS["paper-50-500"]
    with pytest.raises(ValueError, match="reports no non-convolutional time for tiny"):
        paper_comp_fraction("tiny")


def test_paper_comp_is_stated_in_the_output(capsys):
    assert simulate_main(["gpu-cluster", "--comp", "paper", "--nodes", "1", "--batch", "1024",
                          "--preset", "paper-150-800"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "--comp paper: the paper's share of a one-CPU step at batch 1024" in out
    assert "paper-150-800 18.7 % (interpolated)" in out
    assert "of the master's (GeForce 840M) own convolution time" in out


def test_the_papers_volume_by_its_formula():
    (c1, c2) = network_layers("paper-50-500", 2)
    values = 0
    for layer in (c1, c2):
        s = layer.shape
        ho, wo = s.out_hw
        values += s.h * s.w * s.c * s.n + s.kh * s.kw * s.k * s.c + ho * wo * s.k * s.n
    assert paper_step_bytes([c1, c2]) == 8 * values
    assert paper_step_bytes(network_layers("paper-50-500", 4)) > paper_step_bytes([c1, c2])


def test_five_mbits_cannot_carry_the_papers_volume_and_the_output_says_what_would(tmp_path, capsys):
    table = tmp_path / "rows.csv"
    argv = ["cpu-cluster", "--preset", "paper-500-1500", "--batch", "1024", "--nodes", "1..4",
            "--comp", "paper", "--csv", str(table)]  # fmt: skip
    assert simulate_main(argv) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("bandwidth check:")]
    assert "5 Mbit/s cannot carry the paper's volume for paper-500-1500 at batch 1024" in line
    assert "consistent bandwidth is >= " in line and " h at 5 Mbit/s" in line
    rows = list(csv.DictReader(table.open()))
    assert {r["bandwidth_consistent"] for r in rows if r["nodes"] != "1"} == {"False"}
    assert {r["bandwidth_consistent"] for r in rows if r["nodes"] == "1"} == {""}
    clusters = [r for r in rows if r["nodes"] != "1"]  # data-parallel rows carry it too
    for r in clusters:
        needed = float(r["paper_mbytes"]) * 8 / float(r["comm_budget_s"])
        assert float(r["consistent_mbps"]) == pytest.approx(needed)
    consistent = min(float(r["consistent_mbps"]) for r in clusters)
    assert f">= {consistent:.3g} Mbit/s" in line  # under a Gbit/s: in Mbit/s

    # At a bandwidth above that, the same step is consistent, and the output says so.
    above = f"{1.1 * consistent:.0f}"
    rows_json = tmp_path / "r.json"
    assert simulate_main([*argv[:-2], "--bandwidth", above, "--json", str(rows_json)]) == 0
    out = capsys.readouterr().out
    assert "cannot carry" not in out
    assert "bandwidth check: every bandwidth shown carries the paper's volume" in out
    rows = json.loads(rows_json.read_text())
    assert all(r["bandwidth_consistent"] for r in rows if r["nodes"] == 4)


def test_no_bandwidth_check_outside_the_papers_scenarios(capsys):
    rows = run_scenario(load_scenario("this-machine"), nodes=[1, 2], batches=[16])
    assert all(r.paper_mbytes is None and r.bandwidth_consistent is None for r in rows)
    assert simulate_main(["this-machine", "--nodes", "1..2", "--batch", "16"]) == 0
    assert "bandwidth check" not in capsys.readouterr().out


# -- the figures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep_rows():
    pytest.importorskip("matplotlib", reason="plots need matplotlib (hetconv[plot])")
    scenario = load_scenario("cpu-cluster").with_paper_comp(["paper-500-1500"])
    return run_scenario(
        scenario, nodes=list(range(1, 33)), networks=["paper-500-1500"], batches=[1024]
    )


def test_speedup_figure_names_node_counts_and_tells_policies_apart(sweep_rows):
    import matplotlib.pyplot as plt

    from hetconv.simulations.plots import speedup_figure

    fig = speedup_figure(sweep_rows, "cpu-cluster", 1024)
    try:
        ax = fig.axes[0]
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert labels == ["1", "2", "4", "8", "16", "32"]
        assert ax.xaxis.get_minor_ticks() == []
        handles, names = ax.get_legend_handles_labels()
        looks = {name: (h.get_linestyle(), h.get_marker(), h.get_markerfacecolor())
                 for h, name in zip(handles, names, strict=True)}  # fmt: skip
        assert looks["paper-500-1500 (compute)"] != looks["paper-500-1500 (link)"]
        assert looks["paper-500-1500 (compute)"][1] != looks["paper-500-1500 (link)"][1]
        (reference,) = [line for line in ax.get_lines() if list(line.get_ydata()) == [1.0, 1.0]]
        curves = [line for line in ax.get_lines() if line is not reference]
        assert all(c.get_zorder() > reference.get_zorder() for c in curves)
    finally:
        plt.close(fig)


def test_breakdown_figure_is_report_sized_on_a_log_axis_with_every_bar_visible(sweep_rows):
    import matplotlib.pyplot as plt

    from hetconv.simulations.plots import DPI, breakdown_figure

    fig = breakdown_figure(sweep_rows, "cpu-cluster", "paper-500-1500", 1024, 5.0)
    try:
        width, height = fig.get_size_inches() * DPI
        assert width <= 1600 and height <= 1000
        assert len(fig.axes) == 2  # a panel per policy
        for ax in fig.axes:
            assert ax.get_yscale() == "log"
            low, high = ax.get_ylim()
            heights = [p.get_height() for p in ax.patches if p.get_height() > 0]
            assert heights and all(low < h < high for h in heights)
        assert [t.get_text() for t in fig.axes[-1].get_xticklabels()] == [
            str(n) for n in range(1, 33)
        ]
    finally:
        plt.close(fig)


# -- any model, train's modes --------------------------------------------------------------------


def test_a_json_model_gets_its_other_work_measured_here(tmp_path, capsys):
    spec = tmp_path / "my.json"
    spec.write_text(
        json.dumps(
            [
                {"type": "conv", "out": 8, "kernel": 3, "padding": 1},
                {"type": "relu"},
                {"type": "maxpool", "kernel": 2},
                {"type": "conv", "out": 16, "kernel": 3, "padding": 1},
                {"type": "fc", "out": 4},
            ]
        )
    )
    rows = tmp_path / "rows.json"
    argv = ["this-machine", "--model", str(spec), "--nodes", "1..2", "--batch", "16"]
    assert simulate_main([*argv, "--json", str(rows)]) == 0
    out = capsys.readouterr().out
    assert f"measuring {spec}'s non-convolutional time here" in out
    assert f"{spec} measured here just now" in out  # the assumptions name where comp came from
    assert all(r["comp_s"] > 0 for r in json.loads(rows.read_text()))


def test_simulate_defaults_to_trains_modes():
    parser = build_parser()
    train = parser.parse_args(["train"])
    simulate = parser.parse_args(["simulate", "cpu-cluster"])
    for dest in ("stages", "kernels", "replicate", "overlap", "head", "wire_format"):
        assert getattr(simulate, dest) in (getattr(train, dest), None), dest
    assert simulate.wire_format is None  # the scenario's [wire] format, float32 unless it says
    assert simulate.stages == "auto" and not simulate.paper_modes


def test_paper_modes_sets_the_papers_and_refuses_a_mode_beside_it(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert simulate_main(["cpu-cluster", "--nodes", "2", *FAST, "--paper-modes", "--json",
                          str(out)]) == 0  # fmt: skip
    (row,) = [r for r in json.loads(out.read_text()) if r["policy"] == "compute"]
    assert (row["stages"], row["kernels"], row["replicate"], row["overlap"], row["head"]) == (
        "unfused", "sent", "off", "off", "master")  # fmt: skip
    assert simulate_main(["cpu-cluster", *FAST, "--paper-modes", "--stages", "fused"]) == 2
    assert "--paper-modes sets the paper's modes; drop --stages fused" in capsys.readouterr().err
