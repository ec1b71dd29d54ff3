"""`hetconv plan`: every strategy ranked on a described or named cluster, the fastest named
with the command that runs it, one machine named plainly when nothing beats it."""

from __future__ import annotations

import json
import warnings

import pytest

from hetconv.cli import main as hetconv_main

LAPTOPS = ["--master", "60", "--worker", "45", "--worker", "30", "--network", "wifi"]


def _plan(tmp_path, capsys, *argv):
    out = tmp_path / "plan.json"
    assert hetconv_main(["plan", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_a_described_wifi_cluster_gets_every_strategy_ranked(tmp_path, capsys):
    rows, text = _plan(tmp_path, capsys, *LAPTOPS, "--bandwidth", "60", "--preset", "paper-50-500")
    kinds = {r["kind"] for r in rows}
    assert kinds == {"hetconv", "data-parallel", "one machine"}
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    one = next(r for r in rows if r["kind"] == "one machine")
    for r in rows:  # speedups are over one machine's step
        assert r["speedup"] == pytest.approx(one["step_s"] / r["step_s"])
    assert text.splitlines()[-1].startswith(f"fastest: {rows[0]['label']}")
    assert "a master at 60 GFLOPS and 2 workers on Wi-Fi at 60 Mbit/s" in text
    # on Wi-Fi the replicated first block lets the workers help where the rest cannot
    by_label = {r["label"]: r for r in rows}
    replicated = by_label["fused, resident, replicated first block"]
    assert replicated["workers"] >= 1
    assert replicated["step_s"] < by_label["fused, resident kernels"]["step_s"]
    assert replicated["master_mb"] < by_label["kernel split (the paper's)"]["master_mb"] / 10


def test_one_machine_is_named_when_the_link_is_too_slow(tmp_path, capsys):
    rows, text = _plan(
        tmp_path, capsys, "--master", "60", "--worker", "2", "--bandwidth", "0.5",
        "--preset", "paper-150-800",
    )  # fmt: skip
    assert rows[0]["kind"] == "one machine"
    assert "fastest: one machine alone" in text and "slow training down" in text


def test_a_named_scenario_and_its_nodes(tmp_path, capsys):
    rows, text = _plan(tmp_path, capsys, "gigabit-lan", "--nodes", "3", "--batch", "64")
    assert "(3 nodes)" in text
    assert any(r["kind"] == "data-parallel" for r in rows)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--master", "60"], "describe the cluster"),
        (["gigabit-lan", "--master", "60"], "not both"),
        (["--master", "60", "--worker", "fast"], "is not GFLOPS or GFLOPS@MBIT"),
        (["--master", "60", "--worker", "-3"], "must be positive"),
    ],
)
def test_bad_descriptions_are_refused_naming_why(argv, message, capsys):
    try:
        status = hetconv_main(["plan", *argv])
    except SystemExit as e:  # argparse's usage errors
        status = e.code
    assert status == 2
    assert message in capsys.readouterr().err


# -- any model, train's defaults, a command to paste ---------------------------------------------

SPEC = [
    {"type": "conv", "out": 8, "kernel": 3, "padding": 1},
    {"type": "relu"},
    {"type": "maxpool", "kernel": 2},
    {"type": "conv", "out": 16, "kernel": 3, "padding": 1},
    {"type": "relu"},
    {"type": "fc", "out": 5},
]


@pytest.fixture
def own_spec(tmp_path):
    path = tmp_path / "my.json"
    path.write_text(json.dumps(SPEC))
    return str(path)


def test_a_json_model_is_planned_its_other_work_measured_here(tmp_path, capsys, own_spec):
    rows, text = _plan(tmp_path, capsys, *LAPTOPS, "--model", own_spec)
    assert {r["kind"] for r in rows} == {"hetconv", "data-parallel", "one machine"}
    assert f"plan for {own_spec} (3x32x32 images) at batch 32" in text
    assert "measured here just now" in text and "no non-convolutional time" not in text
    # a named scenario measures it alike (its machines' figures are this one's, as for presets)
    rows, text = _plan(tmp_path, capsys, "gigabit-lan", "--nodes", "2", "--model", own_spec)
    assert f"{own_spec} measured here just now" in text
    assert rows[0]["step_s"] > 0


def test_plan_defaults_are_trains():
    from hetconv.cli import build_parser
    from hetconv.training import TrainConfig

    parser = build_parser()
    train = parser.parse_args(["train"])
    plan = parser.parse_args(["plan"])
    assert (plan.preset, plan.batch) == (train.preset, train.batch)
    assert (plan.preset, plan.batch) == (TrainConfig.preset, TrainConfig.batch)


