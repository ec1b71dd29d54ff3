"""What a new user sees: the worker's startup and activity lines, --threads read back, probe
progress, rebalancing in words, real defaults in --help, and the README's Python API snippet
run against a real worker process."""

from __future__ import annotations

import argparse
import io
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hetconv.cli import build_parser
from hetconv.master.membership import MASTER, Node
from hetconv.master.probing import planned_layers, probe_every
from hetconv.master.rebalancing import DriftMonitor, drift_text
from hetconv.model import Model, load_spec

README = Path(__file__).resolve().parents[1] / "README.md"
HETCONV = str(Path(sys.executable).with_name("hetconv"))


# -- --help ------------------------------------------------------------------------------------


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


@pytest.mark.parametrize("command", ["train", "worker"])
def test_help_shows_real_defaults_never_none(command):
    text = " ".join(_subparsers()[command].format_help().split())  # lines joined
    for empty in ("default: None", "default: False", "default: []"):
        assert empty not in text


def test_defaults_written_into_help_text_are_the_real_ones():
    """Options whose default is computed later say it in words; the numbers must be true."""
    from hetconv.master.cluster import ClusterConfig
    from hetconv.master.spotcheck import SpotCheckConfig
    from hetconv.training import TrainConfig
    from hetconv.worker.service import WorkerConfig

    real = {
        ("train", "--train-size"): TrainConfig.train_size,
        ("train", "--rebalance-every"): ClusterConfig.rebalance_every,
        ("train", "--spot-check-every"): SpotCheckConfig().every,
        ("worker", "--max-calls"): WorkerConfig.max_calls,
        ("worker", "--idle-timeout"): WorkerConfig.idle_timeout,
    }
    parsers = _subparsers()
    for (command, option), value in real.items():
        action = next(a for a in parsers[command]._actions if option in a.option_strings)
        said = re.search(r"default (\d+(?:\.\d+)?)", action.help)
        assert said is not None, (option, action.help)
        assert float(said.group(1)) == value, (option, action.help, value)


# -- rebalancing in words ------------------------------------------------------------------------


def test_drift_says_which_way_and_against_what():
    assert drift_text("127.0.0.1:50052", 2.1) == (
        "127.0.0.1:50052 2.1x slower than its own baseline at the same share"
    )
    assert drift_text("w", 0.5) == "w 2.0x faster than its own baseline at the same share"


def test_drift_monitor_names_the_node_that_slowed_down():
    monitor = DriftMonitor(every=4, change=0.3)
    node = Node("10.0.0.7:50051", client=None, probe_seconds={"conv1": 0.01})

    def step(seconds: float) -> None:
        phases = {"forward": {"compute_seconds": seconds}, "backward": {"compute_seconds": 0}}
        monitor.observe({node.name: {"conv1": phases}}, any_failed=False)

    for _ in range(5):  # the first is left out (warming up), then the baseline
        step(0.010)
    assert monitor.drifted([node]) == ""
    for _ in range(4):
        step(0.025)
    assert monitor.drifted([node]) == (
        "10.0.0.7:50051 2.5x slower than its own baseline at the same share"
    )
    assert node.probe_seconds["conv1"] == pytest.approx(0.025)


# -- probing progress ----------------------------------------------------------------------------


def test_probing_prints_a_line_per_node_and_layer_as_it_goes():
    from hetconv.backends import get_backend

    layers = planned_layers(Model(load_spec("tiny")).conv_specs(), batch=4)
    nodes = [Node(MASTER, None), Node("absent:1", None, state="lost")]
    log = io.StringIO()
    probe_every(nodes, layers, get_backend("cpu"), repeats=1, log=log)
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("probing 1 node on 2 layers")
    assert re.fullmatch(r"  \[1/2\] conv1 \(3->8 channels, 5x5, 32x32, batch 4\) on master: "
                        r"[\d.]+ ms", lines[1]), lines[1]  # fmt: skip
    assert lines[2].startswith("  [2/2] conv2 ")
    assert len(lines) == 3  # a node not reached is probed when it comes
    assert set(nodes[0].probe_seconds) == {"conv1", "conv2"} and not nodes[1].probe_seconds


