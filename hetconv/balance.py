"""Kernel shares: how many of a layer's kernels each device computes.

The reference method (DESIGN.md, "The method", item 2): every device runs a probe convolution of
the layer's real shape and reports its time ``t_i``; device ``i`` gets the fraction
``w_i = 1/t_i / sum_j 1/t_j`` of the kernels, so all finish at about the same time. Kernel
counts are integers: the largest-remainder rule rounds the quotas so they sum exactly to the
layer's kernel count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction


def kernel_shares(kernels: int, probe_seconds: Sequence[float]) -> list[int]:
    """Split ``kernels`` across devices in proportion to ``1 / probe_seconds``.

    Args:
        kernels: the layer's kernel (output-channel) count, >= 0.
        probe_seconds: each device's probe time for the whole layer; ``math.inf`` excludes a
            device (it gets 0). At least one must be finite.

    Returns:
        Non-negative integers, one per device, summing to ``kernels``. A device may get 0 (more
        devices than kernels, or too slow to earn one). Ties in the remainders go to the faster
        device, then to the earlier one, so the result is deterministic.
    """
    if kernels < 0:
        raise ValueError(f"kernel count must be >= 0, got {kernels}")
    if not probe_seconds:
        raise ValueError("no devices to share kernels between")
    for i, t in enumerate(probe_seconds):
        if not t > 0:  # also catches NaN
            raise ValueError(f"probe time of device {i} is {t}; it must be positive")
    # Exact rational arithmetic: no overflow for tiny times, and ties are real ties.
    speeds = [Fraction(0) if math.isinf(t) else 1 / Fraction(t) for t in probe_seconds]
    total = sum(speeds)
    if total == 0:
        raise ValueError("every device is excluded (infinite probe time)")
    quotas = [kernels * s / total for s in speeds]
    shares = [math.floor(q) for q in quotas]
    left = kernels - sum(shares)
    order = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - shares[i]), -speeds[i], i))
    for i in order[:left]:
        shares[i] += 1
    return shares


def offsets(shares: Sequence[int]) -> list[int]:
    """Where each device's slice starts: the running sum of the shares before it."""
    out, total = [], 0
    for share in shares:
        out.append(total)
        total += share
    return out
