"""Which way to train is predicted fastest on a cluster: ``hetconv plan``.

For one network and batch on one cluster (a shipped or own scenario, or one described on the
command line), every strategy the cost model knows is simulated and ranked:

* hetconv's kernel split in each of its modes (the paper's: compute shares, convolutions only,
  kernels sent; then link-aware shares with fused stages, resident kernels and the replicated
  first block, one after another; and the best of them with a 16-bit wire, which is not exact)
  (:func:`hetconv.costmodel.simulate_step`);
* hetconv's whole network split by images (``--split images``): every node trains the whole
  model on a slice of the batch, the master sends the images and sums the gradients
  (:func:`hetconv.imagecost.simulate_image_split`);
* heterogeneous data parallelism (PyTorch DDP), every node holding the whole model and a
  slice of the batch proportional to its speed, gradients by ring all-reduce or through a
  parameter server on the master, with and without overlapping them with backward
  (:func:`hetconv.dataparallel.simulate_data_parallel`);
* one machine: the master alone.

The fastest is named with the command that runs it, and how it compares with the best of the
others; when one machine alone is predicted fastest, the plan says so plainly.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from hetconv.balance import shares_for
from hetconv.costmodel import SimCluster, local_step_seconds, simulate_step
from hetconv.dataparallel import ALGORITHMS, batchnorm_layers, simulate_data_parallel
from hetconv.dataparallel import RING as RING_ALL_REDUCE
from hetconv.formats import BFLOAT16, FLOAT32
from hetconv.imagecost import choose_split, simulate_image_split
from hetconv.imagesplit import KERNELS, refuse_batchnorm
from hetconv.onnx_import import load_network
from hetconv.ring import MASTER, RING
from hetconv.spec import CIFAR_INPUT
from hetconv.workload import conv_layers

#: hetconv's modes, in the order they were built: (label, stages, kernels, replicate, overlap,
#: head, policy, wire format, the ``hetconv train`` flags).
MODES = (
    ("kernel split (the paper's)", "unfused", "sent", "off", "off", "master", "compute", FLOAT32,
     "--shares compute --stages unfused --kernels sent --replicate off --head master"),
    ("kernel split, link-aware shares", "unfused", "sent", "off", "off", "master", "link", FLOAT32,
     "--stages unfused --kernels sent --replicate off --head master"),
    ("fused stages", "fused", "sent", "off", "off", "master", "link", FLOAT32,
     "--stages fused --kernels sent --replicate off --overlap off --head master"),
    ("fused, resident kernels", "fused", "resident", "off", "off", "master", "link", FLOAT32,
     "--stages fused --kernels resident --replicate off --overlap off --head master"),
    ("fused, resident, replicated first block", "fused", "resident", "first", "off", "master",
     "link", FLOAT32,
     "--stages fused --kernels resident --replicate first --overlap off --head master"),
    ("fused, resident, replicated, overlapped", "fused", "resident", "first", "on", "master",
     "link", FLOAT32,
     "--stages fused --kernels resident --replicate first --overlap on --head master"),
    ("fused, resident, replicated, overlapped, bfloat16 wire", "fused", "resident", "first", "on",
     "master", "link", BFLOAT16,
     "--stages fused --kernels resident --replicate first --overlap on --head master "
     "--wire-format bfloat16"),
    ("fused, resident, replicated, split head", "fused", "resident", "first", "auto", "split",
     "link", FLOAT32,
     "--stages fused --kernels resident --replicate first --overlap auto --head split"),
    ("fused, resident, replicated, split head, bfloat16 wire", "fused", "resident", "first",
     "auto", "split", "link", BFLOAT16,
     "--stages fused --kernels resident --replicate first --overlap auto --head split "
     "--wire-format bfloat16"),
)  # fmt: skip
ONE_MACHINE = "one machine (the master alone)"
#: hetconv's whole network split by images: its own heterogeneous data parallelism, the
#: gradients summed through the master.
IMAGE_SPLIT = "split by images (gradients through the master)"
#: The same with the gradients summed by a ring among the workers (``--exchange ring``).
IMAGE_SPLIT_RING = "split by images (ring among the workers)"
#: The two by the exchange that names them (``--exchange``).
IMAGES = {MASTER: IMAGE_SPLIT, RING: IMAGE_SPLIT_RING}


@dataclass(frozen=True)
class Candidate:
    """One way to train and its predicted step."""

    kind: str  # "hetconv", "data-parallel" or "one machine"
    label: str
    step_s: float
    speedup: float  # over one machine
    master_mb: float  # bytes on the master's link per step / 1e6
    exact: bool
    how: str  # what runs it
    workers: int = 0  # workers that compute

    def row(self) -> dict:
        return {
            "kind": self.kind,
            "label": self.label,
            "step_s": self.step_s,
            "speedup": self.speedup,
            "master_mb": self.master_mb,
            "exact": self.exact,
            "how": self.how,
            "workers": self.workers,
        }


def train_command(network: str, batch: int, workers: int, flags: str = "") -> str:
    """The ``hetconv train`` command line that trains ``network`` at ``batch`` on a cluster of
    ``workers`` workers (0: ``--local``), one ``--worker HOST:PORT`` placeholder each, then
    ``flags``."""
    words = ["hetconv train", f"--model {shlex.quote(network)}", f"--batch {batch}"]
    words += ["--worker HOST:PORT"] * workers if workers else ["--local"]
    return " ".join(words + ([flags] if flags else []))


def network_shape(network: str, given: Sequence[int] | None = None) -> tuple[int, int, int]:
    """The (C, H, W) of ``network``'s images: ``given``, else a graph's own, else CIFAR's."""
    if given:
        return tuple(given)
    return tuple(load_network(network).input_shape or CIFAR_INPUT)


