"""``hetconv simulate --split``: the whole network split by images beside the kernel split, the
same predictions ``hetconv plan`` ranks, and the row ``--split auto`` would run."""

from __future__ import annotations

import json
import re

import pytest

from hetconv.cli.simulate import main
from hetconv.costmodel import local_step_seconds
from hetconv.imagecost import choose_split
from hetconv.ring import MASTER, RING
from hetconv.simulations.plan import IMAGE_SPLIT, IMAGE_SPLIT_RING, candidates
from hetconv.simulations.scenario import load_scenario
from hetconv.simulations.sweep import mark_auto_split, run_scenario
from hetconv.workload import network_layers

IMAGES = ("images-master", "images-ring")


def _rows(tmp_path, *argv) -> list[dict]:
    path = tmp_path / "rows.json"
    assert main([*argv, "--quiet", "--no-data-parallel", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_kernels_gives_no_image_rows_and_images_only_them(tmp_path):
    point = ["gigabit-lan", "--preset", "paper-150-800", "--batch", "64", "--nodes", "5"]
    kernels = _rows(tmp_path, *point, "--split", "kernels")
    assert kernels and {r["split"] for r in kernels} == {"kernels"}
    assert all(r["auto"] is None for r in kernels)  # one split: nothing to choose
    images = _rows(tmp_path, *point, "--split", "images")
    assert [r["policy"] for r in images] == list(IMAGES)
    assert {r["split"] for r in images} == {"images"}
    ring = _rows(tmp_path, *point, "--split", "images", "--exchange", "ring")
    assert [r["policy"] for r in ring] == ["images-ring"]


def test_a_network_with_batch_norm_is_split_by_images_with_the_ring_only(tmp_path):
    rows = _rows(tmp_path, "gigabit-lan", "--preset", "resnet20", "--batch", "64", "--nodes",
                 "5", "--split", "images")  # fmt: skip
    assert [r["policy"] for r in rows] == ["images-ring"]


@pytest.mark.parametrize("network", ["paper-150-800", "paper-500-1500"])
def test_image_rows_are_the_predictions_plan_ranks(tmp_path, network):
    """The same model as ``hetconv plan`` (and train's ``--split auto``) on the same cluster."""
    scenario = load_scenario("gigabit-lan")
    rows = run_scenario(scenario, nodes=[4], bandwidths_mbps=[940.0], networks=[network],
                        batches=[64], split="images")  # fmt: skip
    cluster = scenario.cluster(4, 940.0)
    local = local_step_seconds(cluster.master, network_layers(network, 64), 0.0)
    comp = scenario.comp_seconds(network, 64, local)
    ranked = {c.label: c.step_s for c in candidates(cluster, network, 64, comp)}
    got = {r.policy: r.step_s for r in rows}
    assert got["images-master"] == pytest.approx(ranked[IMAGE_SPLIT], rel=1e-12)
    assert got["images-ring"] == pytest.approx(ranked[IMAGE_SPLIT_RING], rel=1e-12)


def test_auto_marks_the_row_train_would_run(tmp_path):
    """One row a point, by train's rule: the fastest kernel row against the image rows (the
    ring allowed: spot checks check it); both choices appear in this sweep."""
    rows = _rows(tmp_path, "gigabit-lan", "--preset", "paper-150-800", "--batch", "16,64",
                 "--nodes", "5", "--bandwidth", "100,940")  # fmt: skip
    points: dict[tuple, list[dict]] = {}
    for r in rows:
        points.setdefault((r["batch"], r["bandwidth_mbps"]), []).append(r)
    seen = set()
    for mine in points.values():
        assert sum(r["auto"] for r in mine) == 1 and "auto_unchecked" not in mine[0]
        kernels = min(r["step_s"] for r in mine if r["split"] == "kernels")
        images = {r["policy"].removeprefix("images-"): r["step_s"] for r in mine
                  if r["split"] == "images"}  # fmt: skip
        want = choose_split(kernels, images, [MASTER, RING])
        (chosen,) = [r for r in mine if r["auto"]]
        assert chosen["split"] == want["split"]
        if want["split"] == "images":
            assert chosen["policy"] == f"images-{want['exchange']}"
        seen.add(chosen["split"])
    assert seen == {"kernels", "images"}


def test_the_table_marks_the_auto_row(capsys):
    assert main(["gigabit-lan", "--preset", "paper-150-800", "--batch", "64", "--nodes", "5",
                 "--no-data-parallel"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    marked = [line for line in out.splitlines() if re.search(r"\d\.\d\d[* ]a ", line)]
    assert len(marked) == 1
    assert "a = the row `hetconv train --split auto` runs" in out


def test_paper_modes_split_kernels_only(tmp_path, capsys):
    rows = _rows(tmp_path, "cpu-cluster", "--preset", "paper-50-500", "--batch", "64",
                 "--nodes", "4", "--paper-modes")  # fmt: skip
    assert {r["split"] for r in rows} == {"kernels"}
    assert main(["cpu-cluster", "--paper-modes", "--split", "images", "--quiet"]) != 0
    assert "--split images" in capsys.readouterr().err


def test_mark_auto_split_leaves_a_single_split_alone():
    rows = run_scenario(load_scenario("gigabit-lan"), nodes=[5], networks=["paper-150-800"],
                        batches=[64], bandwidths_mbps=[940.0])  # fmt: skip
    assert mark_auto_split(rows) == rows


def test_a_flag_of_the_kernel_split_keeps_auto_on_kernels(tmp_path, capsys):
    """As train resolves --split auto: a kernel-split flag given means the split by kernels."""
    point = ["gigabit-lan", "--preset", "paper-150-800", "--batch", "64", "--nodes", "5"]
    rows = _rows(tmp_path, *point, "--stages", "fused")
    assert rows and {r["split"] for r in rows} == {"kernels"}
    assert main([*point, "--split", "images", "--head", "master", "--quiet"]) != 0
    assert "--split images splits no layer by kernels: drop --head" in capsys.readouterr().err
