"""Shared fixtures for the hetconv tests."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator: every test sees the same random numbers on every run."""
    return np.random.default_rng(20240611)


@pytest.fixture(autouse=True)
def _runs_under_the_test_folder(monkeypatch, tmp_path_factory):
    """`hetconv train` writes its run folder under ./runs unless told otherwise: in tests,
    under pytest's temporary folder (the variable reaches subprocesses too), never the checkout."""
    monkeypatch.setenv("HETCONV_RUN_DIR", str(tmp_path_factory.getbasetemp() / "runs"))
