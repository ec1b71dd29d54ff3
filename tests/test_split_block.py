"""``benchmarks/split_block.py``: the replicated block split by images across the testbed's
nodes, compute and node-to-node exchange measured together (network namespaces, tc, CPU
cgroups; root): its row, its check of the split, nothing left behind, bad input refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hetconv.simulations import testbed

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "split_block.py"
UNAVAILABLE = testbed.cluster_testbed_unavailable(testbed.SWITCHED_LINK)
needs_testbed = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"testbed: {UNAVAILABLE}")


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300
    )


def _module():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import split_block
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return split_block


@pytest.mark.slow
@needs_testbed
def test_the_split_block_equals_the_replicated_one_and_the_testbed_goes_away(tmp_path):
    out = tmp_path / "row.json"
    done = _run("--network", "tiny", "--batch", "7", "--workers", "2", "--steps", "2",
                "--rounds", "2", "--rate-mbit", "200", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    [row] = json.loads(out.read_text())
    assert (row["network"], row["batch"], row["workers"], row["link"]) == (
        "tiny", 7, 2, "switched"
    )  # fmt: skip
    assert row["rate_mbit"] == 200 and row["cap"] == pytest.approx(0.6)
    assert row["split_check"] < 1e-4  # the nodes' kernel gradients sum to the replicated ones
    for mode in ("replicated", "split", "split_overlap", "split_workers"):
        assert row[f"{mode}_s"] > 0
        assert row[f"{mode}_speedup"] == pytest.approx(
            row["alone_s"] / (row[f"{mode}_s"] + row["rest_s"])
        )
    assert row["replicated_exchange_s"] == 0
    assert row["split_exchange_s"] > 0 and row["split_workers_exchange_s"] > 0
    assert row["split_overlap_exchange_s"] >= 0  # time waited: the exchange may hide fully
    shares = row["split_workers_shares"]
    assert len(shares) == 3 and sum(shares) == 16 and min(shares) >= 1
    assert testbed.remove_stale() == []


def test_image_and_kernel_ranges_cover_everything_once():
    sb = _module()
    for batch, nodes in [(16, 5), (64, 5), (7, 3), (5, 5)]:
        ranges = sb.image_ranges(batch, nodes)
        assert [r.start for r in ranges[1:]] == [r.stop for r in ranges[:-1]]
        assert ranges[0].start == 0 and ranges[-1].stop == batch
        sizes = [r.stop - r.start for r in ranges]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    kernels = sb.kernel_ranges(800, 5)
    assert [(k.start, k.stop) for k in kernels] == [(i * 160, i * 160 + 160) for i in range(5)]


def test_a_split_whose_gradients_do_not_add_up_fails_the_run(tmp_path):
    sb = _module()
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((4, 3, 5, 5)).astype(np.float32) for _ in range(3)]
    total = sum(parts)
    for i, part in enumerate(parts):
        np.save(tmp_path / f"replicated-{i}.npy", part)
        np.save(tmp_path / f"split-{i}.npy", total / 3)  # other parts, the same sum
        np.save(tmp_path / f"split_overlap-{i}.npy", parts[2 - i])
        np.save(tmp_path / f"split_workers-{i}.npy", total if i == 0 else 0 * part)
    assert sb.check_split(tmp_path, 3) < 1e-6
    np.save(tmp_path / "split_workers-2.npy", total / 3 + 0.01)
    with pytest.raises(RuntimeError, match="split_workers: .* off by"):
        sb.check_split(tmp_path, 3)


def test_balanced_shares_give_the_master_fewer_kernels_for_its_whole_block():
    sb = _module()
    # 0.01 s a kernel; the master's whole block 0.4 s, a worker's part and exchange 0.1 s
    replicated = [{"stage_s": 1.0, "kernels": 100, "step_s": 1.4}] * 5
    workers = [{"stage_s": 1.0, "step_s": 1.4}] + [{"stage_s": 1.0, "step_s": 1.1}] * 4
    shares = sb.balanced_shares(500, replicated, workers)
    assert shares == [76, 106, 106, 106, 106]
    # every node then takes 1.16 s: the master 0.76 + 0.4, a worker 1.06 + 0.1


@pytest.mark.slow
def test_bad_input_is_refused_by_name():
    for argv, message in [
        (["--network", "nope"], "unknown network 'nope'"),
        (["--workers", "0"], "must be positive"),
        (["--batch", "3"], "gives some of the 5 nodes no image"),
        (["--rate-mbit", "0"], "must be positive"),
        (["--cap", "2"], "--cap must be in (0, 1]"),
    ]:
        done = _run(*argv)
        assert done.returncode == 2, (argv, done.stderr)
        assert message in done.stderr, (argv, done.stderr)
