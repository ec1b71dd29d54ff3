"""Run a scenario's grid: every network, batch, bandwidth, cluster size and share policy.

Each point is one simulated step (:func:`~hetconv.costmodel.simulate_step`) and
becomes a :class:`Row`: the step time and its breakdown in the trace's terms, and the speedup
against local training on the master alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace

from hetconv.balance import COMPUTE, shares_for
from hetconv.costmodel import local_step_seconds, simulate_step
from hetconv.dataparallel import ALGORITHMS, PARAMETER_SERVER, simulate_data_parallel
from hetconv.imagecost import choose_split, simulate_image_split
from hetconv.imagesplit import IMAGES, KERNELS, refuse_batchnorm
from hetconv.onnx_import import load_network
from hetconv.ring import AUTO, MASTER, RING
from hetconv.stages import UNFUSED
from hetconv.workload import network_layers

from .paper import bandwidth_check
from .plan import default_checks
from .scenario import Scenario


@dataclass(frozen=True)
class Row:
    """One simulated configuration (the ``--json`` output is a list of these)."""

    scenario: str
    network: str
    batch: int
    nodes: int
    bandwidth_mbps: float
    policy: str
    step_s: float
    comm_s: float
    conv_s: float
    comp_s: float
    speedup: float
    local_s: float
    amdahl_bound: float
    workers_used: int
    mbytes_per_step: float
    shares: dict[str, list[int]]
    stages: str = "unfused"  # as `hetconv train --stages` (hetconv.stages)
    kernels: str = "sent"  # as `hetconv train --kernels` (hetconv.master.resident)
    replicate: str = "off"  # as `hetconv train --replicate` (hetconv.replica)
    overlap: str = "off"  # as `hetconv train --overlap` (hetconv.overlap)
    head: str = "master"  # as `hetconv train --head` (hetconv.head)
    # What is split (`hetconv train --split`): kernels, images (the policy names the exchange,
    # images-master or images-ring) or "-" (the data-parallel peer, dp-*).
    split: str = KERNELS
    # The row `--split auto` runs at this point; None where only one split was simulated.
    auto: bool | None = None
    comp_basis: str = "scenario"  # where comp_s comes from: the scenario, or "paper"
    # The paper's scenarios, clusters of 2 or more (simulations.paper.bandwidth_check): its
    # Eq. 2 volume, the time the paper's compute split leaves for moving it if the cluster is
    # to beat the master alone, the bandwidth that needs, and whether this row's has it.
    paper_mbytes: float | None = None
    comm_budget_s: float | None = None
    consistent_mbps: float | None = None
    bandwidth_consistent: bool | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def run_scenario(
    scenario: Scenario,
    nodes: Sequence[int] | None = None,
    bandwidths_mbps: Sequence[float] | None = None,
    networks: Sequence[str] | None = None,
    batches: Sequence[int] | None = None,
    policies: Sequence[str] | None = None,
    stages: str = "unfused",
    kernels: str = "sent",
    replicate: str = "off",
    data_parallel: bool = False,
    overlap: str = "off",
    head: str = "master",
    split: str = KERNELS,
    exchange: str = AUTO,
) -> list[Row]:
    """Simulate the scenario's grid (each argument, when given, replaces the scenario's), with
    every layer's stage run as ``stages`` says (``hetconv train --stages``), its kernels
    kept as ``kernels`` says (``hetconv train --kernels``) and the first block replicated as
    ``replicate`` says (``hetconv train --replicate``: ``"off"`` or ``"first"``), fused calls
    overlapped as ``overlap`` says (``hetconv train --overlap``), the final fc computed on the
    nodes as ``head`` says (``hetconv train --head``); with
    ``data_parallel``, also the data-parallel peer at every point (:func:`data_parallel_rows`).
    ``split`` (``hetconv train --split``): kernels (the rows above), images (the whole network
    split by images, :func:`image_split_rows`, by the ``exchange`` given: auto = both) or auto
    (both, the row ``--split auto`` would run marked: :func:`mark_auto_split`)."""
    rows = []
    modes = dict(stages=stages, kernels=kernels, replicate=replicate, overlap=overlap, head=head)
    for network in networks or scenario.networks:
        for batch in batches or scenario.batches:
            layers = network_layers(network, batch)
            master = scenario.cluster(1).master
            local_conv = local_step_seconds(master, layers, 0.0)
            comp = scenario.comp_seconds(network, batch, local_conv)
            for bandwidth in bandwidths_mbps or scenario.sweep_bandwidths():
                for size in nodes or scenario.nodes:
                    cluster = scenario.cluster(size, bandwidth)
                    results = {}
                    for policy in (policies or scenario.policies) if split != IMAGES else ():
                        shares = shares_for(
                            cluster, layers, policy, stages, kernels, replicate, overlap, head
                        )
                        results[policy] = simulate_step(
                            cluster, layers, shares, comp, stages, kernels, replicate, overlap,
                            head,
                        )  # fmt: skip
                    check = {}
                    if scenario.paper and size > 1:
                        check = _paper_check(cluster, layers, comp, results, stages, bandwidth)
                    point = {"scenario": scenario.name, "network": network, "batch": batch,
                             "nodes": size, "bandwidth_mbps": float(bandwidth)}  # fmt: skip
                    mine = [_row(scenario, point, p, r, modes, check) for p, r in results.items()]
                    if split != KERNELS and size > 1:
                        mine += image_split_rows(scenario, point, cluster, comp, exchange, check)
                    if split == AUTO:
                        mine = mark_auto_split(mine)
                    rows += mine
                    if data_parallel:
                        rows += data_parallel_rows(scenario.name, network, batch, bandwidth,
                                                   size, cluster, comp, check)  # fmt: skip
    return rows


def image_split_rows(scenario: Scenario, point: dict, cluster, comp_s: float, exchange: str,
                     check: dict) -> list[Row]:  # fmt: skip
    """The whole network split by images at one ``point`` (:func:`simulate_image_split`, as
    ``hetconv plan`` ranks it): gradients through the master (``images-master``) and by a ring
    among the workers (``images-ring``), as ``exchange`` allows (auto: both); a network with
    batch norm only by the ring (its statistics summed among the workers)."""
    network, batch = point["network"], point["batch"]
    ways = [MASTER, RING] if exchange == AUTO else [exchange]
    try:
        refuse_batchnorm(load_network(network).spec)
    except ValueError:
        ways = [w for w in ways if w == RING]
    rows = []
    for way in ways:
        algorithm = PARAMETER_SERVER if way == MASTER else RING
        checks = None
        if way == RING:  # train's default spot checks, as plan prices them
            alone = local_step_seconds(cluster.master, network_layers(network, batch), comp_s)
            checks = default_checks(alone, batch, len(cluster.workers))
        got = simulate_image_split(cluster, network, batch, comp_s, exchange=algorithm,
                                   check=checks)  # fmt: skip
        rows.append(_batch_row(point, f"images-{way}", got, split=IMAGES, overlap="-", head="-",
                               comp_basis=scenario.comp_basis, **check))  # fmt: skip
    return rows


def _batch_row(point: dict, policy: str, got, **fields) -> Row:
    """A Row of a step that splits the batch (data parallelism, the split by images: a
    :class:`~hetconv.dataparallel.DataParallelResult` ``got``) at ``point``; ``fields``: what
    else it says (its split, the check's)."""
    return Row(
        **point,
        policy=policy,
        step_s=got.step_s,
        comm_s=got.comm_s,
        conv_s=got.conv_s,
        comp_s=got.other_s,
        speedup=got.speedup,
        local_s=got.local_s,
        amdahl_bound=got.local_s / got.compute_s,  # (no exchange at all)
        workers_used=sum(1 for b in got.batches[1:] if b),
        mbytes_per_step=got.master_bytes / 1e6,
        shares={"batch": list(got.batches)},
        stages="-",
        kernels="-",
        replicate="-",
        **fields,
    )


def mark_auto_split(rows: Sequence[Row]) -> list[Row]:
    """``rows`` (one point's kernel and image rows) with the one ``--split auto`` runs marked:
    the fastest kernel row against the images rows by :func:`choose_split` (the same rule,
    margin included, as ``hetconv train``): its ``auto``."""
    kernels = [r for r in rows if r.split == KERNELS]
    images = {r.policy.removeprefix("images-"): r for r in rows if r.split == IMAGES}
    if not kernels or not images:
        return list(rows)
    fastest = min(kernels, key=lambda r: r.step_s)
    got = choose_split(fastest.step_s, {k: r.step_s for k, r in images.items()}, [MASTER, RING])
    chosen = fastest if got["split"] == KERNELS else images[got["exchange"]]
    return [replace(r, auto=r is chosen) for r in rows]


def _paper_check(cluster, layers, comp, results: dict, stages: str, bandwidth: float) -> dict:
    """The paper's bandwidth check of a point (:func:`bandwidth_check`), as Row fields: on the
    paper's split as it ran it, compute shares, convolutions only."""
    split = results.get(COMPUTE) if stages == UNFUSED else None
    split = split or simulate_step(cluster, layers, shares_for(cluster, layers, COMPUTE), comp)
    got = bandwidth_check(layers, split.local_s, split.conv_s, split.comp_s, bandwidth)
    return {
        "paper_mbytes": got.paper_bytes / 1e6,
        "comm_budget_s": got.budget_s,
        "consistent_mbps": got.consistent_mbps if math.isfinite(got.consistent_mbps) else None,
        "bandwidth_consistent": got.consistent,
    }


def _row(scenario: Scenario, point: dict, policy: str, result, modes: dict, check: dict) -> Row:
    """One policy's Row at one ``point`` of the grid (scenario, network, batch, nodes,
    bandwidth) under ``modes`` (stages, kernels, replicate, overlap, head)."""
    return Row(
        **point,
        policy=policy,
        step_s=result.step_s,
        comm_s=result.comm_s,
        conv_s=result.conv_s,
        comp_s=result.comp_s,
        speedup=result.speedup,
        local_s=result.local_s,
        amdahl_bound=result.amdahl_bound,
        workers_used=result.workers_used(),
        mbytes_per_step=result.bytes / 1e6,
        shares={k: list(v) for k, v in result.shares.items()},
        **modes,
        comp_basis=scenario.comp_basis,
        **check,
    )


def data_parallel_rows(
    scenario: str,
    network: str,
    batch: int,
    bandwidth: float,
    size: int,
    cluster,
    comp_s: float,
    check: dict | None = None,
) -> list[Row]:
    """Heterogeneous data parallelism at one point (:mod:`hetconv.dataparallel`): ring
    all-reduce and a parameter server on the master, each with its exchange overlapped with
    backward (``dp-ring``, ``dp-ps``: what PyTorch's DDP does) and after it (``-seq``). Their
    ``policy`` names them; ``conv`` is the slowest rank's convolutions, ``comp`` the rest of
    its compute, ``comm`` what the exchange adds, ``bound`` the speedup with a free exchange;
    ``shares`` holds ``{"batch": per rank}``; ``check``: the point's paper bandwidth check
    fields, as its other rows carry them."""
    rows = []
    point = {"scenario": scenario, "network": network, "batch": batch, "nodes": size,
             "bandwidth_mbps": float(bandwidth)}  # fmt: skip
    for algorithm in ALGORITHMS:
        for overlap in (True, False):
            r = simulate_data_parallel(cluster, network, batch, comp_s, algorithm, overlap)
            rows.append(_batch_row(point, r.label, r, split="-", **(check or {})))
    return rows


def _seconds(value: float) -> str:
    if value >= 3600:
        return f"{value / 3600:.1f} h"
    if value >= 60:
        return f"{value / 60:.1f} min"
    if value >= 1:
        return f"{value:.2f} s"
    return f"{1e3 * value:.1f} ms"


def format_table(rows: Iterable[Row]) -> str:
    """A plain-text table; ``*`` marks the fastest policy where several were simulated (the
    data-parallel rows, ``dp-...``, compete too), ``a`` the row ``--split auto`` runs."""
    rows = list(rows)
    best: dict[tuple, float] = {}
    counts: dict[tuple, int] = {}
    for r in rows:
        key = (r.scenario, r.network, r.batch, r.nodes, r.bandwidth_mbps)
        best[key] = min(best.get(key, float("inf")), r.step_s)
        counts[key] = counts.get(key, 0) + 1
    header = (
        f"{'network':<16} {'batch':>5} {'nodes':>5} {'Mbit/s':>7} {'policy':<13} "
        f"{'step':>9} {'comm':>9} {'conv':>9} {'comp':>9} {'speedup':>9} {'bound':>6} "
        f"{'workers':>7} {'MB/step':>9}"
    )
    lines = [header, "-" * len(header)]
    previous = None
    for r in rows:
        key = (r.scenario, r.network, r.batch, r.nodes, r.bandwidth_mbps)
        mark = "*" if counts[key] > 1 and r.step_s <= best[key] * (1 + 1e-9) else " "
        mark += "a" if r.auto else " "
        group = (r.network, r.batch, r.bandwidth_mbps)
        if previous is not None and group != previous:
            lines.append("")
        previous = group
        lines.append(
            f"{r.network:<16} {r.batch:>5} {r.nodes:>5} {r.bandwidth_mbps:>7g} {r.policy:<13} "
            f"{_seconds(r.step_s):>9} {_seconds(r.comm_s):>9} {_seconds(r.conv_s):>9} "
            f"{_seconds(r.comp_s):>9} {r.speedup:>7.2f}{mark} {r.amdahl_bound:>6.1f} "
            f"{r.workers_used:>7} {r.mbytes_per_step:>9.1f}"
        )
    return "\n".join(lines)


def _rate(mbps: float) -> str:
    return f"{mbps / 1e3:.3g} Gbit/s" if mbps >= 1e3 else f"{mbps:.3g} Mbit/s"


def format_bandwidth_checks(rows: Iterable[Row]) -> str:
    """For the paper's scenarios, one line per network, batch and bandwidth that cannot carry
    the paper's volume in the time the step's breakdown leaves (at the cluster size that leaves
    the most), naming the bandwidth that would; empty for other scenarios."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        if r.paper_mbytes is not None:
            groups.setdefault((r.scenario, r.network, r.batch, r.bandwidth_mbps), []).append(r)
    lines = []
    for (_, network, batch, bandwidth), mine in groups.items():
        best = max(mine, key=lambda r: r.comm_budget_s)
        if best.bandwidth_consistent:
            continue
        volume = best.paper_mbytes
        shown = f"{volume / 1e3:.1f} GB" if volume >= 1e3 else f"{volume:.1f} MB"
        transfer = volume * 1e6 / (bandwidth * 1e6 / 8)
        if best.consistent_mbps is None:
            needs = (
                "no cluster size here beats the master alone even with no transfers at all, "
                "so no bandwidth is consistent"
            )
        else:
            needs = (
                f"the breakdown leaves at most {_seconds(best.comm_budget_s)} for them if "
                f"{best.nodes} nodes are to beat the master alone: consistent bandwidth is "
                f">= {_rate(best.consistent_mbps)}"
            )
        lines.append(
            f"bandwidth check: {bandwidth:g} Mbit/s cannot carry the paper's volume for "
            f"{network} at batch {batch}: one step's {shown} (the paper's Eq. 2, float64) "
            f"take {_seconds(transfer)} at {bandwidth:g} Mbit/s; {needs}"
        )
    if groups and not lines:
        lines.append(
            "bandwidth check: every bandwidth shown carries the paper's volume (its Eq. 2, "
            "float64) in the time the step's breakdown leaves for it"
        )
    return "\n".join(lines)