def candidates(
    cluster: SimCluster,
    network: str,
    batch: int,
    comp_s: float,
    input_shape: Sequence[int] | None = None,
    model: str | None = None,
) -> list[Candidate]:
    """Every strategy on ``cluster`` for ``network`` at ``batch`` of images of ``input_shape``
    (:func:`network_shape`; ``comp_s``: the master's non-convolutional seconds of a step),
    fastest first; each hetconv strategy's ``how`` is the command that runs it
    (:func:`train_command`, its ``--model`` ``model``, default ``network``), one ``--worker``
    per worker."""
    shape = network_shape(network, input_shape)
    layers = conv_layers(load_network(network).spec, batch, shape)
    alone = local_step_seconds(cluster.master, layers, comp_s)
    named = model or network
    local = train_command(named, batch, 0)
    out = [Candidate("one machine", ONE_MACHINE, alone, 1.0, 0.0, True, local)]
    workers = len(cluster.workers)
    if cluster.workers:
        for label, stages, kernels, replicate, overlap, head, policy, fmt, flags in MODES:
            if replicate != "off" and len(layers) < 2:
                continue
            model = cluster if fmt is FLOAT32 else _with_format(cluster, fmt)
            modes = (stages, kernels, replicate, overlap, head)
            shares = shares_for(model, layers, policy, *modes)
            got = simulate_step(model, layers, shares, comp_s, *modes)
            out.append(
                Candidate(
                    "hetconv",
                    label,
                    got.step_s,
                    alone / got.step_s,
                    got.bytes / 1e6,
                    fmt is FLOAT32,
                    train_command(named, batch, workers, flags),
                    got.workers_used(),
                )
            )
        out += _image_split(cluster, network, batch, comp_s, shape, alone, named, workers)
        out += _cut(cluster, network, batch, comp_s, shape, alone, named, workers)
        out += _data_parallel(cluster, network, batch, comp_s, shape, alone)
    return sorted(out, key=lambda c: c.step_s)


#: What runs data parallelism, by whether batch norm's statistics are the whole batch's.
DDP_HOW = "PyTorch DDP (benchmarks/vs_ddp.py measures it)"
DDP_OWN_NORMS = (
    "PyTorch DDP, each machine normalising its own images (torch's SyncBatchNorm needs GPUs): "
    "not one machine's model (benchmarks/vs_ddp.py measures it)"
)
DDP_SYNCED_HOW = (
    "PyTorch DDP with batch norm synced over the ranks (benchmarks/ddp_rank.py "
    "--synced-batchnorm; torch's SyncBatchNorm needs GPUs)"
)


