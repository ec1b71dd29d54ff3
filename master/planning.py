"""How each layer's kernels are split over the nodes: the shares, from probes and links.

One rule says which nodes may compute (:func:`usable`): active ones, and the master only when
it computes. Over those, the ``compute`` policy gives kernels in proportion to 1 / probe time
(the paper's rule) and the ``link`` policy minimises the predicted layer time, transfers
included (both in :mod:`hetconv.balance`). A fixed split from the configuration overrides both
while every worker named at start is active.

A *deterministic* planner (``hetconv train --deterministic``) never reads a timing: it splits
every layer equally over the usable nodes in node order (master first; the remainder of the
division goes to the earliest nodes), so two runs over the same nodes get the same shares
whatever their probes measured. Probes still run: they set each call's deadline, not the split.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from hetconv import balance, costmodel
from hetconv.backends import ConvShape, Padding, PaddingSpec
from hetconv.balance import kernel_shares, offsets
from hetconv.stages import UNFUSED, StageSpec
from hetconv.workload import ConvLayer

from .membership import ACTIVE, Node
from .replica import block_seconds

COMPUTE_POLICY, LINK_POLICY = "compute", "link"
SHARE_POLICIES = (COMPUTE_POLICY, LINK_POLICY)
NETWORKS = ("switched", "wifi")  # the simulator's fabrics (hetconv.costmodel.FABRICS)
AUTO_NETWORK = "auto"  # measured at connect (:func:`.probing.measure_medium`)


@dataclass(frozen=True)
class PlannedLayer:
    """A convolutional layer as the cluster plans it: its real shape at the step's batch."""

    name: str
    shape: ConvShape
    need_input_grad: bool
    stage: StageSpec | None = None  # the channel-local layers after it (hetconv.stages)
    images_fit: bool = True  # its images fit palette8 (hetconv.conv.ConvSpec.images_fit)
    label: str = ""  # the layer as written, for the console (.probing.layer_label)

    def modelled(self, head: int = 0) -> ConvLayer:
        """The layer as the cost model counts it; ``head``: the classes of a split head its
        stage computes (0: none)."""
        return ConvLayer(
            self.name, self.shape, self.need_input_grad, self.stage, head, self.images_fit
        )


@dataclass(frozen=True)
class LayerPlan:
    """How one layer's kernels are split: ``shares[i]`` kernels from ``starts[i]`` on node i."""

    shape: ConvShape
    shares: tuple[int, ...]
    starts: tuple[int, ...]

    @classmethod
    def of(cls, shape: ConvShape, shares: Sequence[int]) -> LayerPlan:
        return cls(shape, tuple(shares), tuple(offsets(shares)))


def usable(node: Node, master_compute: bool) -> bool:
    """Whether ``node`` may get kernels: it is active, and it is a worker or the master
    computes."""
    return node.state == ACTIVE and (node.client is not None or master_compute)


def check_shares(layer: str, kernels: int, shares, nodes: int, master_compute: bool) -> list[int]:
    """``shares`` as ints if they are a valid split of ``kernels`` over ``nodes`` nodes (master
    first); ValueError naming what is wrong otherwise."""
    shares = [int(s) for s in shares]
    if len(shares) != nodes or min(shares) < 0 or sum(shares) != kernels:
        raise ValueError(
            f"shares {shares} for {layer} must be {nodes} non-negative counts "
            f"(master first) summing to its {kernels} kernels"
        )
    if shares[0] and not master_compute:
        raise ValueError(
            f"shares {shares} for {layer} give the master kernels, but master compute is off"
        )
    return shares


