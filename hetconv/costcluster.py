"""A simulated cluster for the cost model (:mod:`hetconv.costmodel`): its devices, their
links, the network that joins them and what the transport costs beyond bandwidth.

Convolution time of a node is its kernels' FLOPs over its throughput: forward 2·N·Ho·Wo·k·C·kh·kw,
the kernel gradient as much again and the input gradient (when the layer needs it) as much again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from hetconv.formats import FLOAT32, TensorFormat
from hetconv.workload import ConvLayer

WIFI, SWITCHED = "wifi", "switched"
FABRICS = (WIFI, SWITCHED)

MBIT = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass(frozen=True)
class WireCosts:
    """Costs of the transport beyond the link's bandwidth and round trip.

    Args:
        bundle_call_s: fixed cost of a bundled (one message each way) call: gRPC, protobuf and
            Python on both ends. Measured ~0.6-0.9 ms on loopback (benchmarks/transport.py).
        stream_call_s: the same for a streamed call; measured ~2-3 ms on loopback.
        software_bytes_per_s: how many tensor bytes per second the master's side of the wire
            moves at most, all calls together (copies, (de)serialisation): streaming ran at ~0.3
            of raw TCP's 2.3-3 GB/s on loopback (``benchmarks/transport.py`` measures both).
            Caps the master's link.
        sum_bytes_per_s: bytes of input-gradient parts per second the master adds up
            (``dx += part``, memory bound): ~5 GB/s measured here for 32 MB arrays.
        compute_stall: the fraction of its rate a streamed transfer loses while the master
            computes its own share. A streamed call needs the master's Python to start and for
            every chunk, so a master whose GEMMs hold the GIL stalls it: with hetconv's cpu
            backend on scipy's f2py ``sgemm`` (which holds the GIL) real runs over tc-shaped
            links measured 0.33-0.57. The cpu backend now calls the same sgemm through ctypes,
            which releases the GIL, and the same runs fit 0 within 1.7 % (paper-50-500, batch
            8 and 32, 20-1000 Mbit/s; ``python -m hetconv.simulations.validate``). Set it for a
            master whose convolutions hold the GIL.
        format: the wire format of activations and their gradients (``hetconv train
            --wire-format``): float32, or a 16-bit one that halves their bytes; kernels always
            travel as float32 (:func:`~hetconv.workload.call_bytes` counts both).
    """

    bundle_call_s: float = 0.75e-3
    stream_call_s: float = 2.5e-3
    software_bytes_per_s: float = 0.75e9
    sum_bytes_per_s: float = 5e9
    compute_stall: float = 0.0
    format: TensorFormat = FLOAT32

    def __post_init__(self) -> None:
        if not 0.0 <= self.compute_stall <= 1.0:
            raise ValueError(f"compute stall must be in [0, 1], got {self.compute_stall}")

    def call_s(self, bundled: bool) -> float:
        return self.bundle_call_s if bundled else self.stream_call_s


@dataclass(frozen=True)
class SimNode:
    """A device in a simulated cluster.

    Args:
        name: for tables.
        gflops: convolution throughput (forward and both gradients), GFLOP/s.
        layer_gflops: per layer name, a throughput that replaces ``gflops`` for that layer
            (a first layer with 3 input channels runs far below a deep one, for instance).
        bytes_per_s: the node's own link, each direction (a worker's Wi-Fi rate, a switch port).
        rtt_s: round trip between it and the master.
    """

    name: str
    gflops: float
    layer_gflops: Mapping[str, float] = field(default_factory=dict)
    bytes_per_s: float = math.inf
    rtt_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.gflops > 0:
            raise ValueError(f"device {self.name}: gflops must be positive, got {self.gflops}")
        for layer, value in self.layer_gflops.items():
            if not value > 0:
                raise ValueError(f"device {self.name}: {layer} gflops must be positive")
        if not self.bytes_per_s > 0:
            raise ValueError(f"device {self.name}: link must be positive, got {self.bytes_per_s}")
        if not self.rtt_s >= 0:
            raise ValueError(f"device {self.name}: latency must be >= 0, got {self.rtt_s}")

    def throughput(self, layer: str) -> float:
        """FLOP/s on ``layer``."""
        return 1e9 * self.layer_gflops.get(layer, self.gflops)

    def conv_seconds(self, layer: ConvLayer, kernels: int, passes: int) -> float:
        """Seconds to run ``passes`` convolutions of forward's size for ``kernels`` kernels."""
        return kernels * passes * layer.flops_per_kernel / self.throughput(layer.name)

    def probe_seconds(self, layer: ConvLayer) -> float:
        """What the probe of the reference method would time: forward + backward, all kernels."""
        return self.conv_seconds(layer, layer.kernels, layer.step_passes)


@dataclass(frozen=True)
class SimCluster:
    """A master and its workers on one network.

    Args:
        master: the master's device; ``master.bytes_per_s`` is its switch port (switched) or is
            ignored (Wi-Fi, where ``medium_bytes_per_s`` counts).
        workers: in order; each with its own link.
        fabric: ``"switched"`` (full duplex, a port per node: requests share the master's
            upstream, answers its downstream) or ``"wifi"`` (one shared half-duplex medium: every
            transfer, both directions, shares its capacity).
        medium_bytes_per_s: the Wi-Fi medium's capacity, end to end between two nodes.
        master_compute: whether the master computes a share itself.
        wire: per-call and software costs.
    """

    master: SimNode
    workers: tuple[SimNode, ...]
    fabric: str = SWITCHED
    medium_bytes_per_s: float = math.inf
    master_compute: bool = True
    wire: WireCosts = field(default_factory=WireCosts)

    def __post_init__(self) -> None:
        if self.fabric not in FABRICS:
            raise ValueError(f"network {self.fabric!r} is not one of {', '.join(FABRICS)}")
        if not self.workers and not self.master_compute:
            raise ValueError("no workers and the master does not compute: nothing would")

    @property
    def nodes(self) -> tuple[SimNode, ...]:
        return (self.master, *self.workers)

    def shared_bytes_per_s(self) -> tuple[float, float]:
        """(upstream, downstream) capacity that every transfer to / from the master shares.

        On Wi-Fi both are the one medium (and :func:`~hetconv.costphase.simulate_phase` lets
        both directions share it); on a switched network they are the master's port. Either is
        capped by what the master's software moves (:attr:`WireCosts.software_bytes_per_s`).
        """
        link = self.medium_bytes_per_s if self.fabric == WIFI else self.master.bytes_per_s
        cap = min(link, self.wire.software_bytes_per_s)
        return cap, cap


__all__ = ["FABRICS", "MBIT", "SWITCHED", "WIFI", "SimCluster", "SimNode", "WireCosts"]
