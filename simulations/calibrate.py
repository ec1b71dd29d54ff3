"""Calibrate a simulated cluster from the trace of a real run (``hetconv train --trace``).

From the step records (:func:`~.trace.read_trace`: records without ``"step"``, such as the plan
record where a run starts, are skipped; the first step, which warms caches and connections, is
left out when there are more):

* **Which network** ran: the one the plan record names (its ``model``: a preset, or a spec's
  file, or where that file is gone the spec the record holds), else the preset whose conv
  layers have the trace's names and kernel counts (or the network given); either way its calls,
  computed by :func:`~hetconv.workload.call_bytes`, must move exactly the bytes the trace
  recorded.
* **Throughput** of every node on every layer: the FLOPs of its share (forward, kernel gradient,
  input gradient where the layer needs it) over the ``compute_seconds`` it reported, the median
  over steps of each phase (a shared machine's outliers would otherwise dominate).
* **Links**: each worker's bytes per second over the ``send_seconds + receive_seconds`` of its
  streamed calls; with no streamed call, a least-squares fit of bundled calls' wall time minus
  compute against their bytes.
* **Per-call costs**: what a call's wall time leaves after compute and transfer, median over
  bundled and over streamed calls. A trace cannot tell the link's round trip from the software's
  fixed cost, so both go into these, and so does any wait of a streamed call on the master's own
  convolution (:attr:`~hetconv.costmodel.WireCosts.compute_stall` is 0 here).
* **comp**: the mean ``comp_seconds`` per image.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hetconv.costmodel import MBIT, SWITCHED, SimCluster, SimNode, WireCosts, simulate_step
from hetconv.formats import FLOAT32, PALETTE8, TensorFormat, format_named
from hetconv.model import PRESETS
from hetconv.replica import REPLICATED
from hetconv.split import SplitPlan
from hetconv.workload import (
    BACKWARD,
    FORWARD,
    PHASES,
    ConvLayer,
    call_bytes,
    network_layers,
    resident_call_bytes,
    split_part,
    stage_call_bytes,
)

from .scenario import CompFigure, DeviceSpec, Scenario
from .trace import MASTER, read_plan, read_trace, recorded_model, recorded_network


@dataclass
class Calibration:
    """What a trace says about the cluster that produced it."""

    path: str
    network: str
    batch: int
    steps: int  # records used
    node_names: list[str]
    layer_gflops: list[dict[str, float]]  # per node
    link_mbps: list[float | None]  # per node (None for the master)
    wire: WireCosts
    comp_per_image_s: float
    shares: dict[str, tuple[int, ...]]
    measured: dict[str, float]  # mean step_s, comm_s, conv_s, comp_s
    notes: list[str] = field(default_factory=list)
    step_numbers: list[int] = field(default_factory=list)  # of the records used
    # layer -> "fused" / "unfused", as the run ran it (hetconv train --stages); {}: unfused
    stage_modes: dict[str, str] = field(default_factory=dict)
    # layer -> "resident" / "sent" (hetconv train --kernels); {}: sent
    kernel_modes: dict[str, str] = field(default_factory=dict)
    # fused layer -> images per group of its overlapped calls (hetconv train --overlap); {}: none
    overlap_images: dict[str, int] = field(default_factory=dict)
    # layer -> the final fc it computed on the nodes (hetconv train --head); {}: none
    heads: dict[str, str] = field(default_factory=dict)
    # replicated block -> the format its images travelled in (palette8, float32); {}: float32
    replica_images: dict[str, str] = field(default_factory=dict)
    # replicated block -> each worker's images where they split it (hetconv.split); {}: none
    replica_split: dict[str, list[int]] = field(default_factory=dict)
    # replicated block -> the master's index in replica_split's, where it was a peer too
    # (--replicate split_all); {}: none
    split_master: dict[str, int] = field(default_factory=dict)

    def layers(self) -> list[ConvLayer]:
        """The network's convolutions at the traced batch, each replicated block's images as
        they travelled (:attr:`~hetconv.workload.ConvLayer.images_fit`)."""
        return [
            _images_as_sent(layer, self.replica_images)
            for layer in network_layers(self.network, self.batch)
        ]

    def devices(self) -> list[DeviceSpec]:
        """Master first; a device's ``gflops`` is its figure on the layer with the most FLOPs."""
        main = max(network_layers(self.network, self.batch), key=lambda c: c.shape.flops_forward)
        out = []
        for name, per_layer, link in zip(
            self.node_names, self.layer_gflops, self.link_mbps, strict=True
        ):
            gflops = per_layer.get(main.name) or float(np.mean(list(per_layer.values())))
            out.append(DeviceSpec(name, gflops, dict(per_layer), link, 0.0))
        return out

    def traced_cluster(self) -> SimCluster:
        """The cluster that ran, as measured: each worker's own link, the master's port the sum
        of them (the calls ran concurrently, so each measured rate was already shared)."""
        devices = self.devices()
        links = [MBIT * d.bandwidth_mbps for d in devices[1:]]
        master = SimNode(devices[0].name, devices[0].gflops, devices[0].layer_gflops, sum(links))
        workers = tuple(
            SimNode(d.name, d.gflops, d.layer_gflops, link, 0.0)
            for d, link in zip(devices[1:], links, strict=True)
        )
        wire = WireCosts(
            self.wire.bundle_call_s,
            self.wire.stream_call_s,
            float("inf"),
            self.wire.sum_bytes_per_s,
            compute_stall=self.wire.compute_stall,
            format=self.wire.format,
        )
        return SimCluster(master, workers, SWITCHED, master_compute=True, wire=wire)

    def check(self) -> dict[str, float]:
        """The simulator's step for the traced cluster with the traced shares (compare with
        :attr:`measured`)."""
        layers = self.layers()
        result = simulate_step(
            self.traced_cluster(),
            layers,
            self.shares,
            self.comp_per_image_s * self.batch,
            self.stage_modes,
            self.kernel_modes or "sent",
            overlap=self.overlap_images,
            head=self.heads,
            split_images=self.replica_split,
            split_master=self.split_master,
        )
        return {
            "step_s": result.step_s,
            "comm_s": result.comm_s,
            "conv_s": result.conv_s,
            "comp_s": result.comp_s,
        }

    def scenario(self, base: Scenario | None = None) -> Scenario:
        """A scenario of the traced devices.

        With ``base``, only the devices and comp come from the trace; the network, sweep and the
        population that grows larger clusters come from ``base``. Without, the network is a
        switched one at the mean measured worker link (the master's port at the sum of the
        measured links), the sweep runs from 1 node to the traced cluster's size, and larger
        clusters draw workers between the slowest and fastest traced worker, as the paper did.
        """
        from .scenario import Population

        devices = self.devices()
        comp = {self.network: CompFigure(per_image_s=self.comp_per_image_s)}
        workers = tuple(
            DeviceSpec(d.name, d.gflops, d.layer_gflops, None, None) for d in devices[1:]
        )
        if base is not None:
            master = DeviceSpec(devices[0].name, devices[0].gflops, devices[0].layer_gflops)
            return base.with_overrides(
                name=f"{base.name}+trace",
                master=master,
                workers=workers,
                comp={**base.comp, **comp},
            )
        links = [m for m in self.link_mbps[1:] if m is not None]
        speeds = [d.gflops for d in devices[1:]] or [devices[0].gflops]
        mean_link = float(np.mean(links)) if links else 1000.0
        master = DeviceSpec(
            devices[0].name, devices[0].gflops, devices[0].layer_gflops, sum(links) or None
        )
        return Scenario(
            name=f"trace:{Path(self.path).name}",
            description=f"calibrated from {self.path}",
            fabric=SWITCHED,
            bandwidth_mbps=mean_link,
            latency_ms=0.0,
            master=master,
            nodes=tuple(range(1, len(devices) + 1)),
            networks=(self.network,),
            batches=(self.batch,),
            workers=workers,
            population=Population(min(speeds), max(speeds), seed=0, name="drawn"),
            comp=comp,
            wire=self.wire,
            source=self.path,
        )


