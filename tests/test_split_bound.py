"""``benchmarks/split_bound.py``: the compute-only bound of the kernel split runs, writes its
rows, and refuses bad input by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "split_bound.py"


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120
    )


def test_split_bound_writes_one_row_per_network_and_batch(tmp_path):
    out = tmp_path / "rows.json"
    done = _run("--networks", "tiny", "--batches", "2", "4", "--nodes", "3", "--repeats", "1",
                "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [(r["network"], r["batch"], r["nodes"]) for r in rows] == [
        ("tiny", 2, 3),
        ("tiny", 4, 3),
    ]
    for r in rows:
        assert r["share"] == 6  # ceil(16 / 3) of tiny's second convolution
        assert r["cap"] is None
        for key in ("alone_s", "block_s", "stage_s", "full_stage_s"):
            assert r[key] > 0, key
        node = r["block_s"] + r["stage_s"]
        assert abs(r["bound"] - r["alone_s"] / (node + r["rest_s"])) < 1e-9
        split = r["block_part_s"] + r["stage_s"] + r["rest_s"]
        assert abs(r["bound_split_block"] - r["alone_s"] / split) < 1e-9
        # the other images' block outputs: tiny's 8 channels at 16x16 after the pool, float32
        others = r["batch"] - -(-r["batch"] // 3)
        assert r["exchange_mb"] == others * 8 * 16 * 16 * 4 / 1e6
    assert "tiny" in done.stdout and "bound" in done.stdout


def test_split_bound_together_times_the_node_work_in_that_many_processes(tmp_path):
    out = tmp_path / "rows.json"
    done = _run("--networks", "tiny", "--batches", "2", "--nodes", "3", "--repeats", "2",
                "--together", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    (r,) = json.loads(out.read_text())
    assert 0 < r["node_together_s"] <= r["node_together_max_s"]
    bound = r["alone_s"] / (r["node_together_s"] + r["rest_s"])
    assert abs(r["bound_together"] - bound) < 1e-9
    assert "node x3" in done.stdout
    assert not list(tmp_path.glob("*.ready"))  # the barrier files lived in a folder of its own


def test_split_bound_refuses_bad_input_by_name():
    for argv, message in [
        (["--networks", "nope"], "unknown network 'nope'"),
        (["--nodes", "0"], "must be positive"),
        (["--cap", "0.01"], "below the kernel's least quota"),
    ]:
        done = _run(*argv)
        assert done.returncode == 2, (argv, done.stderr)
        assert message in done.stderr, (argv, done.stderr)
