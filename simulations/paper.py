"""The reference paper's own figures and formula, for running its scenarios as it ran them.

Two things the paper reports that a scenario can be held to:

* **Its non-convolutional share** ("comp"): on one CPU at batch 1024 the paper reports the
  layers other than the convolutions as about 25 % of a training step for the 50:500 network
  and 13 % for 500:1500 (:data:`PAPER_COMP_FRACTIONS`). ``hetconv simulate --comp paper`` takes
  the master's comp from these instead of hetconv's numpy time measured here
  (:func:`paper_comp_fraction`).
* **Its volume formula** (its Eq. 2): per training step and distributed layer, ``in² · inCh ·
  batch`` input values and ``k² · numK · inCh`` kernel values out, ``out² · numK · batch``
  output values back, as float64 (:func:`paper_step_bytes`). At the ~5 Mbit/s the paper
  measured over Wi-Fi, one 500:1500 step at batch 1024 is hours of transfer, which no reported
  speedup could survive: :func:`bandwidth_check` says what bandwidth the volume needs for a
  cluster to beat its master alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hetconv.costmodel import MBIT
from hetconv.workload import ConvLayer, network_layers

#: The non-convolutional share of a training step the paper reports on one CPU at batch 1024.
PAPER_COMP_FRACTIONS = {"paper-50-500": 0.25, "paper-500-1500": 0.13}

#: The paper's four networks; the two without a reported share are interpolated.
PAPER_NETWORKS = ("paper-50-500", "paper-150-800", "paper-300-1000", "paper-500-1500")

#: Bytes of one value on the paper's wire (it sent float64).
PAPER_VALUE_BYTES = 8


def _conv_flops_per_image(network: str) -> float:
    """FLOPs of one image's convolutions in a training step (forward and both gradients)."""
    return sum(
        layer.shape.flops_forward * layer.step_passes for layer in network_layers(network, 1)
    )


def paper_comp_fraction(network: str) -> float:
    """The non-convolutional share of a one-device step of ``network``, as the paper reports
    it (50:500, 500:1500) or interpolated between them (150:800, 300:1000).

    Interpolation: the ratio comp / convolutions is taken as a power of the network's
    convolution FLOPs through the two reported points (a straight line in log-log), since the
    non-convolutional layers grow with the network more slowly than its convolutions.

    Raises:
        ValueError: a network that is none of the paper's four.
    """
    if network in PAPER_COMP_FRACTIONS:
        return PAPER_COMP_FRACTIONS[network]
    if network not in PAPER_NETWORKS:
        raise ValueError(
            f"--comp paper: the paper reports no non-convolutional time for {network}; it has "
            f"{', '.join(PAPER_NETWORKS)} (use --comp scenario for others)"
        )
    (small, f_small), (large, f_large) = PAPER_COMP_FRACTIONS.items()
    x = math.log(_conv_flops_per_image(network))
    x0, x1 = math.log(_conv_flops_per_image(small)), math.log(_conv_flops_per_image(large))
    r0, r1 = math.log(f_small / (1 - f_small)), math.log(f_large / (1 - f_large))
    ratio = math.exp(r0 + (r1 - r0) * (x - x0) / (x1 - x0))
    return ratio / (1 + ratio)


def paper_step_bytes(layers: Sequence[ConvLayer]) -> int:
    """One training step's bytes by the paper's Eq. 2, in float64: per layer the input
    (``in² · inCh · batch``), the kernels (``k² · numK · inCh``) and the output
    (``out² · numK · batch``), once each, whatever the number of workers."""
    values = 0
    for layer in layers:
        s = layer.shape
        ho, wo = s.out_hw
        values += s.n * s.c * s.h * s.w + s.k * s.c * s.kh * s.kw + s.n * s.k * ho * wo
    return PAPER_VALUE_BYTES * values


@dataclass(frozen=True)
class BandwidthCheck:
    """Whether a bandwidth can carry the paper's volume in the time a step's breakdown leaves.

    ``budget_s`` is what a cluster's step may spend communicating and still beat the master
    alone: the master's local step less the cluster's convolutions (the paper's compute split)
    and comp. ``consistent_mbps`` is the bandwidth that moves ``paper_bytes`` in that time
    (``inf`` when the budget is gone: no bandwidth makes the cluster faster).
    """

    paper_bytes: int
    budget_s: float
    bandwidth_mbps: float

    @property
    def transfer_s(self) -> float:
        """The paper's volume at ``bandwidth_mbps``."""
        return self.paper_bytes / (MBIT * self.bandwidth_mbps)

    @property
    def consistent_mbps(self) -> float:
        if self.budget_s <= 0:
            return math.inf
        return self.paper_bytes / self.budget_s / MBIT

    @property
    def consistent(self) -> bool:
        return self.bandwidth_mbps >= self.consistent_mbps


def bandwidth_check(
    layers: Sequence[ConvLayer], local_s: float, conv_s: float, comp_s: float, bandwidth: float
) -> BandwidthCheck:
    """The paper's volume for ``layers`` against the time ``local_s - conv_s - comp_s`` a
    cluster's breakdown leaves for communication, at ``bandwidth`` Mbit/s."""
    return BandwidthCheck(paper_step_bytes(layers), local_s - conv_s - comp_s, bandwidth)


__all__ = [
    "PAPER_COMP_FRACTIONS",
    "PAPER_NETWORKS",
    "PAPER_VALUE_BYTES",
    "BandwidthCheck",
    "bandwidth_check",
    "paper_comp_fraction",
    "paper_step_bytes",
]