def _layout(record: dict) -> tuple[list[str], dict[str, list[int]]]:
    """(node names in order, master first, per layer the kernels of each node) of one record.

    A master that computed nothing (``--no-master-compute``) has no entry in the record; it
    is put first with no kernels, so a worker is never taken for the master.
    """
    # The master comes first also where it computed nothing of the first layers (its entry
    # then came later); layers in the order the record first names them.
    names = [MASTER] + [name for name in record["nodes"] if name != MASTER]
    order = [layer for entries in record["nodes"].values() for layer in entries]
    layers: dict[str, list[int]] = {layer: [0] * len(names) for layer in dict.fromkeys(order)}
    for i, name in enumerate(names):
        for layer, entry in record["nodes"].get(name, {}).items():
            layers[layer][i] = int(entry["kernels"])
    return names, layers


def _layout_key(record: dict) -> str:
    names, split = _layout(record)
    return json.dumps([names, split, record.get("batch")], sort_keys=True)


def _format_of(record: dict) -> TensorFormat:
    """The wire format a step record's bytes were counted in (older traces: float32)."""
    return format_named(record.get("wire_format", FLOAT32.label))


#: Bytes a call's headers may differ by from the model's: varints of numbers the model cannot
#: know exactly (a resident slice's version counts its placements and syncs, not steps).
HEADER_SLACK = 8


