"""Shared fixtures for the hetconv tests."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator: every test sees the same random numbers on every run."""
    return np.random.default_rng(20240611)
