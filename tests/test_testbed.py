"""The scaled cluster testbed (``benchmarks/testbed.py`` over
:class:`hetconv.simulations.testbed.ClusterTestbed`).

The first tests need nothing: the mode table, the scaling arithmetic and the argument checks.
The rest build real testbeds (network namespaces, a bridge, tc, an ifb device, CPU cgroups) and
need root, ``ip`` and ``tc``; they skip with the reason where the machine cannot. They check what
the benchmark's figures rest on: a capped process gets its cap of a core and no more, a shaped
link carries its rate (switched: each node's own, each way; shared: one rate for every transfer
to and from the master, both ways), everything is gone afterwards (also after an error, Ctrl-C,
or a run killed outright), and a tiny real run through a real worker process gives every row.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetconv.simulations import testbed

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("testbed_benchmark", ROOT / "benchmarks/testbed.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["testbed_benchmark"] = bench  # (dataclasses look their module up)
_spec.loader.exec_module(bench)

UNAVAILABLE = testbed.cluster_testbed_unavailable(testbed.SHARED_LINK)
needs_testbed = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"testbed: {UNAVAILABLE}")


# -- without the testbed -------------------------------------------------------------------------


def test_scale_keeps_compute_to_bandwidth_of_a_laptop():
    scale = bench.Scale(cap=0.36, core_gflops=100.0, laptop_gflops=60.0, laptop_link_mbit=1000)
    assert scale.factor == pytest.approx(0.6)
    assert scale.rate_mbit == pytest.approx(600)
    # Seconds per FLOP over seconds per byte is the laptop's: 60 GFLOPS against 1000 Mbit/s.
    assert (scale.cap * scale.core_gflops) / scale.rate_mbit == pytest.approx(60.0 / 1000)


def test_a_mode_that_needs_a_missing_flag_is_skipped_with_a_note_and_runs_once_it_exists():
    names = ["kernel_split", "float16", "fused", "all"]
    without, notes = bench.runnable_modes(names, "usage: hetconv train [--wire-format ...]")
    assert [m.name for m in without] == ["kernel_split", "float16", "all"]
    assert notes == ["fused: skipped, `hetconv train --help` lists no --stages"]
    assert "--stages" not in bench.runnable_modes(["all"], "")[0][0].flags
    with_stages, notes = bench.runnable_modes(names, "... --stages {kernel,fused} ...")
    assert [m.name for m in with_stages] == names and notes == []
    everything = with_stages[-1]
    assert everything.flags == (
        "--wire-format", "float16", "--shares", "link", "--network", "{network}",
        "--stages", "fused",
    )  # fmt: skip
    assert everything.arguments("shared")[-3:] == ["wifi", "--stages", "fused"]
    assert everything.arguments("switched")[len(bench.BASE) + 5] == "switched"
    # Every mode starts from the paper's kernel split; its own flags come last and win.
    assert everything.arguments("switched")[: len(bench.BASE)] == list(bench.BASE)
    assert with_stages[0].arguments("switched") == [
        "--shares", "compute", "--stages", "unfused", "--kernels", "sent", "--replicate", "off",
        "--overlap", "off", "--head", "master",
    ]  # fmt: skip
    # Resident kernels run once `hetconv train` has --kernels; "all" then keeps them.
    help_text = "... --stages {kernel,fused} ... --kernels {auto,resident,sent} ..."
    (resident, everything), notes = bench.runnable_modes(["resident", "all"], help_text)
    assert notes == [] and resident.arguments("shared")[-4:] == [
        "--stages", "fused", "--kernels", "resident",
    ]  # fmt: skip
    assert everything.arguments("shared")[-2:] == ["--kernels", "resident"]


def test_unknown_modes_and_caps_past_the_machine_are_refused_by_name():
    with pytest.raises(ValueError, match="mode 'turbo' is not one of kernel_split, "):
        bench.modes_named(["kernel_split", "turbo"])
    parse = bench.build_parser().parse_args
    assert bench.check_arguments(parse(["--workers", "2", "4"])) is None
    wrong = bench.check_arguments(parse(["--workers", "4", "--cap", "0.5"]))
    assert wrong == "--cap 0.5 x 5 processes = 2.50 cores, more than 1.8 of this machine's"
    assert "is not one of" in bench.check_arguments(parse(["--network", "paper-1-2"]))
    assert "--modes" in bench.check_arguments(parse(["--modes", "turbo"]))
    with pytest.raises(ValueError, match="link 'mesh' is not one of switched, shared"):
        testbed.ClusterTestbed(2, "mesh", 10.0, 0.3)
    with pytest.raises(ValueError, match=r"CPU cap must be in \(0, 1\] of a core, got 1.5"):
        testbed.ClusterTestbed(2, "shared", 10.0, 1.5)
    with pytest.raises(ValueError, match="CPU cap 0.05 is below the kernel's least quota"):
        testbed.CpuCap("x", 0.05)


# -- with the testbed ----------------------------------------------------------------------------


def test_the_cfs_period_flag_sets_every_caps_period(monkeypatch):
    from hetconv.simulations import cpucap

    monkeypatch.setattr(cpucap, "CFS_PERIOD_US", cpucap.CFS_PERIOD_US)  # restored after
    args = bench.build_parser().parse_args(["--cfs-period-ms", "3"])
    bench.apply_period(args)
    assert cpucap.CFS_PERIOD_US == 3000
    cpucap.CpuCap("probe", 0.36)  # 1.08 ms of every 3: the kernel's least quota is 1 ms
    with pytest.raises(ValueError, match="least quota, 1 ms of every 3 ms"):
        cpucap.CpuCap("probe", 0.3)
    assert bench.build_parser().parse_args([]).cfs_period_ms == 10


def _cpu_share(bed: testbed.ClusterTestbed, host: testbed.Host, seconds: float = 1.5) -> float:
    """The share of a core a busy loop on ``host`` (in its cap) gets over ``seconds``."""
    loop = bed.spawn([sys.executable, "-I", "-c", "while True: pass"], os.environ, host)
    time.sleep(0.3)  # (started)
    start_cpu, start = testbed.cpu_seconds(loop.pid), time.monotonic()
    time.sleep(seconds)
    share = (testbed.cpu_seconds(loop.pid) - start_cpu) / (time.monotonic() - start)
    loop.kill()
    loop.wait()
    return share


@pytest.mark.parametrize(
    "flags",
    [["--stages", "unfused"], pytest.param(["--stages", "fused"], marks=pytest.mark.slow)],
)
def test_the_prediction_models_the_modes_the_run_traced(tmp_path, flags):
    # A run through real loopback workers in each stage mode: the step the simulator predicts
    # for its trace moves the bytes the run moved (fused calls counted as fused, not as the
    # plain kernel split's).
    from hetconv.simulations.trace import read_steps, step_bytes

    trace = tmp_path / "trace.jsonl"
    command = [sys.executable, "-I", "-m", "hetconv", "train", "--steps", "3", "--batch", "8",
               "--no-progress", "--no-run-dir", "--trace", str(trace), "--shares", "compute",
               "--kernels", "sent", "--local-workers", "2", *flags]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    result, cal = bench.predict(str(trace), testbed.SWITCHED_LINK, 1000.0, 1e-4, 1.0)
    # (equal but for the step number's size in each call's header: the model counts step 1000)
    assert result.bytes == pytest.approx(step_bytes(read_steps(str(trace))[-1]), rel=1e-4)
    assert set(cal.stage_modes.values()) == {flags[1]}
    # The master alone's prediction is what the plan predicted for it (its probes and its own
    # timing of the other layers); a trace without that figure falls back to the probes plus
    # the run's comp.
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    (plan,) = [r for r in records if r.get("event") == "plan"]
    assert bench.predict_alone(cal) == pytest.approx(plan["prediction"]["alone_s"])
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(
        json.dumps({k: v for k, v in r.items() if k != "prediction"}) + "\n" for r in records
    ))  # fmt: skip
    _, bare_cal = bench.predict(str(bare), testbed.SWITCHED_LINK, 1000.0, 1e-4, 1.0)
    probes = plan["nodes"][0]["probe_seconds"]
    assert bench.predict_alone(bare_cal) == pytest.approx(
        sum(probes.values()) + bare_cal.comp_per_image_s * bare_cal.batch
    )


@pytest.mark.slow
@needs_testbed
def test_caps_and_shared_medium_hold_and_everything_goes_away():
    rate = 40.0
    goodput = testbed.tcp_goodput_mbps(rate)
    megabytes = goodput / 8 * 0.8  # about 0.8 s alone at the rate
    with testbed.ClusterTestbed(2, testbed.SHARED_LINK, rate, cap=0.25) as bed:
        tag = bed.tag
        master, w0, w1 = bed.hosts
        assert w0.cap.quota() == (testbed.CFS_PERIOD_US // 4, testbed.CFS_PERIOD_US)
        # A busy loop gets its quarter of a core, not the core it asks for (a loaded machine
        # can give it less, never more), and the kernel says it was throttled.
        before = w0.cap.stat()["nr_throttled"]
        share = _cpu_share(bed, w0)
        assert 0.03 < share < 0.3, share
        assert w0.cap.stat()["nr_throttled"] > before
        # One transfer alone gets the medium; one each way at once share it (half duplex:
        # together no more than the rate, where a switched link carries it each way). The
        # lower bounds are loose: a loaded machine slows the uncapped endpoints too.
        (alone,) = bed.transfer_mbps([(master, w0)], megabytes)
        assert 0.6 * goodput < alone < 1.1 * goodput, (alone, goodput)
        both = bed.transfer_mbps([(master, w0), (w1, master)], megabytes)
        # (1.2: each port's packets enter the one bucket, whose burst lets each transfer's
        # first few kB through above the rate; a switched link would carry about 2x)
        assert 0.5 * goodput < sum(both) < 1.2 * goodput, (both, goodput)
        assert min(both) > 0.15 * goodput, both
        assert bed.leftovers() == sorted(
            [f"{tag}-m", f"{tag}-s", f"{tag}-w0", f"{tag}-w1"]
            + [str(testbed.CPU_CGROUP_ROOT / f"{tag}-{n}") for n in ("m", "w0", "w1")]
        )
    assert bed.leftovers() == []


@needs_testbed
def test_switched_links_are_full_duplex_per_node_and_the_master_port_is_one_link():
    rate = 40.0
    goodput = testbed.tcp_goodput_mbps(rate)
    megabytes = goodput / 8 * 0.8
    with testbed.ClusterTestbed(2, testbed.SWITCHED_LINK, rate, cap=None) as bed:
        master, w0, w1 = bed.hosts
        # Into the master and out of it at once: each way has the whole rate (together more
        # than a shared medium's 1.1 could carry).
        duplex = bed.transfer_mbps([(master, w0), (w1, master)], megabytes)
        assert all(r < 1.1 * goodput for r in duplex), (duplex, goodput)
        assert sum(duplex) > 1.3 * goodput, (duplex, goodput)
        # Out of the master to both workers: its one port shares the rate.
        out = bed.transfer_mbps([(master, w0), (master, w1)], megabytes)
        assert 0.5 * goodput < sum(out) < 1.1 * goodput, (out, goodput)
    assert bed.leftovers() == []


@needs_testbed
def test_an_error_inside_the_testbed_still_removes_it():
    with pytest.raises(RuntimeError, match="boom"):
        with testbed.ClusterTestbed(1, testbed.SWITCHED_LINK, 10.0, cap=0.2) as bed:
            bed.spawn(["sleep", "600"], os.environ, bed.hosts[1])
            raise RuntimeError("boom")
    assert bed.leftovers() == []


@needs_testbed
def test_remove_stale_removes_what_a_killed_run_left():
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    tag = f"{testbed.PREFIX}{gone.pid % 10**7}"
    subprocess.run(["ip", "netns", "add", f"{tag}-s"], check=True)
    group = testbed.CPU_CGROUP_ROOT / f"{tag}-w0"
    group.mkdir()
    try:
        removed = testbed.remove_stale()
        assert f"{tag}-s" in removed and str(group) in removed
        assert not group.exists()
        assert (
            f"{tag}-s"
            not in subprocess.run(
                ["ip", "netns", "list"], capture_output=True, text=True
            ).stdout.split()
        )
    finally:
        subprocess.run(["ip", "netns", "del", f"{tag}-s"], capture_output=True)
        if group.exists():
            group.rmdir()


def _leftovers_of(pid: int) -> list[str]:
    tag = f"{testbed.PREFIX}{pid % 10**7}"
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    names += [str(p) for p in testbed.CPU_CGROUP_ROOT.glob(f"{tag}-*")]
    return [n for n in names if n.startswith(tag) or f"/{tag}-" in n]


@pytest.mark.slow  # every row through real workers (about 12 s)
@needs_testbed
def test_a_tiny_run_gives_every_row_through_real_workers(tmp_path):
    rows = tmp_path / "rows.json"
    command = [
        sys.executable, str(ROOT / "benchmarks/testbed.py"), "--network", "tiny",
        "--batch", "8", "--workers", "1", "--link", "switched", "--steps", "2", "--warmup", "1",
        "--modes", "kernel_split", "float16", "--core-gflops", "10", "--rate-mbit", "200",
        "--json", str(rows),
    ]  # fmt: skip
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stderr
    assert _leftovers_of(run.pid) == []
    out = json.loads(rows.read_text())
    assert [r["mode"] for r in out] == ["master_alone", "kernel_split", "float16"]
    for row in out:
        for key in ("network", "batch", "workers", "link", "mode", "step_s", "speedup",
                    "master_mb_per_step", "predicted_step_s"):  # fmt: skip
            assert key in row
        assert row["network"] == "tiny" and row["workers"] == 1 and row["link"] == "switched"
        assert row["step_s"] > 0 and row["predicted_step_s"] > 0
        assert row["cap"] == pytest.approx(0.9) and row["rate_mbit"] == 200
    alone, split, half = out
    assert alone["master_mb_per_step"] == 0 and alone["speedup"] == 1
    assert split["speedup"] == pytest.approx(alone["step_s"] / split["step_s"])
    # The worker really took part, and float16 moved fewer bytes than float32.
    assert split["master_mb_per_step"] > 0
    assert 0 < half["master_mb_per_step"] < split["master_mb_per_step"]
    assert "kernel_split" in stdout and "predicted s" in stdout


@pytest.mark.slow
@needs_testbed
def test_ctrl_c_mid_run_removes_namespaces_cgroups_and_processes():
    command = [
        sys.executable, str(ROOT / "benchmarks/testbed.py"), "--network", "tiny",
        "--workers", "1", "--link", "shared", "--steps", "500", "--modes", "kernel_split",
        "--core-gflops", "10", "--no-link-check",
    ]  # fmt: skip
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(_leftovers_of(run.pid)) < 5:  # 3 namespaces (master, switch, w0), 2 cgroups
            assert run.poll() is None, run.communicate()
            assert time.monotonic() < deadline, "the testbed did not come up"
            time.sleep(0.2)
        time.sleep(2)  # (into the master alone's run)
        tag = f"{testbed.PREFIX}{run.pid % 10**7}"
        capped = [
            int(pid)
            for group in testbed.CPU_CGROUP_ROOT.glob(f"{tag}-*")
            for pid in (group / "cgroup.procs").read_text().split()
        ]
        assert capped, "no process in the testbed's cgroups"
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, err
    assert "interrupted; everything it started is removed" in err
    assert _leftovers_of(run.pid) == []
    assert not [pid for pid in capped if testbed._alive(pid)]


def test_a_finished_process_gives_its_output_and_a_failed_or_stuck_one_its_tail():
    def started(code: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip

    assert testbed.finished_output(started("print('done')"), 30, "ok") == "done\n"
    lines = "; ".join(f"print({i})" for i in range(5))
    with pytest.raises(RuntimeError, match=r"the job failed \(3\):\n3\n4$"):
        testbed.finished_output(started(f"{lines}; raise SystemExit(3)"), 30, "the job", 2)
    stuck = started("import time; time.sleep(60)")
    with pytest.raises(RuntimeError, match="the sleeper did not finish within 2 s"):
        testbed.finished_output(stuck, 2, "the sleeper")
    assert stuck.poll() is not None  # killed, not left behind


def test_a_run_whose_split_changed_says_its_settled_step(tmp_path):
    """--split auto's checks change the split mid-run: the row's note gives the median of the
    steps after the last change (the split trial's decision, or the workers released)."""
    trace = tmp_path / "trace.jsonl"
    steps = [{"step": i, "seconds": 2.0} for i in range(6)]
    steps[5]["alone_check"] = {"released": False, "trial": True}
    steps += [{"step": i, "seconds": 3.0} for i in range(6, 12)]
    steps[11]["split_trial"] = {"kept": "first"}
    steps += [{"step": i, "seconds": 1.0 + i / 100} for i in range(12, 15)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in steps))
    assert bench.settled([str(trace)]) == (
        "settled 1.130 s: the median of the 3 steps after step 11 (a change of split)"
    )
    released = tmp_path / "released.jsonl"
    steps[5]["alone_check"] = {"released": True}
    released.write_text("".join(json.dumps(r) + "\n" for r in steps[:8]))
    assert "after step 5" in bench.settled([str(released)])
    steady = tmp_path / "steady.jsonl"
    steady.write_text("".join(json.dumps({"step": i, "seconds": 1.0}) + "\n" for i in range(4)))
    assert bench.settled([str(steady)]) == ""