def _matches(layers: Sequence[ConvLayer], record: dict) -> str | None:
    """None when every worker call of ``record`` moved what the simulator computes, else why."""
    fmt = _format_of(record)
    modes = record.get("stage_modes", {})  # fused layers moved stage calls' bytes
    kept = record.get("kernel_modes", {})  # resident ones, resident calls' bytes
    heads = record.get("heads", {})  # resident ones that answered logits (hetconv.head)
    names, split = _layout(record)
    by_name = {layer.name: layer for layer in layers}
    replica = replicas(layers, modes, record.get("replica_images"))
    parts = split_parts(record, names, split, replica)
    if set(by_name) != set(split) or any(
        by_name[name].kernels != sum(kernels) for name, kernels in split.items()
    ):
        shown = {layer.name: layer.kernels for layer in layers}
        counts = {k: sum(v) for k, v in split.items()}
        return f"its conv layers are {shown}, the trace's {counts}"
    for layer_name, kernels in split.items():
        layer, offset = by_name[layer_name], kernels[0]
        for node, share in zip(names[1:], kernels[1:], strict=True):
            # A worker with no share of a layer (--shares link) has no record of it.
            entry = record["nodes"].get(node, {}).get(layer_name, {})
            for phase in PHASES:
                if share and phase in entry:
                    step = int(record.get("step", 0))
                    fused = modes.get(layer_name) == "fused" and layer.stage is not None
                    block = parts.get(layer_name, {}).get(node, replica.get(layer_name))
                    if fused and kept.get(layer_name) == "resident":
                        head = layer.head if layer_name in heads else 0
                        want = resident_call_bytes(
                            layer, layer.stage, phase, share, offset, step, fmt, block, head
                        )
                    elif fused:
                        want = stage_call_bytes(
                            layer, layer.stage, phase, share, offset, step, fmt, replica=block
                        )
                    else:
                        want = call_bytes(layer, phase, share, offset, step, fmt)
                    got = (entry[phase]["bytes_sent"], entry[phase]["bytes_received"])
                    off = (abs(got[0] - want.sent), abs(got[1] - want.received))
                    if max(off) > HEADER_SLACK:
                        return (
                            f"{node} {layer_name} {phase} moved {got} bytes, its shapes give "
                            f"{(want.sent, want.received)}"
                        )
            offset += share
    return None


def split_parts(
    record: dict, names: list[str], split: dict, replica: dict[str, ConvLayer]
) -> dict[str, dict[str, ConvLayer]]:
    """Layer name -> worker -> its part of the replicated block feeding the layer, where the
    trace's ``replica_split`` says the workers split it by images (:mod:`hetconv.split`):
    the workers with a share of the layer, in node order, each its images; the master's (its
    name, ``names[0]``) too where it was a peer (first)."""
    out = {}
    for consumer, block in replica.items():
        how = record.get("replica_split", {}).get(block.name)
        if how is None:
            continue
        peers = [n for n, k in zip(names[1:], split[consumer][1:], strict=True) if k]
        if how.get("master") is not None:
            peers = [names[0], *peers]
        plan = SplitPlan.of(peers, how["images"], int(how.get("round", 0)))
        out[consumer] = {w: split_part(block, plan, w) for w in peers}
    return out


