"""``benchmarks/network_medium.py``: ``--network auto``'s measurement repeated over a real
shaped link, full then half duplex (a worker in a network namespace; root): its rows, nothing
left behind, bad input refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetconv.simulations import testbed

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "network_medium.py"
UNAVAILABLE = testbed.testbed_unavailable()


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow  # ~25 s; the same measurement on the same links: tests/test_network_medium.py
@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"testbed: {UNAVAILABLE}")
def test_both_links_are_measured_and_the_testbed_goes_away(tmp_path):
    out = tmp_path / "rows.json"
    done = _run("--trials", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr
    full, half = json.loads(out.read_text())
    assert (full["link"], half["link"]) == ("full duplex", "half duplex")
    for row in (full, half):
        assert row["trials"] == 2 and len(row["ratios"]) == 2
        assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
        assert row["echoes_max"] in (9, 18, 27)  # 3 rounds at most, 3 x 3 echoes each
    # a measurement wrong on both links would say nothing about the links
    assert full["ratio_median"] < half["ratio_median"]
    assert testbed.remove_stale() == []


def test_bad_input_is_refused_by_name():
    for argv in (["--trials", "0"], ["--rate-mbit", "0"]):
        done = _run(*argv)
        assert done.returncode == 2, (argv, done.stderr)
        assert "must be positive" in done.stderr, (argv, done.stderr)