def _data_parallel(cluster, network, batch, comp_s, shape, alone) -> list:
    """Data parallelism by ring all-reduce or a parameter server, with and without overlap.
    A network with batch norm: each rank normalising its own slice (what DDP does on CPUs; not
    exact: another model), and, exact, the ring with the statistics summed over the ranks."""
    norms = batchnorm_layers(load_network(network).spec)
    ways = [(a, o, False) for a in ALGORITHMS for o in (True, False)]
    ways += [(RING_ALL_REDUCE, True, True)] if norms else []
    out = []
    for algorithm, overlap, synced in ways:
        got = simulate_data_parallel(cluster, network, batch, comp_s, algorithm, overlap,
                                     input_shape=shape, synced_batchnorm=synced)  # fmt: skip
        name = "ring all-reduce" if algorithm == RING_ALL_REDUCE else "parameter server (master)"
        label = f"data parallelism, {name}" + (", overlapped" if overlap else "")
        label += ", batch norm synced" if synced else ""
        exact = synced or not norms
        how = DDP_SYNCED_HOW if synced else (DDP_HOW if exact else DDP_OWN_NORMS)
        out.append(Candidate("data-parallel", label, got.step_s, alone / got.step_s,
                             got.master_bytes / 1e6, exact, how,
                             sum(1 for b in got.batches[1:] if b)))  # fmt: skip
    return out


def default_checks(alone_s: float, batch: int, workers: int):
    """:func:`simulate_image_split`'s ``check`` for ``hetconv train``'s default spot checks
    (the command printed sets none): the master recomputing at its alone step's pace
    (``alone_s`` for ``batch`` images) a drawn range of ``workers``' ring."""
    from hetconv.master.spotcheck import SpotCheckConfig
    from hetconv.ringcheck import check_pricing

    return check_pricing(SpotCheckConfig(), alone_s / batch, workers)


def _image_split(cluster, network, batch, comp_s, shape, alone, named, workers) -> list:
    """The whole network split by images (``--split images``), both exchanges; a network with
    batch norm only with the ring (its statistics summed among the workers)."""
    ways = (
        ("ps", IMAGE_SPLIT, "--split images --exchange master"),
        ("ring", IMAGE_SPLIT_RING, "--split images --exchange ring"),
    )
    try:
        refuse_batchnorm(load_network(network).spec)
    except ValueError:  # batch norm: its statistics summed among the workers, by the ring
        ways = ways[1:]
    out = []
    for exchange, label, flags in ways:
        check = default_checks(alone, batch, workers) if exchange == "ring" else None
        got = simulate_image_split(cluster, network, batch, comp_s, input_shape=shape,
                                   exchange=exchange, check=check)  # fmt: skip
        out.append(
            Candidate(
                "hetconv",
                label,
                got.step_s,
                alone / got.step_s,
                got.master_bytes / 1e6,
                True,
                train_command(named, batch, workers, flags),
                sum(1 for b in got.batches[1:] if b),
            )
        )
    return out


def _cut(cluster, network, batch, comp_s, shape, alone, named, workers) -> list:
    """The network cut in two where that is predicted fastest (``--split LAYER=images``,
    :mod:`hetconv.cutcost`); none where it cannot be cut."""
    from hetconv.cutcost import CUT_LABEL, best_cut

    got = best_cut(cluster, network, batch, comp_s, shape)
    if got is None:
        return []
    layer, step, nbytes = got
    how = train_command(named, batch, workers, f"--split {layer}=images")
    return [Candidate("hetconv", CUT_LABEL.format(layer=layer), step, alone / step,
                      nbytes / 1e6, True, how, workers)]  # fmt: skip


def _with_format(cluster: SimCluster, fmt) -> SimCluster:
    import dataclasses

    return dataclasses.replace(cluster, wire=dataclasses.replace(cluster.wire, format=fmt))