def _images_as_sent(layer: ConvLayer, images: dict[str, str]) -> ConvLayer:
    """``layer`` with its images counted as a trace's ``replica_images`` says they travelled
    (float32 where it names none)."""
    return dataclasses.replace(layer, images_fit=images.get(layer.name) == PALETTE8.label)


def replicas(
    layers: Sequence[ConvLayer], modes: dict[str, str], images: dict[str, str] | None = None
) -> dict[str, ConvLayer]:
    """Layer name -> the replicated block whose output is its input (:mod:`hetconv.replica`),
    from a trace's ``stage_modes`` (the block's is ``"replicated"``; it feeds the next) and
    ``replica_images`` (block -> the format its images travelled in; traces from before it
    was recorded sent float32)."""
    return {
        after.name: _images_as_sent(layer, images or {})
        for layer, after in zip(layers, layers[1:], strict=False)
        if modes.get(layer.name) == REPLICATED
    }


def _detect_network(records: list[dict], network: str | None, path: str) -> str:
    batch = int(records[0]["batch"])
    network = network or recorded_network(path)
    candidates = [network] if network else list(PRESETS)
    reasons = []
    for name in candidates:
        why = _matches(network_layers(name, batch), records[0])
        if why is None:
            return name
        reasons.append(f"{name}: {why}")
    if network:
        raise ValueError(f"trace {path} does not match network {network}: {reasons[0]}")
    raise ValueError(
        f"trace {path} matches no preset ({'; '.join(reasons)}); name its network "
        "(a preset or .json spec) with --trace-preset"
    )


def _steps_of_one_split(records: list[dict]) -> tuple[list[dict], list[str]]:
    """The steps to calibrate from, and a note when some are left out.

    The first step (caches, connections) is left out when there are more. One simulated
    cluster has one split: of the rest, the steps of the most frequent one are used (a resumed
    run is probed again, and a lost or joining worker changes the shares).
    """
    candidates = records[1:] if len(records) > 1 else records
    notes = []
    imaged = [r for r in candidates if r.get("split") == "images"]
    if imaged and len(imaged) < len(candidates):  # a split trial (master/splittrial.py)
        notes.append(f"left out the {len(imaged)} steps split by images (a split trial)")
        candidates = [r for r in candidates if r.get("split") != "images"]
    clustered = [r for r in candidates if r.get("nodes")]
    if clustered and len(clustered) < len(candidates):  # released mid-run (an alone check)
        notes.append(
            f"left out the {len(candidates) - len(clustered)} steps the master trained alone "
            "(the workers released)"
        )
        candidates = clustered
    layouts = Counter(_layout_key(r) for r in candidates)
    chosen, count = layouts.most_common(1)[0]
    used = [r for r in candidates if _layout_key(r) == chosen]
    if count < len(candidates):
        notes.append(
            f"used the {count} of {len(candidates)} steps that share the most frequent split "
            "of kernels; the others (re-probed, or with workers lost or joining) are skipped"
        )
    return used, notes


@dataclass
class _Calls:
    """What the calls of the steps used measured; nodes by their index, master first."""

    timings: dict[tuple[int, int, str], list[float]]  # (node, layer, phase) -> compute seconds
    streamed_bytes: np.ndarray  # per node
    streamed_seconds: np.ndarray  # per node: send + receive seconds of its streamed calls
    bundled: list[list[tuple[float, float]]]  # per node: (bytes, wall - compute) of each call
    streamed: list[list[tuple[float, float]]]

    @classmethod
    def gather(cls, used: list[dict], node_names: list[str], layer_names: list[str]) -> _Calls:
        """The calls of the records ``used``. An overlapped layer's calls (``overlap_images``)
        time their compute but not their link: their transfers ran beside the compute."""
        count = len(node_names)
        calls = cls({}, np.zeros(count), np.zeros(count), [[] for _ in node_names],
                    [[] for _ in node_names])  # fmt: skip
        for record in used:
            for i, node in enumerate(node_names):
                for j, layer_name in enumerate(layer_names):
                    entry = record["nodes"].get(node, {}).get(layer_name)
                    if not entry or not entry["kernels"]:
                        continue
                    overlapped = layer_name in record.get("overlap_images", {})
                    for phase in (FORWARD, BACKWARD):
                        call = entry.get(phase)
                        if call is not None:
                            calls.add(i, j, phase, call, overlapped)
        return calls

    def add(self, i: int, j: int, phase: str, call: dict, overlapped: bool = False) -> None:
        self.timings.setdefault((i, j, phase), []).append(call["compute_seconds"])
        if i == 0 or overlapped:
            return
        moved = call["bytes_sent"] + call["bytes_received"]
        left = call["wall_seconds"] - call["compute_seconds"]
        if call["bundled"]:
            self.bundled[i].append((moved, left))
        else:
            self.streamed_bytes[i] += moved
            self.streamed_seconds[i] += call["send_seconds"] + call["receive_seconds"]
            self.streamed[i].append((moved, left))


