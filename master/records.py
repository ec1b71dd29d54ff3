"""What the cluster tells about itself: the plan table it prints, the plan and step records
of the trace, and the step the cost model predicts for the plan chosen.

Functions of a :class:`~.cluster.Cluster`'s state (the ``cluster`` argument); they change
nothing of it.
"""

from __future__ import annotations

import dataclasses

from hetconv import costmodel
from hetconv.replica import FIRST as REPLICATE_FIRST
from hetconv.replica import OFF as REPLICATE_OFF
from hetconv.replica import SPLIT as REPLICATE_SPLIT
from hetconv.replica import SPLIT_ALL as REPLICATE_SPLIT_ALL
from hetconv.stages import FUSED, UNFUSED

from . import modes
from .membership import ACTIVE
from .planning import LINK_POLICY, shares_table, step_model
from .planning import plan_record as shares_record
from .probing import on_this_machine


def describe_shares(cluster) -> str:
    """A table: per node, its device, link, and per layer its probe time and kernels."""
    c = cluster.config
    lines = [shares_table(cluster.nodes, cluster.plans, c.master_compute, c.deterministic)]
    if cluster.medium is not None:
        lines.append(cluster.medium.describe())
    if c.share_policy == LINK_POLICY and workers_idle(cluster):
        lines.append(
            "--shares link: every worker would slow every layer down over its link (the "
            "master alone is predicted faster), so the master computes them all; "
            "--shares compute splits by compute speed alone"
        )
    return "\n".join(lines)


def describe_plan(cluster) -> str:
    """The shares table, then one line per mode: how each layer runs and why."""
    c = cluster.config
    stages = ", ".join(f"{name} {mode}" for name, mode in cluster.stage_modes.items())
    kernels = ", ".join(f"{name} {mode}" for name, mode in cluster.kernel_modes.items())
    return "\n".join([
        describe_shares(cluster),
        f"stages ({c.stages}): {stages}",
        f"kernels ({c.kernels}): {kernels}",
        f"replicate ({c.replicate}): {cluster.describe_replica()}",
        f"overlap ({c.overlap}): {modes.describe_overlap(cluster.overlap_images)}",
        f"head ({c.head}): {describe_head(cluster)}",
    ])  # fmt: skip


def describe_head(cluster) -> str:
    """One line: which stage computes the fc on the nodes, or why none does."""
    choice = modes.HeadChoice(cluster.heads, cluster.head_fcs, cluster.head_refused)
    return modes.describe_head(choice)


def workers_idle(cluster) -> bool:
    """Whether the plan gives no active worker any kernel of any layer."""
    active = [i for i, n in enumerate(cluster.nodes) if i and n.state == ACTIVE]
    return bool(active) and all(
        not plan.shares[i] for plan in cluster.plans.values() for i in active
    )


def replicate_mode(cluster) -> str:
    """The replicated block as the simulator names it: off, first, or split by images among
    the workers (split) or the master and the workers (split_all)."""
    replicas = cluster.replicas
    if not replicas.feeds:
        return REPLICATE_OFF
    if replicas.split_all:
        return REPLICATE_SPLIT_ALL
    return REPLICATE_SPLIT if replicas.split else REPLICATE_FIRST


#: With ``--shares link`` and the master computing, the workers get kernels only where the
#: cost model predicts the whole step at least this many times faster than the master alone
#: (after the modes are chosen): a gain of a few per cent is within its error, and a split
#: that does not pay makes the run slower than one machine (resnet20 on the scaled testbed,
#: 4 workers, switched, batch 64: predicted 0.377 s a step against 0.388 s alone, measured
#: 0.418 s).
KEEP_GAIN = 1.1


def keep_on_master(cluster, prediction: dict | None) -> str | None:
    """Give every kernel to the master (fixed shares, :meth:`.cluster.Cluster.replan`) where
    ``prediction`` (:func:`predict_step`) puts the cluster under :data:`KEEP_GAIN` times the
    master alone; what was done and why, or None (nothing: the split pays, the shares are
    the configuration's or the paper's rule, the master does not compute, no worker holds
    kernels, or a replicated block's calls go to the workers whatever the shares)."""
    c = cluster.config
    if (
        prediction is None or not prediction.get("workers") or c.shares
        or c.share_policy != LINK_POLICY or not c.master_compute
        or prediction["speedup"] >= KEEP_GAIN or cluster.replicas.feeds
    ):  # fmt: skip
        return None
    nodes = len(cluster.nodes)
    if not any(sum(plan.shares[1:]) for plan in cluster.plans.values()):
        return None
    fixed = {ly.name: (ly.shape.k,) + (0,) * (nodes - 1) for ly in cluster.planned_layers}
    cluster.planner = dataclasses.replace(cluster.planner, fixed=fixed)
    cluster.replan()
    return (
        f"every kernel stays on the master: the split is predicted "
        f"{prediction['speedup']:.2f}x the master alone, under the {KEEP_GAIN}x it needs "
        "(--shares compute or fixed --shares split anyway)"
    )