def test_the_fastest_command_names_each_worker_of_the_cluster(tmp_path, capsys):
    rows, text = _plan(tmp_path, capsys, *LAPTOPS, "--bandwidth", "60", "--model", "paper-50-500")
    assert rows[0]["kind"] == "hetconv"
    verdict = next(line for line in text.splitlines() if line.startswith("fastest:"))
    assert rows[0]["how"] in verdict
    assert rows[0]["how"].startswith("hetconv train --model paper-50-500 --batch 32 ")
    for r in rows:
        if r["kind"] == "hetconv":  # two workers described: two placeholders, never none
            assert r["how"].count("--worker HOST:PORT") == 2 and "--local" not in r["how"]
        elif r["kind"] == "one machine":
            assert "--local" in r["how"] and "--worker" not in r["how"]
    assert "one --worker HOST:PORT per worker of this cluster (2)" in text
    assert "--discover" in text


def test_worker_help_says_which_gflops_figure(capsys):
    with pytest.raises(SystemExit):
        hetconv_main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the GFLOPS `hetconv devices` prints" in text and "otherwise idle machine" in text


@pytest.mark.parametrize("load, busy", [(0.0, False), (64.0, True)])
def test_the_probe_lines_say_what_their_gflops_are(monkeypatch, load, busy):
    """The worker's startup probe and `hetconv devices` time the same thing; both say so, say
    which figure `plan` takes, and warn when the machine is busy (the figure then reads low)."""
    import io
    import os

    from hetconv.backends import get_backend
    from hetconv.cli import devices
    from hetconv.worker.main import _print_device

    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load), raising=False)
    backend = get_backend("cpu")
    monkeypatch.setattr(type(backend), "time_step", lambda self, *a, **k: 0.1)
    out = io.StringIO()
    _print_device(backend, True, out)
    line = out.getvalue().splitlines()[-1]
    assert line.startswith("probe: 100.0 ms") and "GFLOPS with the threads above" in line
    assert "`hetconv devices` times" in line and "`hetconv plan --worker` takes" in line
    assert ("busy now" in line) is busy
    note = devices._probe_note()
    assert "`hetconv plan --master/--worker` takes" in note and "`hetconv worker`" in note
    assert ("busy now" in note) is busy