def _layer_gflops(
    calls: _Calls,
    node_names: list[str],
    layers: dict[str, ConvLayer],
    split: dict[str, list[int]],
    notes: list[str],
    replica: dict[str, ConvLayer] | None = None,
    parts: dict[str, dict[str, ConvLayer]] | None = None,
) -> list[dict[str, float]]:
    """Per node and layer the GFLOPS of its share over the median compute seconds of each
    phase; a node that computed nothing gets the others' median.

    A worker's calls of the layer a replicated block feeds (``replica``: layer name -> block)
    also computed the whole block (or, split, its ``parts``: layer -> worker -> its part): its
    time counts that work too, and the worker's figure for the block is that layer's (the
    simulator adds the block's work back at it). The master's block, split with it a peer
    (its part among ``parts``), counts its images only."""
    flops = np.zeros((len(node_names), len(layers)))
    seconds = np.zeros_like(flops)
    own = {  # block -> the fraction of its images the master computed
        block.name: parts[consumer][node_names[0]].shape.n / block.shape.n
        for consumer, block in (replica or {}).items()
        if node_names[0] in (parts or {}).get(consumer, {})
    }
    for (i, j, phase), times in calls.timings.items():
        layer = list(layers.values())[j]
        flops[i, j] += split[layer.name][i] * layer.passes(phase) * layer.flops_per_kernel
        if not i and layer.name in own:
            flops[i, j] *= own[layer.name]
        block = (replica or {}).get(layer.name)
        block = (parts or {}).get(layer.name, {}).get(node_names[i], block)  # its images'
        if i and block is not None:
            flops[i, j] += block.kernels * block.passes(phase) * block.flops_per_kernel
        seconds[i, j] += statistics.median(times)
    layer_gflops: list[dict[str, float]] = []
    for i, node in enumerate(node_names):
        per_layer = {
            layer_name: flops[i, j] / seconds[i, j] / 1e9
            for j, layer_name in enumerate(layers)
            if seconds[i, j] > 0
        }
        for consumer, block in (replica or {}).items():
            if i and consumer in per_layer:
                per_layer[block.name] = per_layer[consumer]
        if not per_layer:
            notes.append(f"{node} computed nothing in the trace; given the others' median")
        layer_gflops.append(per_layer)
    for i, per_layer in enumerate(layer_gflops):
        if not per_layer:
            known = [g for p in layer_gflops for g in p.values()]
            layer_gflops[i] = {n: float(np.median(known)) for n in layers} if known else {}
    return layer_gflops


def _links_and_wire(
    calls: _Calls, node_names: list[str], notes: list[str]
) -> tuple[list[float | None], WireCosts]:
    """Each worker's link (Mbit/s; None for the master) and the per-call costs left over."""
    links: list[float | None] = [None]
    bundle_costs, stream_costs = [], []
    for i, node in enumerate(node_names[1:], start=1):
        rate = None
        if calls.streamed_seconds[i] > 0:
            rate = calls.streamed_bytes[i] / calls.streamed_seconds[i]
        elif len({b for b, _ in calls.bundled[i]}) >= 2:
            sizes, left = np.array(calls.bundled[i]).T
            slope, _ = np.polyfit(sizes, left, 1)
            rate = 1 / slope if slope > 0 else None
        if rate is None:
            notes.append(f"{node}: no call tells its bandwidth; 1000 Mbit/s assumed")
            rate = 1000 * MBIT
        links.append(rate / MBIT)
        bundle_costs += [max(left - moved / rate, 0.0) for moved, left in calls.bundled[i]]
        stream_costs += [max(left - moved / rate, 0.0) for moved, left in calls.streamed[i]]
    defaults = WireCosts()
    wire = WireCosts(
        bundle_call_s=statistics.median(bundle_costs) if bundle_costs else defaults.bundle_call_s,
        stream_call_s=statistics.median(stream_costs) if stream_costs else defaults.stream_call_s,
        # The measured per-call costs already hold the streamed calls' waits on the master.
        compute_stall=0.0,
    )
    if not bundle_costs:
        notes.append("no bundled call in the trace: default bundled-call cost")
    if not stream_costs:
        notes.append("no streamed call in the trace: default streamed-call cost")
    return links, wire