def verdict(ranked: Sequence[Candidate]) -> str:
    """One line: the fastest strategy, by how much, against the best of the other kinds."""
    best = ranked[0]
    others = {}
    for c in ranked[1:]:
        if c.kind != best.kind:
            others.setdefault(c.kind, c)
    against = "; ".join(
        f"{best.step_s and other.step_s / best.step_s:.2f}x faster than {other.label} "
        f"({_seconds(other.step_s)})"
        for other in others.values()
    )
    if best.kind == "one machine":
        return (
            f"fastest: one machine alone ({_seconds(best.step_s)} per step): this cluster is "
            f"predicted to slow training down whatever runs on it; {against}"
        )
    line = (
        f"fastest: {best.label}, {_seconds(best.step_s)} per step, {best.speedup:.2f}x one "
        f"machine: {best.how}; {against}"
    )
    if not best.exact:
        exact = next(c for c in ranked if c.exact)
        line += f"; the fastest exact: {exact.label}, {_seconds(exact.step_s)}"
    return line


def auto_split(ranked: Sequence[Candidate]) -> str:
    """One line: what ``hetconv train --split auto`` (the default with workers named) would
    run on this cluster: the fastest exact kernel split against the splits by images
    (:func:`hetconv.imagecost.choose_split`). A kernel split's layer modes are chosen by
    train itself; the fastest listed stands for them."""
    from hetconv.cutcost import CUT_WAY

    cuts = {CUT_WAY + c.label.split(":")[0].removeprefix("cut after "): c
            for c in ranked if c.label.startswith("cut after ")}  # fmt: skip
    split = [*IMAGES.values(), *(c.label for c in cuts.values())]
    kernels = [c for c in ranked if c.kind == "hetconv" and c.exact and c.label not in split]
    images = {exchange: c.step_s for c in ranked for exchange, label in IMAGES.items()
              if c.label == label}  # fmt: skip
    images.update({way: c.step_s for way, c in cuts.items()})
    if not kernels or not images:
        return ""
    allowed = [MASTER, RING, *cuts]
    chosen = choose_split(kernels[0].step_s, images, allowed)
    line = f"--split auto (train's default with workers named): {_split_named(chosen)}"
    from hetconv.master.splittrial import describe_planned, runner_up

    trial = runner_up(chosen, allowed)
    return line + (f"; {describe_planned(trial)}" if trial is not None else "")


def _split_named(choice: dict) -> str:
    if choice["split"] == KERNELS:
        return f"split by kernels ({choice['why']})"
    exchange = choice["exchange"]
    if exchange.startswith("cut:"):
        return f"the network cut after {exchange[4:]}'s block ({choice['why']})"
    return f"{IMAGES[exchange]} ({choice['why']})"


def format_plan(ranked: Sequence[Candidate]) -> str:
    width = max(len(c.label) for c in ranked)
    lines = [f"{'strategy':<{width}}  {'step':>9}  {'speedup':>7}  {'MB/step':>8}  workers  exact"]
    for c in ranked:
        lines.append(
            f"{c.label:<{width}}  {_seconds(c.step_s):>9}  {c.speedup:>6.2f}x  "
            f"{c.master_mb:>8.1f}  {c.workers:>7}  {'yes' if c.exact else 'no'}"
        )
    lines.append(
        "step: predicted seconds per training step; speedup: over one machine; MB/step: on "
        "the master's link; workers: that compute (link-aware shares leave out a worker not "
        "worth its link)"
    )
    return "\n".join(lines)


def _seconds(value: float) -> str:
    if value >= 60:
        return f"{value / 60:.1f} min"
    if value >= 1:
        return f"{value:.2f} s"
    return f"{1e3 * value:.0f} ms"


__all__ = ["MODES", "Candidate", "auto_split", "candidates", "format_plan", "verdict"]


# -- the command -----------------------------------------------------------------------------