def predict_or_keep(
    cluster, comp_alone_s: float, comp_s: float, spec=None, chains_s=None
) -> dict | None:
    """:func:`predict_step`; where it is under :data:`KEEP_GAIN`, every kernel kept on the
    master (:func:`keep_on_master`) and the step as it then runs, saying why (``kept``)."""
    prediction = predict_step(cluster, comp_alone_s, comp_s, spec, chains_s)
    kept = keep_on_master(cluster, prediction)
    if kept is None:
        return prediction
    return {**predict_step(cluster, comp_alone_s, comp_s, spec, chains_s), "kept": kept}


def predict_step(
    cluster, comp_alone_s: float, comp_s: float, spec=None, chains_s=None
) -> dict | None:
    """The cost model's step for the plan and modes chosen, on the nodes as probed and
    measured, against the master alone's (its own probe of every layer); ``comp_alone_s`` and
    ``comp_s``: the master's other work per step alone and between the calls in the cluster;
    ``chains_s``: the layers after a convolution run inside its calls (fused stages on every
    node, a replicated block's on the master and in the workers' copies; the cost model's
    ``chains``). None when the master probed no layer (it does not compute): nothing to
    compare with."""
    layers, nodes, master = cluster.planned_layers, cluster.nodes, cluster.nodes[0]
    if not layers or not all(ly.name in master.probe_seconds for ly in layers):
        return None
    active = [i for i, n in enumerate(nodes) if i == 0 or n.state == ACTIVE]
    c, planner = cluster.config, cluster.planner
    model = step_model(
        [nodes[i] for i in active], layers, planner.network, planner.capacity,
        c.master_compute, costmodel.WireCosts(format=c.wire_format),
    )  # fmt: skip
    heads = cluster.heads
    modelled = [ly.modelled(heads.get(ly.name, 0)) for ly in layers]
    shares = {}
    for ly in layers:
        plan = cluster.plans[ly.name].shares
        shares[ly.name] = [plan[i] for i in active]
        shares[ly.name][0] += sum(plan) - sum(shares[ly.name])  # a lost node's: the master's
    stages = {
        name: (FUSED if mode == FUSED else UNFUSED) for name, mode in cluster.stage_modes.items()
    }
    result = costmodel.simulate_step(
        model, modelled, shares, comp_s, stages, cluster.kernel_modes, replicate_mode(cluster),
        cluster.overlap_images, heads, c.resident_sync_every, chains=chains_s,
    )  # fmt: skip
    alone = sum(master.probe_seconds[ly.name] for ly in layers) + comp_alone_s
    out = {
        "step_s": result.step_s,
        "alone_s": alone,
        "speedup": alone / result.step_s,
        "workers": len(active) - 1,  # reached: 0 predicts the master alone against itself
        # the master's other work: between calls, and the layers run inside them
        "comp_s": comp_s,
        "chains_s": dict(chains_s or {}),
    }
    if spec is not None and model.workers:  # the peer: every node the whole model
        from hetconv.dataparallel import simulate_data_parallel

        peer = simulate_data_parallel(model, spec, layers[0].shape.n, comp_alone_s)
        out["data_parallel_s"] = peer.step_s
        out["image_split_s"] = image_split_steps(
            model, spec, layers[0].shape.n, comp_alone_s, c.spot_checks, alone
        )
    return out


def image_split_steps(
    model, spec, batch: int, comp_alone_s: float, checks=None, alone_s: float = 0.0
) -> dict[str, float]:
    """The step of hetconv's own split by images on the nodes as measured, per exchange
    (``master``, ``ring``; a network with batch norm only ``ring``; and ``cut:LAYER``, the
    network cut after a layer's block, :mod:`hetconv.cutcost`), from the master's other
    work per step alone (:func:`hetconv.imagecost.simulate_image_split`); spot checks
    (``checks``) add what they cost a step on average (:func:`hetconv.ringcheck.check_seconds`,
    from the master alone's step ``alone_s``): the ring's as :func:`~hetconv.imagecost.
    simulate_image_split` weighs them (its passes over the gradient every step; the drawn
    ranges beyond the workers' step, or after the master's own range beyond the ring), the
    master exchange's whole, as they run after the answers (one cuda worker on an H200
    with a 16-core master: paper-500-1500 at batch 64 took 0.39-0.43 s a step, and 3.6-4.1 s
    on the steps whose checks recomputed the worker's 64 images on the master)."""
    from hetconv.imagecost import simulate_image_split
    from hetconv.imagesplit import refuse_batchnorm
    from hetconv.ring import MASTER, RING
    from hetconv.ringcheck import check_pricing, check_seconds

    exchanges = {MASTER: "ps", RING: "ring"}
    try:
        refuse_batchnorm(spec)
    except ValueError:  # its statistics are summed among the workers: the ring's alone
        del exchanges[MASTER]
    workers = len(model.workers)
    ring_check = check_pricing(checks, alone_s / batch, workers)
    out = {
        name: simulate_image_split(
            model, spec, batch, comp_alone_s, exchange=exchange,
            check=ring_check if name == RING else None,
        ).step_s
        for name, exchange in exchanges.items()
    }  # fmt: skip
    if checks is not None and MASTER in out:  # after the answers: nothing hides them
        out[MASTER] += check_seconds(checks, alone_s, workers, 0.0)
    if workers:  # the network cut in two, where it may be (hetconv.cutcost: no spot checks)
        from hetconv.cutcost import cut_ways

        out.update(cut_ways(model, spec, batch, comp_alone_s, None))
    return out