def _in_node_order(path: str, records: list[dict]) -> list[dict]:
    """``records`` with each step's nodes in the cluster's order (its plan record's: where
    kernel slices start), not the order the step first called them in: with link-aware
    shares a worker with no share of the first layer is called first in a later one."""
    try:
        order = {name: i for i, name in enumerate(read_plan(path).node_names)}
    except ValueError:  # an older trace: no plan record
        return records
    out = []
    for record in records:
        nodes = record.get("nodes", {})
        ordered = sorted(nodes.items(), key=lambda item: order.get(item[0], len(order)))
        out.append({**record, "nodes": dict(ordered)})
    return out


def calibrate(path: str, network: str | None = None) -> Calibration:
    """Read a trace and measure its cluster (see the module docstring).

    Args:
        network: the network the run trained (preset or .json spec); default: detected.

    Raises:
        ValueError: unreadable trace, a local run's trace, or no network that matches it.
    """
    used, notes = _steps_of_one_split(_in_node_order(path, read_trace(path)))
    name = _detect_network(used, network, path)
    recorded = (recorded_model(path) or {}).get("name") if network is None else None
    if recorded and recorded != name:
        notes.append(f"network {recorded} as the trace recorded it (the file is gone or changed)")
    batch = int(used[0]["batch"])
    layers = {layer.name: layer for layer in network_layers(name, batch)}
    node_names, split = _layout(used[0])
    calls = _Calls.gather(used, node_names, list(layers))
    modes = used[0].get("stage_modes", {})
    replica = replicas(list(layers.values()), modes, used[0].get("replica_images"))
    parts = split_parts(used[0], node_names, split, replica)
    layer_gflops = _layer_gflops(calls, node_names, layers, split, notes, replica, parts)
    links, wire = _links_and_wire(calls, node_names, notes)
    wire = dataclasses.replace(wire, format=_format_of(used[0]))
    measured = {
        key: float(np.mean([r[field] for r in used]))
        for key, field in (
            ("step_s", "seconds"),
            ("comm_s", "comm_seconds"),
            ("conv_s", "conv_seconds"),
            ("comp_s", "comp_seconds"),
        )
    }
    return Calibration(
        path=path,
        network=name,
        batch=batch,
        steps=len(used),
        node_names=node_names,
        layer_gflops=layer_gflops,
        link_mbps=links,
        wire=wire,
        comp_per_image_s=measured["comp_s"] / batch,
        shares={k: tuple(v) for k, v in split.items()},
        measured=measured,
        notes=notes,
        step_numbers=[int(r["step"]) for r in used],
        stage_modes=dict(used[0].get("stage_modes", {})),
        kernel_modes=dict(used[0].get("kernel_modes", {})),
        overlap_images={k: int(v) for k, v in used[0].get("overlap_images", {}).items()},
        heads={k: str(v) for k, v in used[0].get("heads", {}).items()},
        replica_images={k: str(v) for k, v in used[0].get("replica_images", {}).items()},
        replica_split={
            k: [int(n) for n in v["images"]] for k, v in used[0].get("replica_split", {}).items()
        },
        split_master={
            k: int(v["master"])
            for k, v in used[0].get("replica_split", {}).items()
            if v.get("master") is not None
        },
    )


# read_trace and read_plan live in .trace; they are named here too, where calibration is.
__all__ = ["MASTER", "Calibration", "calibrate", "read_plan", "read_trace"]