@dataclass(frozen=True)
class Planner:
    """Plans the shares of every layer over the nodes.

    Args:
        master_compute: whether the master computes a share itself.
        policy: ``"compute"`` or ``"link"``.
        network: what ``"link"`` assumes: ``"switched"`` or ``"wifi"`` (one shared medium).
        capacity: bytes/s the master's port (switched) or the medium (Wi-Fi) carries for all
            workers together, as measured; None: as fast as the fastest worker's link.
        fixed: layer name -> kernels per node, used while ``everyone_active`` holds.
        deterministic: split equally over the usable nodes instead of by speed (no timing
            decides a share; the ``compute`` policy only).
        stages: as ``hetconv train --stages``: the ``link`` policy plans a layer with a stage
            as fused unless ``"unfused"`` (its maps travel pooled; each worker computes a halo).
        resident: layers whose kernels stay on the workers (the ``link`` policy counts no
            kernel bytes for them).
        replicas: layer name -> the replicated first block whose output is its input
            (:mod:`hetconv.replica`); the block itself is the master's alone.
        overlap: fused layer name -> images per group of its overlapped calls
            (:mod:`hetconv.overlap`; the ``link`` policy counts maps moving beside the compute).
        heads: resident layer name -> the classes of the final fc it computes on the nodes
            (:mod:`hetconv.head`; the ``link`` policy counts logits, not maps, travelling).
        block_cost: replicated block name -> how many times its convolution's probe the whole
            block costs a node (its ReLU, LRN and pooling at full resolution too,
            :func:`~.replica.block_cost_factor`); 1 where not named.
        split_blocks: the workers split the replicated blocks by images (:mod:`hetconv.split`):
            the ``link`` policy counts each worker's share of the block's images, and the
            exchange of its outputs and gradients on the worker's link, instead of the block.
        split_master: the master is one of the split's peers (``split_all``): the same for
            its share of the images and its link.
        master_images: with ``split_master``, the master computes the block on its share of
            the images (False: on none, ``--master-block none``; its link still exchanges).
    """

    master_compute: bool
    policy: str = COMPUTE_POLICY
    network: str = "switched"
    capacity: float | None = None
    fixed: Mapping[str, tuple[int, ...]] | None = None
    deterministic: bool = False
    stages: str = UNFUSED
    resident: frozenset[str] = frozenset()
    replicas: Mapping[str, str] = field(default_factory=dict)
    overlap: Mapping[str, int] = field(default_factory=dict)
    heads: Mapping[str, int] = field(default_factory=dict)
    block_cost: Mapping[str, float] = field(default_factory=dict)
    split_blocks: bool = False
    split_master: bool = False
    master_images: bool = True

    def __post_init__(self) -> None:
        if self.network not in NETWORKS:
            raise ValueError(f"network {self.network!r} is not one of {', '.join(NETWORKS)}")
        if self.policy not in SHARE_POLICIES:
            raise ValueError(
                f"share policy {self.policy!r} is not one of {', '.join(SHARE_POLICIES)}"
            )
        if self.deterministic and self.policy != COMPUTE_POLICY:
            raise ValueError(
                f"a deterministic split is equal over the nodes: the {self.policy!r} share "
                "policy, which reads measured links, cannot be deterministic"
            )

    def _seconds(self, node: Node, layer: str) -> float:
        """The figure ``node`` is split by on ``layer``: its probe, or 1 for every node when
        deterministic (an equal split)."""
        return 1.0 if self.deterministic else node.probe_seconds.get(layer, 1.0)

    def plan(
        self, nodes: Sequence[Node], layers: Sequence[PlannedLayer], everyone_active: bool
    ) -> dict[str, LayerPlan]:
        """Shares of every layer over the usable nodes."""
        plans = {}
        blocks = set(self.replicas.values())
        for layer in layers:
            if layer.name in blocks:  # every node computes it; the master's share is all
                plans[layer.name] = LayerPlan.of(
                    layer.shape, [layer.shape.k] + [0] * (len(nodes) - 1)
                )
                continue
            override = (self.fixed or {}).get(layer.name)
            if override is not None and everyone_active and len(override) == len(nodes):
                plans[layer.name] = LayerPlan.of(layer.shape, override)
                continue
            seconds = [
                self._seconds(node, layer.name) if usable(node, self.master_compute) else np.inf
                for node in nodes
            ]
            if all(np.isinf(seconds)):
                # No worker left and the master was told not to compute: it must, or
                # nothing would.
                seconds[0] = self._seconds(nodes[0], layer.name)
            shares = kernel_shares(layer.shape.k, seconds)
            if self.policy == LINK_POLICY:
                block = next((b for b in layers if b.name == self.replicas.get(layer.name)), None)
                shares = self._link_aware(nodes, layer, seconds, shares, block)
            plans[layer.name] = LayerPlan.of(layer.shape, shares)
        return plans

    def plan_unseen(self, nodes: Sequence[Node], x_shape, w_shape, padding: PaddingSpec):
        """A layer the probe did not see: split by the nodes' mean speed on the others (equally
        over the usable nodes when deterministic)."""
        speeds = []
        for node in nodes:
            times = list(node.probe_seconds.values())
            if self.deterministic:
                speeds.append(1.0 if usable(node, self.master_compute) else float("inf"))
                continue
            ok = times and usable(node, self.master_compute)
            speeds.append(float(np.mean(times)) if ok else float("inf"))
        if all(np.isinf(speeds)):
            speeds[0] = 1.0
        k = w_shape[0]
        n, c, h, w = x_shape
        shape = ConvShape(
            n, c, h, w, k, w_shape[2], w_shape[3], Padding.resolve(padding, w_shape[2:])
        )
        return LayerPlan.of(shape, kernel_shares(k, speeds))

    def _image_fractions(self, nodes, workers: list[int], layer: str) -> dict[int, float]:
        """Node index -> its fraction of a split block's images (the master's too with
        :attr:`split_master`); empty when not split."""
        peers = [0, *workers] if self.split_master else list(workers)
        if not self.split_blocks or len(peers) < 2:
            return {}
        if self.split_master and not self.master_images:  # the master computes none
            probes = [nodes[i].probe_seconds.get(layer, 0.0) for i in workers]
            return {0: 0.0, **dict(zip(workers, image_fractions(probes), strict=True))}
        probes = [nodes[i].probe_seconds.get(layer, 0.0) for i in peers]
        return dict(zip(peers, image_fractions(probes), strict=True))

    def _link_aware(
        self,
        nodes,
        layer: PlannedLayer,
        seconds: list[float],
        fallback: list[int],
        block: PlannedLayer | None = None,
    ):
        """The link-aware split of ``layer`` over the nodes whose ``seconds`` are finite (the
        usable ones), from their probes and measured links; ``fallback`` (the compute shares)
        when the master alone is usable or no worker is worth its link."""
        usable_nodes = [i for i, t in enumerate(seconds) if np.isfinite(t)]
        workers = [i for i in usable_nodes if i > 0]
        if not workers:
            return fallback
        fused = self.stages != UNFUSED and layer.stage is not None
        modelled = layer.modelled(self.heads.get(layer.name, 0))
        flops = modelled.step_passes * layer.shape.flops_forward
        fastest = max(nodes[j].link_bytes_per_second for j in workers)
        if self.capacity is not None:
            fastest = max(fastest, self.capacity)

        replica = None
        if block is not None and fused:
            replica = block.modelled()
        fractions = self._image_fractions(nodes, workers, layer.name) if replica else {}

        def model_node(i: int) -> costmodel.SimNode:
            node = nodes[i]
            gflops = flops / max(node.probe_seconds.get(layer.name, seconds[i]), 1e-9) / 1e9
            per_layer = {}
            if replica is not None and replica.name in node.probe_seconds:
                block_flops = replica.step_passes * replica.shape.flops_forward
                factor = self.block_cost.get(replica.name, 1)
                block_s = block_seconds(nodes[0], node, replica.name, layer.name, factor)
                if i in fractions:  # its images' share, and the exchange on its link
                    s = layer.shape
                    exchanged = 2 * (1 - fractions[i]) * 4 * s.n * s.c * s.h * s.w
                    block_s = block_s * fractions[i] + exchanged / node.link_bytes_per_second
                per_layer[replica.name] = block_flops / max(block_s, 1e-9) / 1e9
            if node.client is None:  # the master: its port is at least as fast as any link
                return costmodel.SimNode(node.name, gflops, per_layer, bytes_per_s=fastest)
            return costmodel.SimNode(
                node.name, gflops, per_layer, bytes_per_s=node.link_bytes_per_second,
                rtt_s=node.link_latency,
            )  # fmt: skip

        model = costmodel.SimCluster(
            master=model_node(0),
            workers=tuple(model_node(i) for i in workers),
            # On Wi-Fi every transfer, both ways, shares one medium: as fast as measured with
            # every worker at once, or as the fastest link measured alone.
            fabric=self.network,
            medium_bytes_per_s=fastest,
            master_compute=0 in usable_nodes,
        )
        resident = fused and layer.name in self.resident
        images = self.overlap.get(layer.name, 0) if fused else 0
        head = self.heads.get(layer.name, 0) if resident else 0
        split = balance.link_aware_shares(model, modelled, fused, resident, replica, images, head)
        if split[0] and not model.master_compute:  # it found no worker worth its link
            return fallback
        shares = [0] * len(nodes)
        for i, kernels in zip([0, *workers], split, strict=True):
            shares[i] = kernels
        return shares