def plan_record(cluster) -> dict:
    """The plan as data (nodes, probes, links, shares, whether deterministic, the wire format,
    the spot-check settings, each layer's modes) for the trace's first record."""
    c = cluster.config
    record = {
        **shares_record(cluster.nodes, cluster.plans, c.master_compute, c.deterministic),
        "wire_format": c.wire_format.label,
        "stages": c.stages,
        "stage_modes": cluster.stage_modes,
        "kernels": c.kernels,
        "kernel_modes": cluster.kernel_modes,
        "share_policy": c.share_policy,
        "network": cluster.planner.network,
        "spot_checks": dataclasses.asdict(c.spot_checks),
        "replicate": c.replicate,
        "replicated": dict(cluster.replicas.feeds),  # block -> the layer it feeds
        "block_cost": cluster.block_cost,  # block -> whole block over its conv probe
        "overlap": c.overlap,
        "overlap_images": cluster.overlap_images,  # fused layer -> images per group
        "head": c.head,
        "heads": cluster.head_fcs,  # layer -> the fc it computes on the nodes
        # workers on the master's machine (loopback or its own address): they share its cores
        "this_machine": [node.name for node in cluster.nodes[1:] if on_this_machine(node.name)],
    }
    if cluster.medium is not None:
        record["medium"] = cluster.medium.record()
    return record


def step_record(cluster, events: list[dict]) -> dict:
    """This step's trace fields: per node and layer what moved and took how long, the totals
    of the distributed calls (``cluster_wall_seconds`` = comm + conv), how each layer ran, and
    the membership ``events`` since the last step."""
    runner, ran, run = cluster.runner, cluster.ctx.ran, cluster.run_of
    master = cluster.nodes[0].name
    record = {
        # workers whose answers this step took (none: the master computed the step alone)
        "workers_computed": sum(1 for name in runner.records if name != master),
        "comm_seconds": runner.comm,
        "conv_seconds": runner.conv,
        "cluster_wall_seconds": runner.wall,
        "wire_format": cluster.config.wire_format.label,  # of the bytes counted in "nodes"
        "nodes": runner.records,
        "stage_modes": ran,  # layer -> how it ran this step
        "kernel_modes": {name: run(name).kernels for name in ran},
        # fused layers whose worker calls ran in image groups -> images per group
        "overlap_images": {
            name: run(name).overlap_images
            for name, mode in ran.items()
            if mode == FUSED and run(name).overlap_images
        },
        # layers that computed the final fc on the nodes (hetconv.head) -> that fc
        "heads": {
            name: run(name).head[0]
            for name, mode in ran.items()
            if mode == FUSED and run(name).head
        },
    }
    replicas = cluster.replicas
    if replicas.feeds:  # replicated block -> the format its images travelled in
        record["replica_images"] = replicas.images_formats()
        if cluster.ctx.started_ahead:  # stage forwards started with the block feeding them
            record["started_ahead"] = sorted(cluster.ctx.started_ahead)
        if left := replicas.left():  # left to the workers -> computed here after all
            record["blocks_left"] = left
        if splits := replicas.splits():  # split by images among the workers
            record["replica_split"] = splits
    if cluster.resident.record:
        record["resident"] = cluster.resident.record  # bytes placed, fetched; steps replayed
    if events:
        record["events"] = events
    checks = cluster.spot_checks.record() if cluster.spot_checks is not None else None
    if checks is not None:
        record["spot_checks"] = checks
    return record


__all__ = [
    "describe_plan",
    "describe_shares",
    "image_split_steps",
    "plan_record",
    "KEEP_GAIN",
    "keep_on_master",
    "predict_or_keep",
    "predict_step",
    "replicate_mode",
    "step_record",
]
