"""`hetconv plan`: every strategy ranked on a described or named cluster, the fastest named
with the command that runs it, one machine named plainly when nothing beats it."""

from __future__ import annotations

import json

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