def image_fractions(seconds: Sequence[float]) -> list[float]:
    """Each worker's fraction of a split block's images, by its ``seconds`` on the layer the
    block feeds (as :meth:`hetconv.master.cluster.Cluster` splits them: in proportion to
    speed)."""
    weights = [1.0 / t if t > 0 else 1.0 for t in seconds]
    if not all(t > 0 for t in seconds):
        weights = [1.0] * len(seconds)
    total = sum(weights)
    return [w / total for w in weights]


def step_model(
    nodes: Sequence[Node],
    layers: Sequence[PlannedLayer],
    network: str,
    capacity: float | None,
    master_compute: bool,
    wire: costmodel.WireCosts | None = None,
) -> costmodel.SimCluster:
    """The cost model's cluster of ``nodes`` (master first, as measured): each node's speed on
    each layer from its probe (forward and backward of all its kernels), each worker's measured
    link and latency; the master's port (switched) or the medium (``"wifi"``) at ``capacity``
    (None: the fastest link)."""
    modelled = [ly.modelled() for ly in layers]

    def speeds(node: Node) -> dict[str, float]:
        return {
            ly.name: ly.step_passes * ly.shape.flops_forward / node.probe_seconds[ly.name] / 1e9
            for ly in modelled
            if node.probe_seconds.get(ly.name, 0) > 0
        }

    links = [n.link_bytes_per_second for n in nodes[1:] if math.isfinite(n.link_bytes_per_second)]
    fastest = capacity or max(links, default=math.inf)
    made = []
    for i, node in enumerate(nodes):
        per_layer = speeds(node)
        gflops = float(np.median(list(per_layer.values()))) if per_layer else 1.0
        if i == 0:
            made.append(costmodel.SimNode(node.name, gflops, per_layer, bytes_per_s=fastest))
        else:
            made.append(
                costmodel.SimNode(
                    node.name,
                    gflops,
                    per_layer,
                    bytes_per_s=node.link_bytes_per_second,
                    rtt_s=node.link_latency,
                )  # fmt: skip
            )
    return costmodel.SimCluster(
        master=made[0],
        workers=tuple(made[1:]),
        fabric=network,
        medium_bytes_per_s=fastest,
        master_compute=master_compute,
        wire=wire or costmodel.WireCosts(),
    )


