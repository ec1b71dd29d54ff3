"""``--engine auto`` (``hetconv train``'s default, the testbed's) and ``hetconv worker --backend
auto``: oneDNN where its library loads, else the cpu engine, the console saying which and why.

The library's unavailable case is made here as the onednn backend's tests make it: the library
path (``$HETCONV_ONEDNN_LIB``) pointing at a missing file, the process's loaded library
forgotten (or, for a command, a child process).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hetconv import backends
from hetconv.backends import onednn_library
from hetconv.backends.onednn import ENV_LIBRARY

pytestmark = pytest.mark.skipif(
    not (platform.system() == "Linux" and platform.machine() == "x86_64"),
    reason="oneDNN's wheel (onednn-cpu-gomp) is built for Linux x86-64 only",
)
ROOT = Path(__file__).resolve().parents[1]
TINY_RUN = ["--steps", "2", "--batch", "4", "--train-size", "8", "--eval-size", "0"]
NO_GPU = {"cpu": "", "onednn": "", "opencl": "no GPU here", "cuda": "no GPU here"}


@pytest.fixture
def no_library(monkeypatch, tmp_path):
    """oneDNN's library cannot be loaded in this process (until the test ends)."""
    monkeypatch.setenv(ENV_LIBRARY, str(tmp_path / "libdnnl.so.3"))
    monkeypatch.setattr(onednn_library, "_library", None)
    monkeypatch.setattr(onednn_library, "_library_error", None)


def test_auto_is_onednn_where_its_library_loads():
    engine, says = backends.resolve_engine("auto")
    assert engine == "onednn"
    assert says.startswith("engine onednn (auto: oneDNN 3.") and "--engine cpu" in says, says
    assert backends.resolve_engine("cpu") == ("cpu", None)
    assert backends.resolve_engine("onednn") == ("onednn", None)


def test_auto_is_cpu_where_the_library_cannot_load(no_library):
    engine, says = backends.resolve_engine("auto")
    assert engine == "cpu"
    assert says.startswith("engine cpu, the numpy engine (auto: oneDNN library libdnnl.so.3 ")
    assert "cannot be loaded" in says and "\n" not in says


def test_worker_auto_without_a_gpu_is_the_cpu_engine(monkeypatch):
    monkeypatch.setattr(backends, "available_backends", lambda: dict(NO_GPU))
    assert backends.get_backend("auto").name == "onednn"


def test_worker_auto_without_a_gpu_or_the_library_is_cpu(monkeypatch, no_library):
    monkeypatch.setattr(backends, "available_backends", lambda: dict(NO_GPU, onednn="absent"))
    assert backends.get_backend("auto").name == "cpu"


def _train(tmp_path, name: str, *flags: str, env=None) -> tuple[dict, str]:
    """A tiny ``hetconv train --local`` in a child process: its model and its stderr."""
    argv = [sys.executable, "-m", "hetconv", "train", "--local", *TINY_RUN, "--no-progress"]
    argv += ["--run-dir", str(tmp_path), "--name", name, *flags]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return dict(np.load(tmp_path / name / "model.npz")), done.stderr


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_train_by_default_says_and_trains_with_onednn(tmp_path):
    auto, said = _train(tmp_path, "auto")
    assert "engine onednn (auto: oneDNN 3." in said, said
    onednn, said = _train(tmp_path, "onednn", "--engine", "onednn")
    assert "engine onednn (auto" not in said  # a named engine needs no word
    _same(auto, onednn)


def test_train_by_default_without_the_library_says_and_trains_with_cpu(tmp_path):
    env = dict(os.environ, **{ENV_LIBRARY: str(tmp_path / "missing" / "libdnnl.so.3")})
    auto, said = _train(tmp_path, "auto", env=env)
    lines = [line for line in said.splitlines() if line.startswith("engine ")]
    assert len(lines) == 1 and lines[0].startswith("engine cpu, the numpy engine (auto: "), said
    _same(auto, _train(tmp_path, "cpu", "--engine", "cpu")[0])


def test_the_testbeds_engine_flag_names_what_auto_chose():
    spec = importlib.util.spec_from_file_location("testbed_engine", ROOT / "benchmarks/testbed.py")
    testbed = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = testbed  # its dataclasses look their module up
    spec.loader.exec_module(testbed)
    p = argparse.ArgumentParser()
    testbed.add_engine_flag(p)
    assert p.parse_args([]).engine == "onednn"
    assert p.parse_args(["--engine", "auto"]).engine == "onednn"
    assert p.parse_args(["--engine", "cpu"]).engine == "cpu"
    with pytest.raises(SystemExit):
        p.parse_args(["--engine", "mkl"])
