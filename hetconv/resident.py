"""Resident kernels: what master and worker share (:mod:`hetconv.master.resident`).

A worker that holds its kernel slice between steps updates it itself; the fused stage's halo
kernels it needs each step come from its neighbours' *edge* kernels: the kernels of a slice
within the stage's halo width of either end, which every backward answer carries (updated).
"""

from __future__ import annotations

import numpy as np

from .optim import SGDConfig
from .proto import worker_pb2 as pb

RESIDENT, SENT, AUTO = "resident", "sent", "auto"
#: ``hetconv train --kernels``: kept on the workers, sent every step, or per layer by the cost
#: model.
KERNEL_MODES = (RESIDENT, SENT, AUTO)


def edge_rows(count: int, halo: int) -> np.ndarray:
    """The kernels of a ``count``-kernel slice within ``halo`` of either end, in order
    (offsets into the slice): all of them when ``count <= 2 * halo``."""
    if count <= 2 * halo:
        return np.arange(count)
    return np.concatenate([np.arange(halo), np.arange(count - halo, count)])


def edges(a, halo: int):
    """The rows of ``a`` (a slice's kernels, bias or head columns, numpy or on a device)
    that :func:`edge_rows` names, as a new array: its first and last ``halo`` rows, or all of
    them when it has at most ``2 * halo``. Slices, not an index array, so device arrays need
    nothing from the host."""
    count = a.shape[0]
    if count <= 2 * halo:
        return a.copy()
    ends = (a[:halo], a[count - halo :])
    out = a[: 2 * halo].copy()  # the shape and module of the answer, filled below
    out[:halo] = ends[0]
    out[halo:] = ends[1]
    return out


def sgd_config(ref: pb.ResidentSlice) -> SGDConfig:
    """The optimizer settings a PlaceKernels request carries.

    Raises:
        ValueError: a setting out of range (naming it).
    """
    return SGDConfig(lr=ref.lr, momentum=ref.momentum, weight_decay=ref.weight_decay)


def version_text(version: int) -> str:
    """A version as placement and updates since (``3.17``): placements count in the high
    32 bits (:func:`placement_version`)."""
    return f"{version >> 32}.{version & 0xFFFFFFFF}"


def placement_version(placement: int) -> int:
    """The version of a slice just placed, the ``placement``-th of its session."""
    return placement << 32


__all__ = [
    "AUTO",
    "KERNEL_MODES",
    "RESIDENT",
    "SENT",
    "edge_rows",
    "edges",
    "placement_version",
    "sgd_config",
    "version_text",
]
