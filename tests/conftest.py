"""Shared fixtures for the hetconv tests."""

from __future__ import annotations

import numpy as np
import pytest
from exactness import train_strong_lrn

from hetconv.conv import LocalConv
from hetconv.master.launch import LocalWorkers


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator: every test sees the same random numbers on every run."""
    return np.random.default_rng(20240611)


@pytest.fixture(autouse=True)
def _runs_under_the_test_folder(monkeypatch, tmp_path_factory):
    """`hetconv train` writes its run folder under ./runs unless told otherwise: in tests,
    under pytest's temporary folder (the variable reaches subprocesses too), never the checkout."""
    monkeypatch.setenv("HETCONV_RUN_DIR", str(tmp_path_factory.getbasetemp() / "runs"))


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The exactness run (:mod:`exactness`) trained locally, once per module: what every
    distributed mode is compared with, step by step. A module may define its own."""
    return train_strong_lrn(tmp_path_factory.mktemp("local"), "local", LocalConv())


@pytest.fixture(scope="module")
def workers():
    """Two local worker processes on loopback, shared by a module's tests (a
    :class:`~hetconv.master.launch.LocalWorkers`). A module may define its own."""
    with LocalWorkers(2) as started:
        yield started