# -- a real worker: startup lines, --threads, activity; the README snippet against it ------------


class _Output:
    def __init__(self, process: subprocess.Popen):
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process):
        for line in process.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
            found = re.search(pattern, line)
            if found:
                return found
        raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines))


def _readme_python_api() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def worker():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("HETCONV_TOKEN", None)
    process = subprocess.Popen(
        [HETCONV, "worker", "--listen", "127.0.0.1:0", "--backend", "cpu", "--threads", "1",
         "--no-startup-probe", "--report-every", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        env=env,
    )  # fmt: skip
    try:
        yield process, _Output(process)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


@pytest.mark.slow
def test_worker_lines_threads_activity_and_the_readme_snippet(worker):
    process, out = worker
    threads = out.wait_for(r"^threads: (.*) \(--threads 1\)$", 60).group(1)
    counts = re.findall(r"(\w+) (\d+)", threads)
    assert counts and all(n == "1" for _, n in counts), threads  # read back from the libraries
    masters = out.wait_for(r"^masters use: (.*)$", 60).group(1)
    assert "(lo, this machine only)" in masters
    out.wait_for(r"not advertised on the LAN: it listens on loopback only", 5)
    address = out.wait_for(r"^hetconv worker ready on (127\.0\.0\.1:\d+)$", 10).group(1)
    assert masters.startswith(address)

    snippet = _readme_python_api()
    assert "WORKERS = [" in snippet
    snippet = re.sub(r"^WORKERS = .*$", f"WORKERS = [{address!r}]", snippet, flags=re.M)
    printed = io.StringIO()
    exec(compile(snippet, "README.md (Python API)", "exec"), {"print": _to(printed)})
    assert re.fullmatch(
        r"loss [\d.]+ -> [\d.]+, held-out accuracy [\d.]+, \d+ images/s\n", printed.getvalue()
    ), printed.getvalue()

    # One line per second with requests in it: the first may hold only the connect (no
    # tensors), so read lines until one carried tensors both ways; all must count requests.
    pattern = (
        r"^served (\d+) requests in \d+ s: ([\d.]+) [kM]B in, ([\d.]+) [kM]B out, "
        r"(\d+) masters?$"
    )
    while True:
        served = out.wait_for(pattern, 10)
        assert int(served.group(1)) > 0, served.group(0)
        if float(served.group(2)) > 0 and float(served.group(3)) > 0:
            break
    assert int(served.group(4)) > 0, served.group(0)
    process.send_signal(signal.SIGTERM)
    out.wait_for(r"stopped after \d+ requests", 30)
    assert process.wait(30) == 0


def _to(stream: io.StringIO):
    def printer(*args, **kwargs):
        kwargs.setdefault("file", stream)
        print(*args, **kwargs)

    return printer


def test_worker_without_threads_reports_what_the_libraries_run():
    """Without --threads the line reads the libraries' own default (one per core unless the
    environment says otherwise): the same counts a fresh process reads back."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    env.pop("HETCONV_TOKEN", None)
    fresh = subprocess.run(
        [sys.executable, "-I", "-c", "import numpy, scipy.linalg, threadpoolctl; "
         "print(sorted({p['num_threads'] for p in threadpoolctl.threadpool_info()}))"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    process = subprocess.Popen(
        [HETCONV, "worker", "--listen", "127.0.0.1:0", "--backend", "cpu", "--no-startup-probe"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        env=dict(env, PYTHONUNBUFFERED="1"),
    )  # fmt: skip
    try:
        out = _Output(process)
        line = out.wait_for(r"^threads: (.*) \(the default; --threads N to change\)$", 60)
        counts = sorted({int(n) for n in re.findall(r"\w+ (\d+)", line.group(1))})
        assert str(counts) == fresh.stdout.strip(), (line.group(0), fresh.stdout)
        out.wait_for(r"^hetconv worker ready on", 30)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
