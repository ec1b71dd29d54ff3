"""HETCONV_SUM_LOG (hetconv/worker/sumlog.py) and benchmarks/sum_waits.py: real ring sums among
worker services write their timings, and the script splits their waits; bad input is named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import sum_waits  # noqa: E402


def test_sums_among_three_ranks_are_logged_and_split(tmp_path):
    folder = tmp_path / "sums"
    env = {**os.environ, "HETCONV_SUM_LOG": str(folder)}
    command = [sys.executable, str(BENCHMARKS / "sum_port.py"), "--ranks", "3", "--sums", "6",
               "--rounds", "1"]  # fmt: skip
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=120)
    lines = [line for path in folder.glob("*.txt") for line in path.read_text().splitlines()]
    assert {line[0] for line in lines} == {"S", "F"}
    out = tmp_path / "rows.json"
    assert sum_waits.main([str(folder), "--skip", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["half"] for r in rows] == ["first", "second"]
    for r in rows:
        assert r["ranks"] == 3 and r["sums"] > 0
        assert 0 <= r["late_ms"] <= r["wait_ms"] and r["last_own_ms"] >= 0


def test_nothing_is_written_without_the_variable(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HETCONV_SUM_LOG"}
    code = "from hetconv.worker import sumlog; sumlog.summed(1, 2, 3, 0, 0.0, 1.0); " \
           "print(sumlog.enabled())"  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert done.stdout.strip() == "False" and not list(tmp_path.iterdir())


def test_bad_input_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit, match="is not a folder"):
        sum_waits.main([str(tmp_path / "none")])
    with pytest.raises(SystemExit, match="no sum that every rank took"):
        sum_waits.main([str(tmp_path)])
    (tmp_path / "1.txt").write_text("S 1 2 x\n")
    with pytest.raises(SystemExit, match=r"1.txt:1: not a sum log line"):
        sum_waits.main([str(tmp_path)])
    with pytest.raises(SystemExit, match="--skip must be >= 0"):
        sum_waits.main([str(tmp_path), "--skip", "-1"])
