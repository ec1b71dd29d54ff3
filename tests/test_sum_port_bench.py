"""``benchmarks/sum_port.py``: batch norm's sums over the sum ports against RingPart calls,
among real worker services in one process: its rows, and bad input refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "sum_port.py"


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120
    )


def test_both_ways_are_timed_side_by_side(tmp_path):
    out = tmp_path / "rows.json"
    done = _run("--ranks", "3", "--values", "8", "--sums", "5", "--rounds", "1",
                "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [r["way"] for r in rows] == ["sum port", "RingPart calls"]
    for row in rows:
        assert row["ranks"] == 3 and row["sums"] == 5
        assert row["wall_ms_per_sum"] > 0 and row["cpu_ms_per_sum_rank"] > 0
    assert rows[1]["wall_x"] == 1.0 and rows[1]["cpu_x"] == 1.0  # the calls: the baseline
    assert "sum port" in done.stdout and "RingPart calls" in done.stdout


def test_a_ring_of_one_is_refused():
    done = _run("--ranks", "1")
    assert done.returncode == 2 and "--ranks must be >= 2" in done.stderr
