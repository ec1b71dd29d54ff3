"""A split head: the network's final fully connected layer computed by the kernel slices.

When the last fused stage's output feeds the final ``fc`` directly (the reference networks:
conv2, ReLU, LRN, max-pool, then fc to the classes), the fc's output is a sum over the stage's
channels::

    z[n, j] = sum_c sum_p y[n, c, p] * W[j, c * P + p]        (P = Ho' * Wo', NCHW flattened)

so the node that owns channels ``c`` of the stage can compute their part of the logits itself,
from the fc's columns of those channels, and answer ``N x classes`` values instead of its pooled
maps (``N x k x P``). Backward is as local: the logits' gradient ``dz`` (``N x classes``) gives
the stage-output gradient of any channel from its columns, and the columns' gradient from the
channel's outputs. With resident kernels (:mod:`hetconv.master.resident`) each worker keeps
its channels' columns beside its kernel slice and updates both with the same elementwise SGD
rule, so per step and worker the link carries the logits and their gradient, and the columns
of the halo and edge channels (the stage's LRN reads ``size - 1`` neighbours on each side),
instead of the pooled maps both ways.

The columns travel as ``(channels, P, classes)``: :func:`head_columns` is that view of the
fc's ``(classes, C * P)`` weight, so writing a slice of it writes the model's weight. The
fc's bias stays with the master, which adds it once to the summed parts.

The functions take numpy arrays or a device backend's (cupy on a cuda worker: the slice's
columns stay on its GPU) alike.

.. note:: The logits are a sum of per-node parts (and the master's own), not one GEMM over
   every channel, so they differ from local training's by float32 round-off; the columns'
   gradients are the same per-element sums over the batch as the fc's own.
"""

from __future__ import annotations

import numpy as np

SPLIT, MASTER, AUTO = "split", "master", "auto"
#: ``hetconv train --head``: the final fc computed by the kernel slices, on the master alone,
#: or split wherever the last stage is resident and feeds the fc directly.
HEAD_MODES = (SPLIT, MASTER, AUTO)


def head_columns(weight: np.ndarray, channels: int) -> np.ndarray:
    """The fc ``weight`` (classes, C * P) as a (C, P, classes) view: row ``c`` holds the
    columns of stage channel ``c``.

    Raises:
        ValueError: ``weight`` is not 2-D, or its features are not a multiple of ``channels``.
    """
    if weight.ndim != 2 or channels < 1 or weight.shape[1] % channels:
        raise ValueError(
            f"fc weight of shape {weight.shape} does not split into {channels} channels"
        )
    classes, features = weight.shape
    return weight.reshape(classes, channels, features // channels).transpose(1, 2, 0)


def _flat(f: np.ndarray) -> np.ndarray:
    k, positions, classes = f.shape
    return f.reshape(k * positions, classes)


def partial_logits(y: np.ndarray, f: np.ndarray) -> np.ndarray:
    """The part of the logits that channels ``y`` (N, k, Ho', Wo') give through their fc
    columns ``f`` (k, P, classes): float32 (N, classes), no bias."""
    return y.reshape(y.shape[0], -1) @ _flat(f)


def stage_grad(dz: np.ndarray, f: np.ndarray, out_hw: tuple[int, int]) -> np.ndarray:
    """The stage-output gradient (N, g, Ho', Wo') of channels whose columns are ``f``
    (g, P, classes), from the logits' gradient ``dz`` (N, classes)."""
    return (dz @ _flat(f).T).reshape(dz.shape[0], f.shape[0], *out_hw)


def columns_grad(dz: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The gradient of the fc columns (k, P, classes) of channels ``y`` (N, k, Ho', Wo')."""
    n, k = y.shape[:2]
    return (y.reshape(n, -1).T @ dz).reshape(k, -1, dz.shape[1])


__all__ = [
    "AUTO",
    "HEAD_MODES",
    "MASTER",
    "SPLIT",
    "columns_grad",
    "head_columns",
    "partial_logits",
    "stage_grad",
]
