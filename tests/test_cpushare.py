"""The share of a core a CPU quota allows (:func:`hetconv.cpushare.quota_share`), read from a
process's cgroup (v1 and v2, on files laid out as the kernel's), and a convolution probe under a
real cgroup v1 quota, which counts its CPU time over that share (needs root; skipped, saying
why, where the machine cannot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hetconv.cpushare import quota_share


def _cgroup(tmp_path: Path, line: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc = tmp_path / "proc-cgroup"
    proc.write_text(line + "\n")
    root = tmp_path / "cgroup"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return proc, root


def test_a_v1_quota_and_the_tighter_one_above_it(tmp_path):
    proc, root = _cgroup(tmp_path, "4:cpu,cpuacct:/bed/w0", {
        "cpu,cpuacct/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1",
        "cpu,cpuacct/bed/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/bed/cpu.cfs_quota_us": "-1",
        "cpu,cpuacct/bed/w0/cpu.cfs_period_us": "10000",
        "cpu,cpuacct/bed/w0/cpu.cfs_quota_us": "3600",
    })  # fmt: skip
    assert quota_share(proc, root) == pytest.approx(0.36)
    (root / "cpu,cpuacct/bed/cpu.cfs_quota_us").write_text("25000\n")  # the group above: tighter
    assert quota_share(proc, root) == pytest.approx(0.25)


def test_a_v2_quota_and_none(tmp_path):
    proc, root = _cgroup(tmp_path, "0::/user/job", {
        "cgroup.controllers": "cpu memory",
        "user/cpu.max": "max 100000",
        "user/job/cpu.max": "50000 100000",
    })  # fmt: skip
    assert quota_share(proc, root) == pytest.approx(0.5)
    (root / "user/job/cpu.max").write_text("max 100000\n")
    assert quota_share(proc, root) is None
    (root / "user/job/cpu.max").write_text("200000 100000\n")  # two cores: no cap under one
    assert quota_share(proc, root) is None
    assert quota_share(tmp_path / "missing", root) is None  # no /proc/self/cgroup to read


# A layer whose forward and backward take about 0.3 ms: under a quarter of a core (2.5 ms of
# every 10 ms period) one such call may run at the whole core's speed.
PROBE = """
import json
from hetconv.backends import CpuBackend, conv_shape
from hetconv.cpushare import process_quota_share
backend = CpuBackend()
shape = conv_shape((4, 16, 16, 16), (16, 16, 3, 3), 1)
backend.time_step(shape)
print(json.dumps({"share": process_quota_share(), "probe": backend.time_step(shape, 5)}))
"""


def _probe(prefix: list[str]) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    done = subprocess.run([*prefix, sys.executable, "-I", "-c", PROBE], capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_probe_under_a_real_quota_counts_its_cpu_time_over_the_share():
    from hetconv.simulations.cpucap import CpuCap, ensure_cpu_controller

    if os.geteuid() != 0:
        pytest.skip("a cgroup v1 cpu group needs root")
    try:
        ensure_cpu_controller()
    except RuntimeError as e:
        pytest.skip(str(e))
    cap = CpuCap(f"hetconv-share-{uuid.uuid4().hex[:8]}", 0.25)
    cap.create()
    try:
        got = _probe(cap.prefix())
    finally:
        cap.remove()
    uncapped = _probe([])
    assert got["share"] == pytest.approx(0.25) and uncapped["share"] is None
    # the capped probe is its CPU time over a quarter of a core, about 4x the uncapped one
    # (its best wall time alone, a call run at the whole core's speed, would be about 1x)
    assert got["probe"] > 2 * uncapped["probe"], (got, uncapped)