def test_an_onnx_model_is_planned_at_its_own_image_shape(tmp_path, capsys):
    """A graph's input fixes its shapes: the kernel split, the data-parallel peer and the
    measured other work all take its 3x16x16, not CIFAR's 3x32x32."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnx")
    from hetconv.costmodel import local_step_seconds
    from hetconv.dataparallel import simulate_data_parallel
    from hetconv.simulations.scenario import load_scenario
    from hetconv.workload import network_layers

    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 8 * 8, 4),
    )
    graph = tmp_path / "net.onnx"
    with warnings.catch_warnings():  # the exporter's deprecation notes
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.zeros(2, 3, 16, 16),), str(graph), dynamo=False,
                          input_names=["input"], output_names=["logits"])  # fmt: skip
    rows, text = _plan(tmp_path, capsys, *LAPTOPS, "--model", str(graph))
    assert f"plan for {graph} (3x16x16 images)" in text and "measured here just now" in text
    master = load_scenario("this-machine").cluster(1)  # one node: data parallelism is local
    alone = simulate_data_parallel(master, str(graph), 16, 0.0).step_s
    assert alone == pytest.approx(
        local_step_seconds(master.master, network_layers(str(graph), 16), 0.0)
    )


def test_the_training_datas_image_shape_is_planned_for(tmp_path, capsys):
    """Images of 3x64x64 (an ImageFolder of the user's own) cost four times CIFAR's
    convolutions; the plan says the shape it planned for and measures the other work at it."""
    small, _ = _plan(tmp_path, capsys, *LAPTOPS)
    rows, text = _plan(tmp_path, capsys, *LAPTOPS, "--input-shape", "3,64,64")
    assert "plan for tiny (3x64x64 images) at batch 32" in text
    assert "on 3x64x64 random images" in text
    alone = {r["kind"]: r["step_s"] for r in rows}["one machine"]
    assert alone > 2 * {r["kind"]: r["step_s"] for r in small}["one machine"]
    with pytest.raises(SystemExit):
        hetconv_main(["plan", *LAPTOPS, "--input-shape", "3,64"])
    assert "'3,64' is not C,H,W" in capsys.readouterr().err


def test_a_run_folder_or_its_model_npz_is_planned_as_it_trained(tmp_path, capsys):
    """Weights that describe themselves name the network and the image shape it trained at."""
    import numpy as np

    from hetconv.description import FLOAT32, Description, write_description

    run = tmp_path / "runs" / "shapes1"
    run.mkdir(parents=True)
    np.savez(run / "model.npz", **{"c1.weight": np.zeros((8, 3, 3, 3), np.float32)})
    described = Description("mine.json", tuple(SPEC), (3, 24, 24), 5, (0.5,) * 3, (0.25,) * 3,
                            1.0, FLOAT32)  # fmt: skip
    write_description(run / "model.npz", described)
    for given in (run, run / "model.npz"):
        rows, text = _plan(tmp_path, capsys, *LAPTOPS, "--model", str(given))
        assert f"plan for {given} (mine.json as trained there, 3x24x24 images)" in text
        assert "mine.json measured here just now" in text and "on 3x24x24 random images" in text
        assert all(r["how"].startswith("hetconv train --model mine.json ") for r in rows
                   if r["kind"] != "data-parallel")  # fmt: skip
    np.savez(tmp_path / "plain.npz", a=np.zeros(2))
    for given, message in ((tmp_path / "plain.npz", "does not say which network it holds"),
                           (tmp_path / "runs", "holds no model.npz")):  # fmt: skip
        assert hetconv_main(["plan", *LAPTOPS, "--model", str(given)]) == 2
        assert message in capsys.readouterr().err


def test_the_plan_offers_the_image_split_where_it_can_run():
    # --split images is one of hetconv's ways, with the command that runs it; not on a
    # network with batch norm, which it refuses.
    from hetconv.costmodel import SWITCHED, SimCluster, SimNode
    from hetconv.simulations.plan import IMAGE_SPLIT, candidates

    nodes = tuple(SimNode(f"w{i}", 60.0, bytes_per_s=117.5e6) for i in range(3))
    cluster = SimCluster(SimNode("m", 60.0, bytes_per_s=117.5e6), nodes, SWITCHED)
    ranked = {c.label: c for c in candidates(cluster, "paper-150-800", 64, 1.0)}
    split = ranked[IMAGE_SPLIT]
    assert split.kind == "hetconv" and split.exact and split.workers == 3
    assert split.how.endswith("--split images --exchange master")
    assert split.how.count("--worker") == 3
    assert IMAGE_SPLIT not in {c.label for c in candidates(cluster, "resnet20", 64, 1.0)}


def test_data_parallelism_on_batch_norm_is_not_one_machines_model_unless_synced():
    # DDP's ranks on CPUs normalise their own slices: another model, so not exact; the ring
    # with the statistics summed over the ranks is, and pays 2 (N - 1) rounds a sum for it.
    from hetconv.costmodel import SWITCHED, SimCluster, SimNode
    from hetconv.dataparallel import simulate_data_parallel, synced_batchnorm_seconds
    from hetconv.simulations.plan import DDP_OWN_NORMS, DDP_SYNCED_HOW, candidates, verdict

    def cluster(workers: int) -> SimCluster:
        nodes = tuple(SimNode(f"w{i}", 60.0, bytes_per_s=117.5e6, rtt_s=2e-4)
                      for i in range(workers))  # fmt: skip
        return SimCluster(SimNode("m", 60.0, bytes_per_s=117.5e6), nodes, SWITCHED)

    four = cluster(4)
    ranked = candidates(four, "resnet20", 64, 0.2)
    parallel = [c for c in ranked if c.kind == "data-parallel"]
    synced = [c for c in parallel if c.exact]
    assert len(parallel) == 5 and len(synced) == 1
    assert synced[0].how == DDP_SYNCED_HOW and "batch norm synced" in synced[0].label
    assert all(c.how == DDP_OWN_NORMS for c in parallel if not c.exact)
    own = next(c for c in parallel if c.label == "data parallelism, ring all-reduce, overlapped")
    waits = synced_batchnorm_seconds(four, 21)  # resnet20's batch norms
    assert synced[0].step_s == pytest.approx(own.step_s + waits)
    assert waits == pytest.approx(21 * synced_batchnorm_seconds(four, 1))
    # rounds grow with the ranks (gloo's ring); one rank or no batch norm waits for nothing
    assert synced_batchnorm_seconds(cluster(8), 1) > 1.5 * synced_batchnorm_seconds(four, 1)
    assert synced_batchnorm_seconds(four, 0) == 0.0
    plain = simulate_data_parallel(four, "paper-150-800", 64, 0.2)
    assert simulate_data_parallel(four, "paper-150-800", 64, 0.2, synced_batchnorm=True).step_s \
        == plain.step_s  # fmt: skip
    if not ranked[0].exact:  # the verdict names the fastest exact beside it
        assert "the fastest exact: " in verdict(ranked)
    # a network without batch norm: every data-parallel way is exact, none synced
    others = [c for c in candidates(four, "paper-150-800", 64, 0.2) if c.kind == "data-parallel"]
    assert len(others) == 4 and all(c.exact for c in others)
