"""What makes a run the same run: the fingerprint a checkpoint records and a resume compares.

The fingerprint holds what decides the numbers (batch, seed, data, initial weights, model,
optimizer); the environment holds what should not matter but is worth naming when a resume
differs (versions, backend). A resume refuses a checkpoint whose fingerprint differs and says
which fields.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping

import numpy as np

from hetconv.data import ImageDataset
from hetconv.optim import SGDConfig


def _sha256(*arrays: np.ndarray) -> str:
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array).data)
    return digest.hexdigest()


def order_digest(order: np.ndarray) -> str:
    """SHA-256 of an epoch order's little-endian int64 bytes."""
    return _sha256(np.asarray(order, dtype="<i8"))


def run_fingerprint(
    *,
    preset: str,
    spec: list[dict],
    dataset: str,
    train_set: ImageDataset,
    batch: int,
    seed: int,
    sgd: SGDConfig,
    initial_weights: Mapping[str, np.ndarray],
    wire_format: str = "float32",
) -> dict:
    """What a run must share with the run that wrote a checkpoint to continue it (JSON-ready).

    ``preset`` is kept for messages only; the network is compared by its ``spec``. The
    training images and the initial weights (seed or ``--load``) are compared by digest.
    The length of the run (steps, epochs) and evaluation settings may change on resume.
    ``wire_format`` is the executor's format of activations on the wire: a 16-bit one rounds
    every activation, so a resume may not switch it (checkpoints written before it was recorded
    count as float32). Which workers and how many may change: that is round-off only.
    """
    return {
        "preset": preset,
        "spec": json.loads(json.dumps(spec)),
        "dataset": dataset,
        "train_size": len(train_set),
        "batch": batch,
        "seed": seed,
        "lr": sgd.lr,
        "momentum": sgd.momentum,
        "weight_decay": sgd.weight_decay,
        "wire_format": wire_format,
        "train_data_sha256": _sha256(train_set.images, train_set.labels),
        "initial_weights_sha256": _sha256(
            *(np.asarray(initial_weights[k], "<f4") for k in sorted(initial_weights))
        ),
    }


_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def compute_environment() -> dict:
    """What decides the last bits of the arithmetic on this machine: BLAS splits its work by
    thread count, and a different split rounds differently (float32 round-off, not a
    different computation). Informational: a resume elsewhere is allowed, and noted."""
    return {
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        **{name: os.environ.get(name) for name in _THREAD_VARIABLES},
    }


_SETTINGS = ("dataset", "train_size", "batch", "seed", "lr", "momentum", "weight_decay")
_DIGESTS = {
    "train_data_sha256": "training data",
    "initial_weights_sha256": "initial weights (--load)",
}


def fingerprint_differences(saved: Mapping, current: Mapping) -> list[str]:
    """Human-readable differences, e.g. ``["batch 8 there, 16 here"]``; empty if compatible.

    A differing digest is named only when no setting explains it (a different seed changes
    the synthetic data and the initial weights too).
    """
    differences = []
    if saved.get("spec") != current.get("spec"):
        differences.append(
            f"network differs (preset {saved.get('preset')!r} there, {current.get('preset')!r} "
            "here)"
        )
    for key in _SETTINGS:
        if saved.get(key) != current.get(key):
            differences.append(f"{key} {saved.get(key)!r} there, {current.get(key)!r} here")
    there, here = saved.get("wire_format", "float32"), current.get("wire_format", "float32")
    if there != here:
        differences.append(f"--wire-format {there} there, {here} here")
    if not differences:
        for key, what in _DIGESTS.items():
            if saved.get(key) != current.get(key):
                differences.append(f"{what} differ")
    return differences


# -- the archive ----------------------------------------------------------------------------