DESCRIPTION = """Say which way to train is predicted fastest on a cluster, and by how much:
hetconv's kernel split in each of its modes, plain heterogeneous data parallelism (every node
the whole model and a speed-proportional slice of the batch), or one machine alone.

Describe the cluster on the command line (--master GFLOPS, a --worker GFLOPS[@MBIT] per
worker, --network, --bandwidth) or name a scenario (a shipped name, see `hetconv simulate
--list`, or a .toml file; --nodes says how many of its nodes). A device's GFLOPS is what
`hetconv devices` prints for it (its probe) on an otherwise idle machine, or a datasheet's fp32
peak times ~0.5. The network and batch default to `hetconv train`'s; a .json or .onnx network's
non-convolutional time is measured here, in a few local steps."""

#: This project's 2-vCPU machine's non-convolutional milliseconds per image (the
#: ``this-machine`` scenario's [comp], measured), at its ~120 GFLOPS; a described master's is
#: scaled by 120 / its GFLOPS.
HERE_GFLOPS = 120.0


def described_scenario(args):
    """The scenario the arguments describe (a named one with overrides, or one made of
    --master and --worker)."""
    import dataclasses

    from .scenario import DEFAULT_COMP_MS_PER_IMAGE, CompFigure, DeviceSpec, Scenario, load_scenario

    fabric = {"switched": "switched", "wifi": "wifi"}.get(args.network or "")
    if args.scenario:
        if args.master or args.worker:
            raise ValueError(
                "name a scenario or describe the cluster (--master, --worker), not both"
            )
        scenario = load_scenario(args.scenario)
        changes = {}
        if fabric:
            changes["fabric"] = fabric
        if args.bandwidth:
            changes["bandwidth_mbps"] = args.bandwidth
        if args.latency_ms is not None:
            changes["latency_ms"] = args.latency_ms
        return dataclasses.replace(scenario, **changes), None
    if not args.master or not args.worker:
        raise ValueError(
            "describe the cluster: --master GFLOPS and a --worker GFLOPS[@MBIT] per worker "
            "(or name a scenario)"
        )
    fabric = fabric or "wifi"
    bandwidth = args.bandwidth or (100.0 if fabric == "wifi" else 940.0)
    here = load_scenario("this-machine")
    scale = HERE_GFLOPS / args.master
    comp = {
        name: CompFigure(per_image_s=figure.per_image_s * scale)
        for name, figure in here.comp.items()
        if figure.per_image_s is not None
    }
    measured = args.input_shape is not None or (
        args.preset not in comp and args.preset not in DEFAULT_COMP_MS_PER_IMAGE
    )
    if measured:  # the user's own network or shape: its share of a local step here
        comp[args.preset] = _measured_share(args.preset, args.input_shape)
    workers = tuple(
        DeviceSpec(f"worker-{i + 1}", gflops, {}, mbit)
        for i, (gflops, mbit) in enumerate(args.worker)
    )
    scenario = Scenario(
        name="described",
        description=f"a master at {args.master:g} GFLOPS and {len(workers)} "
        f"worker{'s' if len(workers) != 1 else ''} on "
        f"{'Wi-Fi' if fabric == 'wifi' else 'switched Ethernet'} at {bandwidth:g} Mbit/s",
        fabric=fabric,
        bandwidth_mbps=bandwidth,
        latency_ms=3.0 if args.latency_ms is None else args.latency_ms,
        master=DeviceSpec("master", args.master),
        nodes=(1 + len(workers),),
        networks=(args.preset,),
        batches=(args.batch,),
        workers=workers,
        comp=comp,
        layer_efficiency={"conv1": 0.2},  # a 3-channel first layer runs far below peak
        wire=here.wire,
    )
    if measured:
        how = comp[args.preset].how
        note = (
            f"the master's non-convolutional work: {how}, held at the master's convolution "
            "time; a first layer's convolution at 0.2 of a device's GFLOPS"
        )
    else:
        note = (
            f"the master's non-convolutional work: this project's machine's, measured, scaled "
            f"by {HERE_GFLOPS:g} / {args.master:g} GFLOPS; a first layer's convolution at 0.2 "
            "of a device's GFLOPS"
        )
    return scenario, note


