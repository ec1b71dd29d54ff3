"""``hetconv train --split auto``: the split by kernels or by images, whichever the cost model
predicts faster for the cluster measured at start (:mod:`hetconv.master.splitchoice`)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from exactness import same_as_local, train_strong_lrn

from hetconv.imagecost import SPLIT_MARGIN as MARGIN
from hetconv.imagecost import choose_split as choose
from hetconv.imagecost import describe_choice as describe
from hetconv.master import probing, splitchoice
from hetconv.master.cluster import ClusterConfig
from hetconv.master.splitchoice import SplitChoice, allowed_exchanges, ruled_out_exchanges
from hetconv.master.spotcheck import SpotCheckConfig


def test_images_are_chosen_only_when_predicted_faster_by_the_margin():
    faster = choose(1.0, {"master": 0.5, "ring": 0.6}, ["master", "ring"])
    assert (faster["split"], faster["exchange"]) == ("images", "master")
    assert "2.00x faster" in faster["why"]
    ring = choose(1.0, {"master": 0.8, "ring": 0.4}, ["master", "ring"])
    assert ring["exchange"] == "ring"
    close = choose(1.0, {"master": 1.0 - MARGIN / 2}, ["master"])
    assert (close["split"], close["exchange"]) == ("kernels", None)
    assert "under the" in close["why"]
    slower = choose(1.0, {"master": 3.0}, ["master"])
    assert slower["split"] == "kernels"
    assert slower["predicted_s"] == {"kernels": 1.0, "images (master)": 3.0}


def test_where_the_kernel_split_trains_alone_any_faster_split_by_images_is_taken():
    # the alone check measures it against the master alone; without one the margin stands
    close = choose(1.0, {"ring": 0.95}, ["ring"], margin=0.0)
    assert (close["split"], close["exchange"]) == ("images", "ring")
    assert choose(1.0, {"ring": 0.95}, ["ring"])["split"] == "kernels"
    assert choose(1.0, {"ring": 1.01}, ["ring"], margin=0.0)["split"] == "kernels"


def test_an_exchange_ruled_out_is_never_chosen():
    # the ring is the fastest but not allowed (spot checks on): the master exchange's figure
    got = choose(1.0, {"master": 0.95, "ring": 0.2}, ["master"])
    assert got["split"] == "kernels"
    only_ring = choose(1.0, {"ring": 0.2}, ["master"])  # batch norm: the ring's alone
    assert only_ring["split"] == "kernels" and "ruled out: ring" in only_ring["why"]
    assert "by kernels" in describe(only_ring) and "images (ring) 0.2 s" in describe(only_ring)


def test_the_ring_is_allowed_with_spot_checks_and_without_tls():
    checked = ClusterConfig()
    unchecked = ClusterConfig(spot_checks=SpotCheckConfig(every=0))
    tls = ClusterConfig(tls_ca="a CA")
    assert allowed_exchanges(checked, "auto") == ["master", "ring"]  # sketches check the ring
    assert allowed_exchanges(unchecked, "auto") == ["master", "ring"]
    assert allowed_exchanges(unchecked, "ring") == ["ring"]
    assert allowed_exchanges(unchecked, "master") == ["master"]
    assert allowed_exchanges(tls, "auto") == ["master"]


def test_a_faster_way_ruled_out_is_named_with_what_rules_it_out():
    tls = ClusterConfig(tls_ca="a CA")
    why_not = ruled_out_exchanges(tls, "auto")
    assert why_not == {"ring": "the ring refuses TLS (its workers' parts are plain TCP)"}
    assert ruled_out_exchanges(ClusterConfig(), "auto") == {}  # spot checks rule out nothing
    assert ruled_out_exchanges(tls, "master") == {}  # --exchange master chose
    got = choose(1.0, {"ring": 0.5}, ["master"], why_not)  # batch norm: the ring's alone
    assert got["split"] == "kernels"
    assert got["why"].endswith(
        "; the split by images with the ring among the workers is predicted 2.00x faster, "
        "but the ring refuses TLS (its workers' parts are plain TCP)"
    )
    near = choose(1.0, {"ring": 0.95}, ["master"], why_not)  # within the margin: not said
    assert "TLS" not in near["why"]
    taken = choose(1.0, {"master": 0.5, "ring": 0.2}, ["master"], why_not)
    assert taken["exchange"] == "master" and "predicted 2.50x faster, but" in taken["why"]


def _args(**changes) -> argparse.Namespace:
    from hetconv.cli.main import build_parser

    argv = ["train"]
    for flag, value in changes.items():
        argv += [f"--{flag.replace('_', '-')}"] + ([] if value is True else [value])
    return build_parser().parse_args(argv)


@pytest.mark.parametrize(
    ("changes", "addresses", "split", "why"),
    [
        ({}, ["10.0.0.2:50051"], "auto", "cost model"),
        ({}, [], "kernels", "embedded default"),
        ({"discover": True}, [], "auto", "cost model"),
        ({"deterministic": True}, ["10.0.0.2:50051"], "kernels", "--deterministic"),
        ({"stages": "fused"}, ["10.0.0.2:50051"], "kernels", "--stages"),
        ({"wire_format": "bfloat16"}, ["10.0.0.2:50051"], "kernels", "--wire-format"),
        ({"split": "images"}, [], "images", "--split"),
        ({"split": "kernels"}, ["10.0.0.2:50051"], "kernels", "--split"),
    ],
)
def test_auto_resolves_by_where_and_what_the_flags_say(changes, addresses, split, why):
    from hetconv.cli.train import split_of

    got, reason = split_of(_args(**changes), addresses)
    assert got == split and why in reason


def test_exchange_with_the_split_by_kernels_is_refused(capsys):
    from hetconv.cli import main

    argv = ["train", "--split", "kernels", "--exchange", "ring", "--steps", "1", "--no-run-dir"]
    assert main(argv) == 2
    assert "with --split kernels nothing is; drop --exchange" in capsys.readouterr().err


def _forced(monkeypatch, exchange, split="images"):
    """Make the choice ``split`` (images by ``exchange``) whatever the predictions (the decision
    itself is tested above), and treat loopback workers as machines of their own."""
    real = splitchoice.choose_split

    def forced(kernels_s, images_s, allowed, ruled_out=None, **margin):
        got = real(kernels_s, images_s, allowed, ruled_out, **margin)
        return {**got, "split": split, "exchange": exchange, "why": "forced by the test"}

    monkeypatch.setattr(splitchoice, "choose_split", forced)
    monkeypatch.setattr(splitchoice, "on_this_machine", lambda address: False)


@pytest.mark.parametrize("exchange", ["master", "ring"])
def test_a_switch_to_images_trains_as_local_training(tmp_path, local, workers, monkeypatch,
                                                      exchange):  # fmt: skip
    """The model was grouped for the split by kernels (fused stages) before the choice; after
    the switch every step is split by images (the ring's parameters resident) and the run is
    local training's to float32 round-off."""
    _forced(monkeypatch, exchange)
    config = ClusterConfig(deterministic=True, spot_checks=SpotCheckConfig(every=0))
    trace = tmp_path / "trace.jsonl"
    # (the alone check would release these loopback workers: tests/test_alone_check.py)
    with SplitChoice(workers.addresses, config=config, alone_check=False) as cluster:
        got = train_strong_lrn(tmp_path, f"auto-{exchange}", cluster, trace=str(trace))
    same_as_local(got, local)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    plan, steps = records[0], [r for r in records if "step" in r]
    assert plan["split"] == "images" and plan["split_choice"]["exchange"] == exchange
    assert set(plan["split_choice"]["predicted_s"]) == {
        "kernels",
        "images (master)",
        "images (ring)",
        "images (cut:conv1)",
    }  # the network cut after conv1's block too (hetconv.cutcost)
    assert all(r["split"] == "images" and r["workers_computed"] == 2 for r in steps)


def test_workers_on_this_machine_keep_the_split_by_kernels(tmp_path, local, workers):
    """Loopback workers share the master's cores: whatever the predictions, the kernel split
    stays, and the plan says why."""
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(deterministic=True)
    with SplitChoice(workers.addresses, config=config) as cluster:
        got = train_strong_lrn(tmp_path, "auto-kernels", cluster, trace=str(trace), steps=3)
    np.testing.assert_allclose(got[0], local[0][:3], rtol=1e-5)
    plan = json.loads(trace.read_text().splitlines()[0])
    choice = plan["split_choice"]
    assert choice["split"] == "kernels" and "split" not in plan
    assert "runs on this machine" in choice["why"] or "under the" in choice["why"]


def test_a_gpu_worker_on_this_machine_does_not_share_its_cores(tmp_path, workers, monkeypatch):
    """A cuda worker on the master's machine computes on its GPU, not the master's cores: the
    rule that keeps the split by kernels for loopback workers leaves it out."""
    here = "127.0.0.1:1"
    assert splitchoice.sharing_cores([here, "10.9.9.9:1"], {here: "cuda"}) == []
    assert splitchoice.sharing_cores([here], {here: "onednn"}) == [here]
    assert splitchoice.sharing_cores([here], {}) == [here]  # not described: counted
    connect = probing.connect

    def as_cuda(node, *args, **kwargs):
        connect(node, *args, **kwargs)
        node.backend = "cuda"

    monkeypatch.setattr(probing, "connect", as_cuda)
    trace = tmp_path / "trace.jsonl"
    with SplitChoice(workers.addresses, config=ClusterConfig(deterministic=True)) as cluster:
        train_strong_lrn(tmp_path, "auto-gpu", cluster, trace=str(trace), steps=2)
    choice = json.loads(trace.read_text().splitlines()[0])["split_choice"]
    assert "runs on this machine" not in choice["why"], choice


def test_plan_says_what_auto_would_run():
    from hetconv.simulations.plan import IMAGE_SPLIT, IMAGE_SPLIT_RING, Candidate, auto_split

    def way(label, step, exact=True, kind="hetconv"):
        return Candidate(kind, label, step, 1.0, 0.0, exact, "")

    ranked = [way("DDP", 0.5, kind="data-parallel"), way(IMAGE_SPLIT_RING, 0.6),
              way("fused, bfloat16 wire", 0.7, exact=False), way(IMAGE_SPLIT, 0.8),
              way("fused stages", 1.0)]  # fmt: skip
    line = auto_split(ranked)
    assert line.startswith("--split auto (train's default with workers named): split by images "
                           "(ring among the workers) (predicted 1.67x faster")  # fmt: skip
    assert "tried" not in line  # the split by kernels predicted 1.67x: no trial
    kernels = auto_split([way(IMAGE_SPLIT, 0.95), way("fused stages", 1.0)])
    assert "split by kernels" in kernels and "spot-check" not in kernels
    # within 25 %: both run a few steps at the start of training, the faster kept
    assert "gradients through the master) is predicted within 25%, so both are run" in kernels
    assert auto_split([way("fused stages", 1.0)]) == ""


def test_a_kernel_split_that_keeps_every_kernel_on_the_master_trains_alone(
    tmp_path, local, workers, monkeypatch
):
    """Where the kernel split stays and its plan gives the workers nothing, the master trains
    alone (LocalConv: no calls) and releases them; the run is local training's, and the
    trace's plan is the kernel split's, with the choice saying so. (The plan of these
    loopback workers does give them kernels: the test makes the check say it does not.)"""
    real = splitchoice.keeps_every_kernel
    seen = []

    def keeps(cluster):
        seen.append(real(cluster))
        return True

    real_choice = splitchoice.choose_split

    def kernels(kernels_s, images_s, allowed, ruled_out=None, **margin):
        got = real_choice(kernels_s, images_s, allowed, ruled_out, **margin)
        return {**got, "split": "kernels", "exchange": None, "why": "forced by the test"}

    monkeypatch.setattr(splitchoice, "keeps_every_kernel", keeps)
    monkeypatch.setattr(splitchoice, "choose_split", kernels)
    monkeypatch.setattr(splitchoice, "on_this_machine", lambda address: False)
    trace = tmp_path / "trace.jsonl"
    with SplitChoice(workers.addresses, config=ClusterConfig()) as cluster:  # probes choose
        got = train_strong_lrn(tmp_path, "auto-alone", cluster, trace=str(trace), steps=3)
        inner = cluster.inner
    np.testing.assert_allclose(got[0], local[0][:3], rtol=1e-5)
    assert seen == [False]  # the real plan gave the workers kernels
    assert type(inner).__name__ == "LocalConv"
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    plan, steps = records[0], [r for r in records if "step" in r]
    choice = plan["split_choice"]
    assert choice["split"] == "kernels" and choice["released"]
    assert choice["why"] == (
        "forced by the test; the split by kernels keeps every kernel on the "
        "master: it trains alone, as --local, and the workers are released"
    )
    assert "shares" in plan and len(steps) == 3 and "nodes" not in steps[0]


def test_keeps_every_kernel_reads_the_plans_replicas_and_heads():
    from types import SimpleNamespace as Obj

    def cluster(shares, feeds=None, heads=None):
        plans = {f"c{i}": Obj(shares=s) for i, s in enumerate(shares)}
        return Obj(plans=plans, replicas=Obj(feeds=feeds or {}), head_fcs=heads or {})

    keeps = splitchoice.keeps_every_kernel
    assert keeps(cluster([(16, 0, 0), (32, 0, 0)]))
    assert not keeps(cluster([(16, 0, 0), (30, 2, 0)]))
    assert not keeps(cluster([(16, 0, 0)], feeds={"c0": "c1"}))  # a block on the workers
    assert not keeps(cluster([(16, 0, 0)], heads={"c0": "fc"}))  # a head on them
    assert not keeps(cluster([]))  # nothing planned
