"""The simulator's prediction of a ``benchmarks/testbed.py`` run, from its trace: the cluster
runs' steps (:func:`predict`) and the master alone's (:func:`predict_alone`); and what the
traces measured (:func:`measured`)."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from hetconv.master.resident import DEFAULT_SYNC_EVERY
from hetconv.simulations.testbed import SWITCHED_LINK, tcp_goodput_mbps
from hetconv.simulations.trace import read_plan, read_steps, step_bytes
from hetconv.simulations.validate import probe_speeds


def settled(traces: Sequence[str]) -> str:
    """A note for a run whose split changed mid-run (``--split auto``'s alone check released
    the workers, or its split trial decided): the median step after the last change, and
    the step it came after; empty where none changed or no step follows."""
    notes = []
    for trace in traces:
        steps = read_steps(trace)
        changed = [i for i, r in enumerate(steps) if "split_trial" in r
                   or (r.get("alone_check") or {}).get("released")]  # fmt: skip
        after = steps[changed[-1] + 1 :] if changed else []
        if after:
            seconds = statistics.median(r["seconds"] for r in after)
            notes.append(f"settled {seconds:.3f} s: the median of the {len(after)} steps after "
                         f"step {steps[changed[-1]]['step']} (a change of split)")  # fmt: skip
    return "; ".join(notes)


def measured(traces: Sequence[str], warmup: int) -> tuple[float, float, int]:
    """(median step seconds, median megabytes on the master's link per step, steps used) of
    the steps of every trace in ``traces`` (the rounds of one mode) after each one's first
    ``warmup``.

    Raises:
        ValueError: no step is left after the warmup.
    """
    steps = [record for trace in traces for record in read_steps(trace)[warmup:]]
    if not steps:
        raise ValueError(f"traces {', '.join(traces)} have no step after {warmup} warmup steps")
    seconds = statistics.median(r["seconds"] for r in steps)
    megabytes = statistics.median(step_bytes(r) for r in steps) / 1e6
    return seconds, megabytes, len(steps)


def predict(
    trace: str,
    link: str,
    rate_mbps: float,
    rtt_s: float,
    cap: float,
    master_port_shaped: bool = True,
    speeds: str = "trace",
):
    """The simulator's step for the run in ``trace`` on the testbed: :mod:`hetconv.costmodel`
    with the run's shares and comp from the trace
    (:func:`~hetconv.simulations.calibrate.calibrate`), every node's per-layer convolution
    speed from the trace's ``compute_seconds`` (``speeds="trace"``) or from the probe the master
    ran before training (``"probe"``, the trace's plan record), the links at the TCP goodput of
    ``rate_mbps`` (switched: every worker's cable and, when shaped, the master's port; shared:
    one medium for every transfer, both ways), ``rtt_s``, and the ``this-machine`` scenario's
    per-call software costs scaled by ``1 / cap`` (CPU work of a process capped at ``cap``).

    Returns (StepResult, Calibration).

    Raises:
        ValueError: the trace cannot be calibrated (for instance a mode whose bytes the cost
            model does not count yet).
    """
    from hetconv.costmodel import simulate_step
    from hetconv.simulations.calibrate import calibrate

    if (plan := _images_plan(trace)) is not None:
        cut = plan.get("cut") or str(plan.get("exchange") or "").removeprefix("cut:")
        if plan.get("cut") or str(plan.get("exchange") or "").startswith("cut:"):
            raise ValueError(f"a network cut after {cut}'s block: the testbed's prediction does "
                             "not model it yet (the run's own is in its plan record)")  # fmt: skip
        return predict_images(trace, plan, link, rate_mbps, rtt_s, cap, master_port_shaped)
    if (alone := _master_only(trace)) is not None:
        return alone
    cal = calibrate(trace)
    layers = cal.layers()
    if speeds == "probe":
        gflops = probe_speeds(trace, cal, layers)
    elif speeds == "trace":
        gflops = cal.layer_gflops
    else:
        raise ValueError(f"speeds {speeds!r} is not 'trace' or 'probe'")
    cluster = _testbed_cluster(cal, gflops, layers, link, rate_mbps, rtt_s, cap, master_port_shaped)
    comp = cal.comp_per_image_s * cal.batch
    # The modes the run traced (fused stages, resident kernels, overlap): their calls' bytes
    # and work.
    modes = cal.stage_modes, cal.kernel_modes or "sent"
    # Resident slices are synced every 20 steps (hetconv train's --resident-sync-every): the
    # prediction counts the syncs where one fell among the steps measured, as the run paid them
    # (a testbed run shorter than the interval measures none).
    synced = _synced(trace, cal)
    result = simulate_step(
        cluster, layers, cal.shares, comp, *modes, overlap=cal.overlap_images, head=cal.heads,
        sync_every=DEFAULT_SYNC_EVERY if synced else 0, split_images=cal.replica_split,
        split_master=cal.split_master,
    )  # fmt: skip
    return result, cal


@dataclass(frozen=True)
class ImagesCalibration:
    """What :func:`predict_images` measured of a run split by images: the images per node
    (``shares``, as the kernel split's per layer) and its seconds per image."""

    path: str
    shares: dict[str, list[int]]
    image_seconds: list[float]


@dataclass(frozen=True)
class MasterOnlyCalibration:
    """A cluster run whose plan put every kernel on the master (:func:`_master_only`)."""

    path: str
    shares: dict = field(default_factory=dict)


def _plan_records(path: str):
    """The trace's plan records, in order (lines that are not JSON objects passed over)."""
    with open(path, encoding="utf-8") as trace:
        for line in trace:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == "plan":
                yield record


def _images_plan(trace: str) -> dict | None:
    """The trace's first plan record when its run split the network by images (from the
    start, or after a split trial that kept the split by images: ``master/splittrial.py``),
    else None. A run that ends inside a trial (its last steps the runner-up's, undecided) is
    the split it chose."""
    first = next(_plan_records(trace), None)
    if first is None:
        return None
    if first.get("split") == "images":
        return first
    decided = [r["split_trial"] for r in read_steps(trace) if "split_trial" in r]
    tried = (decided[-1].get("trial") or {}) if decided else {}
    if decided and decided[-1].get("kept") == "trial" and tried.get("split") == "images":
        return {**first, "split": "images", "exchange": tried.get("exchange")}
    return None


def _master_only(trace: str):
    """(the step, its calibration) for a cluster run whose plan put every kernel on the master
    (the link-aware shares leaving the workers idle: resnet20 at batch 16): its steps have no
    per-node record to calibrate from, and its plan record's prediction is the master's own
    step (its probe of every layer plus its timing of the others, as :func:`predict_alone`
    reads it). None for any other run."""
    from types import SimpleNamespace

    first = next(_plan_records(trace), None)
    steps = read_steps(trace)
    if first is None or not steps or any(record.get("nodes") for record in steps):
        return None
    predicted = _seconds((first.get("prediction") or {}).get("step_s"))
    if predicted is None:
        return None
    return SimpleNamespace(step_s=predicted), MasterOnlyCalibration(trace)


def ring_check(plan: dict, seconds: list[float], workers: int):
    """:func:`hetconv.imagecost.simulate_image_split`'s ``check`` for a run whose plan record
    has spot checks on (``spot_checks``; None where off): the master recomputing at its
    measured seconds per image (``seconds[0]``; where it computed none, the workers' median,
    the testbed's nodes being alike)."""
    from types import SimpleNamespace

    from hetconv.ringcheck import check_pricing

    checks = plan.get("spot_checks")
    if not checks or not checks.get("every"):
        return None
    finite = [s for s in seconds if math.isfinite(s)]
    if not finite:
        return None
    per_image = seconds[0] if math.isfinite(seconds[0]) else statistics.median(finite)
    config = SimpleNamespace(every=checks["every"], ranges=checks.get("ranges", 1))
    return check_pricing(config, per_image, workers)


def predict_images(
    trace: str, plan: dict, link: str, rate_mbps: float, rtt_s: float, cap: float,
    master_port_shaped: bool = True,
):  # fmt: skip
    """The simulator's step for a run split by images (``--split images``):
    :func:`hetconv.imagecost.simulate_image_split` with each node's measured seconds per
    image (the median over the trace's steps after the first) and the last step's images per
    node, on the testbed's links (as :func:`predict`) and collective costs scaled by ``1 /
    cap``. Returns (DataParallelResult, :class:`ImagesCalibration`)."""
    from hetconv.costmodel import MBIT, SWITCHED, WIFI, SimCluster, SimNode
    from hetconv.dataparallel import CollectiveCosts
    from hetconv.imagecost import simulate_image_split

    model = plan.get("model") or {}
    names = [node["name"] for node in plan["nodes"]]
    steps = [r for r in read_steps(trace) if r.get("split") == "images"]
    used = steps[1:] or steps
    if not used:
        raise ValueError(f"trace {trace} holds no step split by images")
    seconds = []
    for name in names:
        per_image = [  # batch norm's sums over the ring (within its passes) modelled apart
            (r["nodes"][name]["seconds"] - r["nodes"][name].get("batchnorm_seconds", 0.0))
            / r["nodes"][name]["images"]
            for r in used
            if r["nodes"].get(name, {}).get("images")
        ]
        seconds.append(statistics.median(per_image) if per_image else math.inf)
    batches = [int(used[-1]["images"].get(name, 0)) for name in names]
    computing = [i for i, b in enumerate(batches) if b]
    rate = MBIT * tcp_goodput_mbps(rate_mbps)
    port = rate if (link != SWITCHED_LINK or master_port_shaped) else math.inf
    master = SimNode(names[0], 1.0, bytes_per_s=port)
    workers = tuple(SimNode(n, 1.0, bytes_per_s=rate, rtt_s=rtt_s) for n in names[1:])
    fabric = SWITCHED if link == SWITCHED_LINK else WIFI
    cluster = SimCluster(
        master, workers, fabric, rate if fabric == WIFI else math.inf,
        master_compute=bool(batches[0]),
    )  # fmt: skip
    ranks = computing if batches[0] else [i for i in computing if i]
    result = simulate_image_split(
        cluster, model["spec"], sum(batches), 0.0, CollectiveCosts().scaled(cap),
        image_seconds=[seconds[i] for i in ranks], batches=[batches[i] for i in ranks],
        input_shape=tuple(model["input_shape"]),
        exchange="ring" if plan.get("exchange") == "ring" else "ps",  # --exchange's choice
        check=ring_check(plan, seconds, len(names) - 1),
    )  # fmt: skip
    shares = {"images": [batches[i] for i in range(len(names))]}
    return result, ImagesCalibration(trace, shares, [seconds[i] for i in ranks])


def predict_alone(cal) -> float | None:
    """The master alone's step predicted from a cluster run's calibration ``cal``: what the
    run's plan record predicted for it (``prediction.alone_s``: the master's probe of every
    layer, forward and backward of all its kernels, plus its own timing of every other layer
    at the batch, both at its cap before training). A trace without that figure: the probes
    plus the run's comp, which is not the master alone's (fused stages, a replicated block
    and a split head run much of its ReLU, LRN, pooling and fc inside the phases or on the
    workers: 13-30 % low on the reference networks). A run split by images: its plan
    record's figure where there is one (``--split auto`` probes the master before it
    chooses), else None (no probe of its own); likewise a run with every kernel on the
    master."""
    if isinstance(cal, (ImagesCalibration, MasterOnlyCalibration)):
        return _seconds(_plan_prediction(cal.path, None).get("alone_s"))
    start = min(cal.step_numbers) if cal.step_numbers else None
    if (alone := _seconds(_plan_prediction(cal.path, start).get("alone_s"))) is not None:
        return alone
    plan = read_plan(cal.path, start)
    probes = plan.nodes[0].probe_seconds
    if not probes or not all(name in probes for name in cal.shares):
        return None
    return sum(probes[name] for name in cal.shares) + cal.comp_per_image_s * cal.batch


def _seconds(value) -> float | None:
    """A plan record's figure of seconds as a float; None where it is not a positive
    number."""
    valid = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    return float(value) if valid else None


def _plan_prediction(path: str, step: int | None) -> dict:
    """The ``prediction`` of the trace's plan record that step ``step`` ran under (the latest
    at or before it; without ``step``, the latest); {} when there is none."""
    found: dict = {}
    for record in _plan_records(path):
        if step is not None and record.get("start_step", 0) > step:
            continue
        prediction = record.get("prediction")
        found = prediction if isinstance(prediction, dict) else {}
    return found


def _testbed_cluster(
    cal, gflops, layers, link: str, rate_mbps: float, rtt_s: float, cap: float,
    master_port_shaped: bool,
):  # fmt: skip
    """The cost model's cluster of a testbed run (see :func:`predict`): the nodes at
    ``gflops`` per layer, the links at the TCP goodput of ``rate_mbps``, the per-call software
    costs of the ``this-machine`` scenario scaled by ``1 / cap``."""
    from hetconv.costmodel import MBIT, SWITCHED, WIFI, SimCluster, SimNode
    from hetconv.simulations.scenario import load_scenario

    main = max(layers, key=lambda layer: layer.shape.flops_forward).name
    rate = MBIT * tcp_goodput_mbps(rate_mbps)
    nodes = [
        SimNode(name, per_layer.get(main) or statistics.mean(per_layer.values()), per_layer)
        for name, per_layer in zip(cal.node_names, gflops, strict=True)
    ]
    base = load_scenario("this-machine").wire
    wire = replace(
        base,
        bundle_call_s=base.bundle_call_s / cap,
        stream_call_s=base.stream_call_s / cap,
        software_bytes_per_s=base.software_bytes_per_s * cap,
        sum_bytes_per_s=base.sum_bytes_per_s * cap,
        format=cal.wire.format,
    )
    master_compute = any(split[0] for split in cal.shares.values())
    if link == SWITCHED_LINK:
        port = rate if master_port_shaped else math.inf
        master = SimNode(nodes[0].name, nodes[0].gflops, nodes[0].layer_gflops, bytes_per_s=port)
        workers = tuple(
            SimNode(n.name, n.gflops, n.layer_gflops, bytes_per_s=rate, rtt_s=rtt_s)
            for n in nodes[1:]
        )
        cluster = SimCluster(master, workers, SWITCHED, master_compute=master_compute, wire=wire)
    else:
        workers = tuple(SimNode(n.name, n.gflops, n.layer_gflops, rtt_s=rtt_s) for n in nodes[1:])
        cluster = SimCluster(
            nodes[0], workers, WIFI, rate, master_compute=master_compute, wire=wire
        )
    return cluster


def _synced(trace: str, cal) -> bool:
    """Whether a resident slice was synced among the steps measured (see :func:`predict`)."""
    used = set(cal.step_numbers)
    synced = any(
        "fetched_bytes" in per_layer
        for record in read_steps(trace)
        if record["step"] in used
        for per_layer in record.get("resident", {}).values()
    )
    return synced
