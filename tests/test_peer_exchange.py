"""``benchmarks/peer_exchange.py``: the node-to-node exchange a block split by images would need,
measured on a real testbed (network namespaces, a bridge, tc; root): its rows, its arithmetic,
nothing left behind, and bad input refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetconv.simulations import testbed

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "peer_exchange.py"
UNAVAILABLE = testbed.cluster_testbed_unavailable(testbed.SWITCHED_LINK)
needs_testbed = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"testbed: {UNAVAILABLE}")


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300
    )


@needs_testbed
def test_every_node_exchanges_with_every_other_and_the_testbed_goes_away(tmp_path):
    out = tmp_path / "rows.json"
    done = _run("--network", "tiny", "--batches", "4", "8", "--workers", "2",
                "--rate-mbit", "200", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["nodes"], r["link"]) for r in rows] == [
        (4, 3, "switched"), (8, 3, "switched")
    ]  # fmt: skip
    per_image = 4 * 8 * 16 * 16  # tiny's first block: 8 channels at 16x16, float32
    for r in rows:
        own = -(-r["batch"] // 3)
        assert r["piece_mb"] == own * per_image / 1e6
        assert r["exchange_mb_per_node"] == (r["batch"] - own) * per_image / 1e6
        most = max(2 * r["piece_mb"], r["exchange_mb_per_node"])
        assert r["line_rate_s"] == pytest.approx(8 * most / 200)
        assert r["all_to_all_s"] > 0 and r["via_master_s"] > 0
    assert testbed.remove_stale() == []  # nothing left for the next run to clear


def test_bad_input_is_refused_by_name():
    for argv, message in [
        (["--network", "nope"], "unknown network 'nope'"),
        (["--workers", "0"], "must be positive"),
        (["--rate-mbit", "0"], "must be positive"),
    ]:
        done = _run(*argv)
        assert done.returncode == 2, (argv, done.stderr)
        assert message in done.stderr, (argv, done.stderr)