def test_a_run_that_ends_inside_a_split_trial_is_predicted_as_the_split_it_chose(tmp_path):
    """The kernel split chosen, the ring tried from step 6: a run that ends before the trial
    decides is the kernel split's; one whose trial kept the ring is the ring's."""
    images_plan = sys.modules["testbed_predict"]._images_plan
    plan = {"event": "plan", "start_step": 0, "split": "kernels"}
    steps = [{"step": i, "seconds": 2.0} for i in range(6)]
    steps += [{"step": i, "seconds": 3.0, "split": "images", "exchange": "ring"}
              for i in range(6, 9)]  # fmt: skip
    inside = tmp_path / "inside.jsonl"
    inside.write_text("".join(json.dumps(r) + "\n" for r in [plan, *steps]))
    assert images_plan(str(inside)) is None
    trial = {"split": "images", "exchange": "ring", "seconds": 1.5}
    for kept, expected in (("trial", "images"), ("first", None)):
        steps[-1]["split_trial"] = {"kept": kept, "trial": trial}
        decided = tmp_path / f"{kept}.jsonl"
        decided.write_text("".join(json.dumps(r) + "\n" for r in [plan, *steps]))
        got = images_plan(str(decided))
        assert (got and got["split"]) == expected
        if got:
            assert got["exchange"] == "ring"


def test_a_run_with_every_kernel_on_the_master_is_predicted_from_its_plan(tmp_path):
    """The link-aware shares can leave every worker idle (resnet20 at batch 16 on the scaled
    testbed): the steps have no per-node record to calibrate from, and the prediction is the
    plan's, the master's own step; a trace with per-node records is not read so."""
    plan = {"event": "plan", "start_step": 0, "shares": {"conv1": [16, 0, 0]},
            "prediction": {"step_s": 0.176, "alone_s": 0.176, "speedup": 1.0}}  # fmt: skip
    trace = tmp_path / "trace.jsonl"
    steps = [{"step": i, "seconds": 0.19, "comm_seconds": 0.0} for i in range(4)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in [plan, *steps]))
    result, cal = bench.predict(str(trace), "switched", 250.0, 0.001, 0.36)
    assert result.step_s == pytest.approx(0.176)
    assert bench.predict_alone(cal) == pytest.approx(0.176)
    steps[1]["nodes"] = {"10.0.0.2:50051": {"seconds": 0.1}}
    trace.write_text("".join(json.dumps(r) + "\n" for r in [plan, *steps]))
    assert sys.modules["testbed_predict"]._master_only(str(trace)) is None