def shares_table(
    nodes: Sequence[Node],
    plans: Mapping[str, LayerPlan],
    master_compute: bool,
    deterministic: bool = False,
):
    """A table for the console: per node, its device, link, and per layer its probe time and
    kernels."""
    how = (
        "equal over the usable nodes (--deterministic; the probe sets deadlines only)"
        if deterministic
        else "probe: forward + backward of the layer's real shape"
    )
    lines = [f"kernel shares ({how}):"]
    for i, node in enumerate(nodes):
        link = (
            ""
            if node.client is None or not np.isfinite(node.link_bytes_per_second)  # not reached
            else f", link {node.link_bytes_per_second / 1e6:.0f} MB/s "
            f"rtt {1e3 * node.link_latency:.1f} ms"
        )
        state = "" if node.state == ACTIVE else f" [{node.state}]"
        parts = []
        for name, plan in plans.items():
            t = node.probe_seconds.get(name, float("inf"))
            off = node.client is None and not master_compute
            probe = "off" if off or t == float("inf") else f"{1e3 * t:.1f} ms"
            parts.append(f"{name} {plan.shares[i]}/{plan.shape.k} (probe {probe})")
        lines.append(f"  {node.name:<21} {node.description}{link}{state}")
        lines.append(f"  {'':<21} " + ", ".join(parts))
    return "\n".join(lines)


def plan_record(
    nodes: Sequence[Node],
    plans: Mapping[str, LayerPlan],
    master_compute: bool,
    deterministic: bool = False,
):
    """The plan as data, for the trace's first record: per node (master first) its device,
    probe seconds per layer (none for a master that computes nothing) and link, per layer the
    kernels of each node in the same order, and whether the split is deterministic."""

    def finite(value: float) -> float | None:
        return float(value) if np.isfinite(value) else None

    return {
        "nodes": [
            {
                "name": node.name,
                "description": node.description,
                "probe_seconds": {}
                if node.client is None and not master_compute
                else {k: float(v) for k, v in node.probe_seconds.items()},
                "link_bytes_per_second": None
                if node.client is None
                else finite(node.link_bytes_per_second),
                "link_latency_seconds": None if node.client is None else float(node.link_latency),
            }
            for node in nodes
        ],
        "shares": {name: [int(k) for k in plan.shares] for name, plan in plans.items()},
        "deterministic": bool(deterministic),
    }