def _measured_share(network: str, input_shape=None):
    """``network``'s non-convolutional time as a share of its local step, measured here
    (:func:`~.comptime.measure_comp`, on images of ``input_shape`` where given), so that a
    described master's figure follows its convolution speed as this machine's follows this
    machine's."""
    from .comptime import measure_comp
    from .scenario import CompFigure

    got = measure_comp(network, input_shape=input_shape)
    fraction = got.conv_per_image_s / (got.conv_per_image_s + got.per_image_s)
    how = (
        f"{network} {got.describe()} (convolutions {100 * fraction:.0f} % of the local step there)"
    )
    return CompFigure(conv_fraction=fraction, how=how)


def _placeholders(workers: int) -> str:
    """What the commands' ``--worker HOST:PORT`` placeholders stand for."""
    return (
        f"the command below names one --worker HOST:PORT per worker of this cluster ({workers}): "
        "put each worker's address there (`hetconv worker` prints it: `masters use: ...`), or "
        "replace them with --discover to find the workers on the LAN"
    )


def trained_model(name: str) -> tuple[str, tuple[int, int, int], str] | None:
    """A run folder or a model ``.npz`` that says what it holds
    (:mod:`hetconv.description`): its spec as a temporary ``.json`` file, its image shape and
    the network as its ``--model`` named it; None for any other name (a preset, a spec, a
    graph).

    Raises:
        ValueError: a folder without ``model.npz``, or weights that do not say what they are.
    """
    from pathlib import Path

    from hetconv.description import read_description

    from .trace import spec_file

    path = Path(name)
    if path.is_dir():
        path = path / "model.npz"
        if not path.is_file():
            raise ValueError(
                f"{name} holds no model.npz (a run folder's, written when it ends): name the "
                "network with --model NET (a preset, a .json spec or an .onnx graph)"
            )
    elif path.suffix != ".npz":
        return None
    described = read_description(path)
    if described is None:
        raise ValueError(
            f"{path} does not say which network it holds (written before weight files "
            "described themselves): name the network with --model NET"
        )
    stem = Path(described.network).stem or "model"
    return spec_file(stem, list(described.spec)), described.input_shape, described.network


def run(args) -> int:
    import json
    from pathlib import Path

    from .comptime import with_measured_comp

    given, model = args.preset, None
    trained = trained_model(args.preset)
    if trained is not None:  # a run's own network, at the run's image shape
        args.preset, shape, model = trained
        args.input_shape = args.input_shape or shape
    scenario, note = described_scenario(args)
    if note is None:  # a named scenario: a network without a figure is measured here
        scenario = with_measured_comp(scenario, [args.preset], input_shape=args.input_shape)
        figure = scenario.comp.get(args.preset)
        if figure is not None and figure.how:
            note = f"the master's non-convolutional work: {args.preset} {figure.how}"
    nodes = args.nodes or scenario.max_nodes() or 1 + len(scenario.workers)
    cluster = scenario.cluster(nodes)
    shape = network_shape(args.preset, args.input_shape)
    layers = conv_layers(load_network(args.preset).spec, args.batch, shape)
    comp = scenario.comp_seconds(
        args.preset, args.batch, local_step_seconds(cluster.master, layers, 0.0)
    )
    ranked = candidates(cluster, args.preset, args.batch, comp, shape, model)
    trained_as = f"{model} as trained there, " if model else ""
    images = "x".join(map(str, shape))
    print(
        f"plan for {given} ({trained_as}{images} images) at batch {args.batch} on "
        f"{scenario.description} ({nodes} node{'s' if nodes != 1 else ''})"
    )
    if note:  # a run's network by the name it trained under, not its spec's temporary file
        print(f"  {note.replace(args.preset, model) if model else note}")
    print(format_plan(ranked))
    if ranked[0].kind == "hetconv":
        print(_placeholders(nodes - 1))
    if line := auto_split(ranked):
        print(line)
    print(verdict(ranked))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([c.row() for c in ranked], indent=1) + "\n")
    return 0
