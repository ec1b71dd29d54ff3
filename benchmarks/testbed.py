"""The scaled cluster testbed: laptop-like compute-to-bandwidth on one machine (needs root).

The master and N workers each run in a network namespace of their own
(:class:`hetconv.simulations.testbed.ClusterTestbed`), every process in a CPU cgroup capped at the
same fraction ``--cap`` of a core with one BLAS thread (the caps together at most 1.8 of this
machine's 2 cores), joined by a bridge whose links are shaped with tc:

* ``--link switched``: every node's cable at the rate, each direction (the master's too: a
  laptop master has one gigabit port, which the requests to every worker share);
* ``--link shared``: one token bucket that every packet passes once, between any two nodes
  (an ifb device that takes what every port brings into the bridge): a half-duplex shared
  medium, as Wi-Fi.

**Scaling.** A capped process computes at ``cap x core_gflops`` (``core_gflops``: this
machine's core, measured at the start with hetconv's cpu backend on the network's own
convolutions, forward and both gradients, one thread, per CPU second so that other load on the
machine does not enter). A laptop core is taken to compute at ``--laptop-gflops`` (default 60: a
2016-2020 laptop core, AVX2 with FMA at 2.6-3.5 GHz, has an fp32 peak of 83-112 GFLOPS and
reaches ~50-90 in sgemm; the reference paper's i5-3210M has 40-50 peak). Compute is then scaled
by ``s = cap x core_gflops / laptop_gflops``, and so is the link: ``rate = s x 1000 Mbit/s``
(gigabit Ethernet) for ``switched`` and ``s x 100 Mbit/s`` (Wi-Fi's real throughput) for
``shared``, so each step's compute-to-bandwidth ratio is that of laptops on those networks.
``--rate-mbit`` overrides the rate, ``--core-gflops`` the measurement.

**Side by side in one run**, per (workers, link): the master alone at the same cap
(``hetconv train --local``), then every mode of :data:`MODES` through the same workers, each a
``hetconv train`` with the mode's extra flags (``--rounds R``: all of them R times, in turn,
their steps pooled). A row per mode: step time (median of the steps after ``--warmup``, from the
runs' traces), speedup over the master alone, megabytes on the
master's link per step (the trace's bytes, both ways) and the simulator's prediction
(:func:`predict`: :mod:`hetconv.costmodel` with the run's shares, its nodes' measured
convolution speeds and comp from the trace, and the testbed's link rate and round trip; the
per-call software costs of the ``this-machine`` scenario, scaled by ``1 / cap``; ``--speeds
probe`` takes node speeds from the probe before training instead). The master alone's
prediction is what the first cluster run's plan record predicted for it: the master's probe of
every layer (all kernels) plus its own timing of every other layer at the batch, both at its cap
before training (:func:`predict_alone`).

Modes are a table (:data:`MODES`): a new one is one line. A mode that needs a ``hetconv train``
flag runs only when ``hetconv train --help`` lists it: ``fused`` (``--stages fused``) is skipped,
with a note, until that flag lands, and runs from then on. ``all`` is every available mode marked
``in_all`` at once.

Every process shares this machine with whatever else runs on it: a cap is a ceiling, not a
reservation. On a loaded machine the N + 1 processes of a cluster run get less than their caps
while the master alone, one process, still gets its own: the speedups come out low, and noisy.
Before the runs, busy loops on every node at once measure what the caps really give
(``cap_received`` in every row: 1.0 on a quiet machine); a note is printed when it is below 0.9.
Rerun on a quiet machine for the record::

    sudo .venv/bin/python benchmarks/testbed.py --network paper-150-800 --batch 16 \\
        --workers 2 4 --link switched shared --modes kernel_split float16 --json rows.json

Everything it creates (namespaces, bridge, ifb, tc, cgroups, processes) is removed on the way
out, also on Ctrl-C, SIGTERM and errors; a run killed outright leaves namespaces and cgroups
that the next run removes (:func:`~hetconv.simulations.testbed.remove_stale`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from hetconv.argtypes import positive
from hetconv.master.resident import DEFAULT_SYNC_EVERY
from hetconv.simulations.testbed import (
    LINK_KINDS,
    SHARED_LINK,
    SWITCHED_LINK,
    ClusterTestbed,
    CpuCap,
    cluster_testbed_unavailable,
    remove_stale,
    tcp_goodput_mbps,
    with_blas_threads,
)
from hetconv.simulations.trace import read_plan, read_steps, step_bytes
from hetconv.simulations.validate import probe_speeds

#: Sum of the caps of all processes, at most: leaves this 2-core machine a little for the
#: kernel, tc and the benchmark itself.
MAX_TOTAL_CAP = 1.8
#: What ``hetconv`` compute on one laptop core reaches, GFLOPS (see the module docstring).
LAPTOP_GFLOPS = 60.0
#: The real links the testbed's are scaled from, Mbit/s.
LAPTOP_LINK_MBIT = {SWITCHED_LINK: 1000.0, SHARED_LINK: 100.0}
#: The cost model's fabric for each testbed link.
FABRIC = {SWITCHED_LINK: "switched", SHARED_LINK: "wifi"}
MASTER_ALONE = "master_alone"
ALL = "all"


@dataclass(frozen=True)
class Mode:
    """One way to train through the workers: extra ``hetconv train`` flags.

    ``flags`` may hold ``{network}``, replaced by ``switched`` or ``wifi`` (what the testbed's
    link is to ``hetconv train --network``). ``needs``: a flag ``hetconv train --help`` must
    list for the mode to run. ``in_all``: part of the ``all`` row."""

    name: str
    flags: tuple[str, ...]
    about: str
    needs: str | None = None
    in_all: bool = True

    def arguments(self, link: str) -> list[str]:
        """``hetconv train``'s flags: the kernel split's (:data:`BASE`), then the mode's, which
        override them (argparse keeps an option's last value)."""
        return [flag.replace("{network}", FABRIC[link]) for flag in (*BASE, *self.flags)]


#: The paper's kernel split, which every mode changes one thing of: shares by probe, plain
#: convolutions on the workers, kernels sent every step, nothing replicated or overlapped, the
#: fully connected layer on the master (``hetconv train``'s own defaults are link-aware shares,
#: and fused stages, resident kernels, the replicated block, overlap and the split head where
#: the cost model picks them).
BASE = (
    "--shares", "compute", "--stages", "unfused", "--kernels", "sent", "--replicate", "off",
    "--overlap", "off", "--head", "master",
)  # fmt: skip
#: Every exact mode's flags at once (link-aware shares, fused stages, resident kernels, the
#: replicated first block), without overlap.
EXACT = (
    "--shares", "link", "--network", "{network}", "--stages", "fused", "--kernels", "resident",
    "--replicate", "first",
)  # fmt: skip
#: every exact mode at once with the split head (exact_head), and the variants built on it
EXACT_HEAD = (*EXACT, "--overlap", "auto", "--head", "split")
#: exact_head's modes with every node's share equal instead of planned from probes and links
EQUAL_SHARES = (
    "--shares", "compute", "--stages", "fused", "--kernels", "resident", "--replicate", "first",
    "--overlap", "auto", "--head", "split", "--deterministic",
)  # fmt: skip
MODES: tuple[Mode, ...] = (
    Mode("kernel_split", (), "the paper's: every conv's kernels split by probe", in_all=False),
    Mode("float16", ("--wire-format", "float16"), "activations and their gradients as float16"),
    Mode("bfloat16", ("--wire-format", "bfloat16"), "the same as bfloat16", in_all=False),
    Mode("link_shares", ("--shares", "link", "--network", "{network}"), "link-aware shares"),
    Mode("fused", ("--stages", "fused"), "workers run the layers after their conv", "--stages"),
    Mode(
        "resident",
        ("--stages", "fused", "--kernels", "resident"),
        "fused, and workers keep their kernel slices and update them",
        "--kernels",
    ),
    Mode(
        "replica",
        ("--stages", "fused", "--replicate", "first"),
        "fused, and every node computes the first block from the images",
        "--replicate",
    ),
    Mode(
        "overlap",
        ("--stages", "fused", "--overlap", "on"),
        "fused, and workers send each image group's output while computing the next",
        "--overlap",
    ),
    Mode(
        "head",
        ("--stages", "fused", "--kernels", "resident", "--head", "split"),
        "fused, resident, and the last stage's workers keep the fc's columns and answer logits",
        "--head",
    ),
    Mode(
        "exact_whole",
        EXACT,
        "every exact mode but overlap: link shares, fused, resident, replicated first block",
        "--replicate",
        in_all=False,
    ),
    Mode(
        "exact",
        (*EXACT, "--overlap", "auto"),
        "every exact mode at once: link shares, fused, resident, replicated, overlap (where "
        "a worker's answer is over one message)",
        "--overlap",
        in_all=False,
    ),
    Mode(
        "exact_bfloat16",
        (*EXACT, "--overlap", "auto", "--wire-format", "bfloat16"),
        "exact, with activations and their gradients as bfloat16 on the wire",
        "--overlap",
        in_all=False,
    ),
    Mode(
        "exact_head",
        EXACT_HEAD,
        "every exact mode with the split head: link shares, fused, resident, replicated, "
        "overlap (auto), the last stage answering logits (what `hetconv train` does by default)",
        "--head",
        in_all=False,
    ),
    Mode(
        "exact_head_equal",
        EQUAL_SHARES,
        "exact_head with every node's share equal (--deterministic), not planned from probes",
        "--head",
        in_all=False,
    ),
    Mode(
        "exact_head_serial_probe",
        (*EXACT_HEAD, "--probe-nodes", "one-at-a-time"),
        "exact_head with the nodes probed one at a time before training (the paper's way), "
        "not all at once",
        "--probe-nodes",
        in_all=False,
    ),
    Mode(
        "exact_head_settle",
        (*EXACT_HEAD, "--settle-steps", "4"),
        "exact_head with the nodes' shares settled once on their measured finish times after "
        "four steps and two that warm up (use --warmup 8: the steps timed then come after the "
        "two that warm up after a move)",
        "--settle-steps",
        in_all=False,
    ),
    Mode(
        "exact_head_split",
        (*EXACT_HEAD, "--replicate", "split"),
        "exact_head with the replicated block split by images among the workers, who exchange "
        "its outputs and gradients node to node (switched links)",
        "--replicate",
        in_all=False,
    ),
    Mode(
        "exact_head_split_settle",
        (*EXACT_HEAD, "--replicate", "split", "--settle-steps", "4"),
        "exact_head_split with the shares settled once on the nodes' measured finish times "
        "after four steps (use --warmup 8)",
        "--settle-steps",
        in_all=False,
    ),
    Mode(
        "exact_head_split_all",
        (*EXACT_HEAD, "--replicate", "split_all"),
        "exact_head_split with the master one of the block's peers: it computes the block on "
        "its own share of the images and exchanges parts with the workers",
        "--replicate",
        in_all=False,
    ),
    Mode(
        "exact_head_split_none",
        (*EXACT_HEAD, "--replicate", "split_all", "--master-block", "none"),
        "exact_head_split_all with the master computing none of the block: it fetches every "
        "worker's output and sends them its input-gradient rows",
        "--master-block",
        in_all=False,
    ),
    Mode(
        "exact_head_split_all_settle",
        (*EXACT_HEAD, "--replicate", "split_all", "--settle-steps", "4"),
        "exact_head_split_all with the shares settled once on the nodes' measured finish times "
        "after four steps (use --warmup 8)",
        "--settle-steps",
        in_all=False,
    ),
    Mode(
        "exact_head_late",
        (*EXACT_HEAD, "--start-ahead", "off"),
        "exact_head with the second layer's stage calls sent when the master reaches it, not "
        "started with the replicated block",
        "--start-ahead",
        in_all=False,
    ),
    Mode(
        "exact_head_bfloat16",
        (*EXACT_HEAD, "--wire-format", "bfloat16"),
        "exact_head, with activations and their gradients as bfloat16 on the wire",
        "--head",
        in_all=False,
    ),
)
DEFAULT_MODES = (
    "kernel_split", "float16", "link_shares", "fused", "resident", "replica", "overlap", "head",
    "exact_whole", "exact", "exact_head", ALL,
)  # fmt: skip


def modes_named(names: Sequence[str]) -> list[str]:
    """``names`` checked against :data:`MODES` (and ``all``).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    known = [m.name for m in MODES] + [ALL]
    for name in names:
        if name not in known:
            raise ValueError(f"mode {name!r} is not one of {', '.join(known)}")
    return list(dict.fromkeys(names))


def train_help() -> str:
    """What ``hetconv train --help`` prints (to see which modes' flags exist)."""
    done = subprocess.run(
        [sys.executable, "-I", "-m", "hetconv", "train", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def runnable_modes(names: Sequence[str], help_text: str) -> tuple[list[Mode], list[str]]:
    """The modes of ``names`` that ``hetconv train`` offers, in order (``all`` as a mode of
    the flags of every offered ``in_all`` mode), and a note for each one left out."""
    table = {m.name: m for m in MODES}
    offered = {m.name for m in MODES if m.needs is None or m.needs in help_text}
    chosen, notes = [], []
    for name in names:
        if name == ALL:
            parts = [m for m in MODES if m.in_all and m.name in offered]
            if not parts:
                notes.append("all: no mode offered to combine")
                continue
            flags = tuple(flag for m in parts for flag in m.flags)
            chosen.append(Mode(ALL, flags, " + ".join(m.name for m in parts), in_all=False))
        elif name in offered:
            chosen.append(table[name])
        else:
            notes.append(f"{name}: skipped, `hetconv train --help` lists no {table[name].needs}")
    return chosen, notes


# -- scaling -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scale:
    """How the testbed maps to laptops: compute and links scaled by the same factor."""

    cap: float  # of a core, per process
    core_gflops: float  # this machine's core on the network's convolutions
    laptop_gflops: float
    laptop_link_mbit: float  # the real link: gigabit, or Wi-Fi's 100 Mbit/s

    @property
    def factor(self) -> float:
        """The testbed's compute (and link) over a laptop's."""
        return self.cap * self.core_gflops / self.laptop_gflops

    @property
    def rate_mbit(self) -> float:
        return self.factor * self.laptop_link_mbit


def measure_core_gflops(network: str, batch: int, repeats: int = 3) -> float:
    """GFLOPS of one core of this machine on ``network``'s convolutions at ``batch``: forward,
    kernel gradient and (where the layer needs it) input gradient of every conv layer with the
    cpu backend on one BLAS thread, best of ``repeats``, total FLOPs over total seconds. Runs in
    a process of its own, uncapped, and counts the process's CPU seconds, not wall seconds: a
    capped process gets CPU seconds, so that is the speed its cap is a fraction of, and other
    load on the machine does not enter (short of what it does to the caches)."""
    code = (
        "import time\n"
        "import numpy as np\n"
        "from hetconv.backends import get_backend\n"
        "from hetconv.workload import network_layers\n"
        "backend = get_backend('cpu')\n"
        "rng = np.random.default_rng(0)\n"
        "flops = seconds = 0.0\n"
        f"for layer in network_layers({network!r}, {batch}):\n"
        "    s = layer.shape\n"
        "    x = rng.standard_normal((s.n, s.c, s.h, s.w), dtype=np.float32)\n"
        "    w = rng.standard_normal((s.k, s.c, s.kh, s.kw), dtype=np.float32)\n"
        "    b = np.zeros(s.k, np.float32)\n"
        "    dy = rng.standard_normal((s.n, s.k, *s.out_hw), dtype=np.float32)\n"
        "    pad = s.padding.sides\n"
        "    best = float('inf')\n"
        f"    for _ in range({repeats}):\n"
        "        start = time.process_time()\n"
        "        backend.conv_forward(x, w, b, pad)\n"
        "        backend.conv_grad_kernels(x, dy, (s.kh, s.kw), pad)\n"
        "        if layer.need_input_grad:\n"
        "            backend.conv_grad_input(dy, w, (s.h, s.w), pad)\n"
        "        best = min(best, time.process_time() - start)\n"
        "    seconds += best\n"
        "    flops += s.flops_forward * layer.step_passes\n"
        "print(flops / seconds / 1e9)\n"
    )
    env = with_blas_threads(os.environ, 1)
    done = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"measuring this core failed:\n{done.stderr.strip()}")
    return float(done.stdout.split()[-1])


# -- a run and its row ---------------------------------------------------------------------------


@dataclass
class Row:
    """One run of one configuration: what was measured and predicted."""

    network: str
    batch: int
    workers: int
    link: str  # switched / shared
    mode: str
    step_s: float | None
    speedup: float | None  # master alone / this
    master_mb_per_step: float | None  # both ways, every node and layer (0 alone)
    predicted_step_s: float | None
    prediction_error: float | None  # predicted / measured - 1
    rate_mbit: float
    laptop_link_mbit: float
    cap: float
    scale: float
    core_gflops: float
    laptop_gflops: float
    rtt_ms: float
    cap_received: float  # what busy loops on every node at once got, over the cap
    steps_used: int
    flags: list[str] = field(default_factory=list)
    shares: dict[str, list[int]] = field(default_factory=dict)
    note: str = ""


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
    from hetconv.costmodel import MBIT, SWITCHED, WIFI, Cluster, Node, simulate_step
    from hetconv.simulations.calibrate import calibrate
    from hetconv.simulations.scenario import load_scenario

    cal = calibrate(trace)
    layers = cal.layers()
    if speeds == "probe":
        gflops = probe_speeds(trace, cal, layers)
    elif speeds == "trace":
        gflops = cal.layer_gflops
    else:
        raise ValueError(f"speeds {speeds!r} is not 'trace' or 'probe'")
    main = max(layers, key=lambda layer: layer.shape.flops_forward).name
    rate = MBIT * tcp_goodput_mbps(rate_mbps)
    nodes = [
        Node(name, per_layer.get(main) or statistics.mean(per_layer.values()), per_layer)
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
        master = Node(nodes[0].name, nodes[0].gflops, nodes[0].layer_gflops, bytes_per_s=port)
        workers = tuple(
            Node(n.name, n.gflops, n.layer_gflops, bytes_per_s=rate, rtt_s=rtt_s) for n in nodes[1:]
        )
        cluster = Cluster(master, workers, SWITCHED, master_compute=master_compute, wire=wire)
    else:
        workers = tuple(Node(n.name, n.gflops, n.layer_gflops, rtt_s=rtt_s) for n in nodes[1:])
        cluster = Cluster(nodes[0], workers, WIFI, rate, master_compute=master_compute, wire=wire)
    comp = cal.comp_per_image_s * cal.batch
    # The modes the run traced (fused stages, resident kernels, overlap): their calls' bytes
    # and work.
    modes = cal.stage_modes, cal.kernel_modes or "sent"
    # Resident slices are synced every 20 steps (hetconv train's --resident-sync-every): the
    # prediction counts the syncs where one fell among the steps measured, as the run paid them
    # (a testbed run shorter than the interval measures none).
    used = set(cal.step_numbers)
    synced = any(
        "fetched_bytes" in per_layer
        for record in read_steps(trace)
        if record["step"] in used
        for per_layer in record.get("resident", {}).values()
    )
    result = simulate_step(
        cluster, layers, cal.shares, comp, *modes, overlap=cal.overlap_images, head=cal.heads,
        sync_every=DEFAULT_SYNC_EVERY if synced else 0, split_images=cal.replica_split,
        split_master=cal.split_master,
    )  # fmt: skip
    return result, cal


def predict_alone(cal) -> float | None:
    """The master alone's step predicted from a cluster run's calibration ``cal``: what the
    run's plan record predicted for it (``prediction.alone_s``: the master's probe of every
    layer, forward and backward of all its kernels, plus its own timing of every other layer
    at the batch, both at its cap before training). A trace without that figure: the probes
    plus the run's comp, which is not the master alone's (fused stages, a replicated block
    and a split head run much of its ReLU, LRN, pooling and fc inside the phases or on the
    workers: 13-30 % low on the reference networks). None when the master computed nothing
    (no probe of its own)."""
    start = min(cal.step_numbers) if cal.step_numbers else None
    alone = _plan_prediction(cal.path, start).get("alone_s")
    if isinstance(alone, (int, float)) and not isinstance(alone, bool) and alone > 0:
        return float(alone)
    plan = read_plan(cal.path, start)
    probes = plan.nodes[0].probe_seconds
    if not probes or not all(name in probes for name in cal.shares):
        return None
    return sum(probes[name] for name in cal.shares) + cal.comp_per_image_s * cal.batch


def _plan_prediction(path: str, step: int | None) -> dict:
    """The ``prediction`` of the trace's plan record that step ``step`` ran under (the latest
    at or before it; without ``step``, the latest); {} when there is none."""
    found: dict = {}
    with open(path, encoding="utf-8") as trace:
        for line in trace:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict) or record.get("event") != "plan":
                continue
            if step is not None and record.get("start_step", 0) > step:
                continue
            prediction = record.get("prediction")
            found = prediction if isinstance(prediction, dict) else {}
    return found


def _run_timeout(network: str, batch: int, steps: int, cap: float, core: float, rate: float):
    """A generous bound on one ``hetconv train`` run: start-up, the probe, and every step as if
    the master computed it alone and also sent every call's bytes over one link."""
    from hetconv.workload import PHASES, call_bytes, network_layers

    layers = network_layers(network, batch)
    flops = sum(layer.shape.flops_forward * layer.step_passes for layer in layers)
    wire = sum(call_bytes(ly, phase, ly.kernels).total for ly in layers for phase in PHASES)
    step = flops / (cap * core * 1e9) + wire / (tcp_goodput_mbps(rate) * 1e6 / 8)
    return 300 + 3 * (steps + 2) * step


def run_configuration(
    args: argparse.Namespace,
    workers: int,
    link: str,
    modes: Sequence[Mode],
    core_gflops: float,
    scratch: Path,
    log=sys.stderr,
    before_teardown: Callable[[ClusterTestbed], None] | None = None,
) -> list[Row]:
    """Build the testbed for (``workers``, ``link``), run the master alone and every mode in it,
    tear it down, predict. Returns the rows, the master alone first. ``before_teardown`` is
    called with the testbed once every run is done, its workers still up (to read their
    peak memory, for instance)."""
    cap = args.cap or MAX_TOTAL_CAP / (workers + 1)
    scale = Scale(cap, core_gflops, args.laptop_gflops, LAPTOP_LINK_MBIT[link])
    rate = args.rate_mbit or scale.rate_mbit
    steps = args.warmup + args.steps
    timeout = _run_timeout(args.network, args.batch, steps, cap, core_gflops, rate)
    common = [
        "--preset", args.network, "--batch", str(args.batch), "--steps", str(steps),
        "--no-progress", "--eval-size", "0", "--train-size", str(max(args.batch * steps, 256)),
        "--seed", "0",
    ]  # fmt: skip
    print(
        f"\n{args.network} batch {args.batch}, {workers} worker(s), {link} link: cap {cap:.3f} "
        f"core per process, scale {scale.factor:.3f} = {cap:.3f} x {core_gflops:.1f} / "
        f"{args.laptop_gflops:g} GFLOPS, rate {rate:.1f} Mbit/s"
        + (" (--rate-mbit)" if args.rate_mbit else f" = {scale.factor:.3f} x "
           f"{scale.laptop_link_mbit:g}"),
        file=log,
        flush=True,
    )  # fmt: skip
    traces: dict[str, list[str]] = {MASTER_ALONE: [], **{m.name: [] for m in modes}}
    failures: dict[str, str] = {}
    with ClusterTestbed(workers, link, rate, cap, not args.master_port_unlimited) as bed:
        for note in bed.notes:
            print(f"testbed: {note}", file=log)
        rtt = statistics.median(bed.ping(host) for host in bed.worker_hosts)
        if not args.no_link_check:
            # One transfer alone, about half a second of the rate.
            megabytes = tcp_goodput_mbps(rate) / 8 * 0.5
            alone = bed.transfer_mbps([(bed.master, bed.worker_hosts[0])], megabytes)[0]
            print(
                f"  link check: master -> w0 alone {alone:.1f} Mbit/s (TCP goodput of the "
                f"rate: {tcp_goodput_mbps(rate):.1f}); rtt {1e3 * rtt:.2f} ms",
                file=log,
                flush=True,
            )
        shares = bed.cap_shares()
        cap_received = statistics.mean(shares) / cap
        print(
            f"  cap check: busy loops on all {len(shares)} nodes at once got "
            f"{' '.join(f'{x:.2f}' for x in shares)} of a core (cap {cap:.2f})",
            file=log,
            flush=True,
        )
        addresses = bed.start_workers()  # (idle while the master trains alone)
        connect = ["--connect-timeout", "180"] + [f for a in addresses for f in ("--worker", a)]
        runs = [(MASTER_ALONE, ["--local"])] + [(m.name, m.arguments(link)) for m in modes]
        for round_number in range(args.rounds):
            for name, flags in runs:
                if name in failures:
                    continue
                trace = str(scratch / f"w{workers}-{link}-{name}-r{round_number}.jsonl")
                print(f"  {name} {' '.join(flags)} ...", file=log, flush=True)
                where = [] if name == MASTER_ALONE else connect
                try:
                    bed.run_master([*where, *common, *flags, "--trace", trace], timeout)
                except RuntimeError as e:
                    if name == MASTER_ALONE:
                        raise
                    failures[name] = str(e).splitlines()[0]
                    print(f"  {name} failed: {e}", file=log)
                    continue
                traces[name].append(trace)
        drops = bed.qdisc_drops()
        if before_teardown is not None:
            before_teardown(bed)
    if drops:
        print(f"  note: the token buckets dropped {drops} packets", file=log)
    if cap_received < 0.9:
        # The caps are ceilings: N + 1 capped processes then got less than their caps, while
        # the master alone, one process, more likely got its own, which favours it.
        print(
            f"  note: the processes got {cap_received:.2f} of their caps: other work competed "
            "for the cores; the cluster's rows are pessimistic",
            file=log,
        )

    rows = []
    local_s, _, local_used = measured(traces[MASTER_ALONE], args.warmup)
    base = dict(
        network=args.network, batch=args.batch, workers=workers, link=link, rate_mbit=rate,
        laptop_link_mbit=scale.laptop_link_mbit, cap=cap, scale=scale.factor,
        core_gflops=core_gflops, laptop_gflops=args.laptop_gflops, rtt_ms=1e3 * rtt,
        cap_received=cap_received,
    )  # fmt: skip
    local_predicted = None
    for mode in modes:
        if mode.name in failures:
            rows.append(
                Row(**base, mode=mode.name, step_s=None, speedup=None, master_mb_per_step=None,
                    predicted_step_s=None, prediction_error=None, steps_used=0,
                    flags=mode.arguments(link), note=f"failed: {failures[mode.name]}")
            )  # fmt: skip
            continue
        flags = mode.arguments(link)
        step_s, megabytes, used = measured(traces[mode.name], args.warmup)
        predicted, note, shares = None, "", {}
        try:  # (from the first round's run)
            result, cal = predict(
                traces[mode.name][0], link, rate, rtt, cap, not args.master_port_unlimited,
                args.speeds,
            )  # fmt: skip
            predicted = result.step_s
            shares = {k: list(v) for k, v in cal.shares.items()}
            if local_predicted is None:
                local_predicted = predict_alone(cal)
        except Exception as e:  # noqa: BLE001 (a run's figures stand without their prediction)
            # The simulator may not read a mode's trace (bytes it does not count yet, a node
            # left out of a layer): the row keeps its measurement and says why.
            note = f"no prediction: {type(e).__name__}: {e}"
        rows.append(
            Row(**base, mode=mode.name, step_s=step_s, speedup=local_s / step_s,
                master_mb_per_step=megabytes, predicted_step_s=predicted,
                prediction_error=None if predicted is None else predicted / step_s - 1,
                steps_used=used, flags=flags, shares=shares, note=note)
        )  # fmt: skip
    alone = Row(
        **base, mode=MASTER_ALONE, step_s=local_s, speedup=1.0, master_mb_per_step=0.0,
        predicted_step_s=local_predicted,
        prediction_error=None if local_predicted is None else local_predicted / local_s - 1,
        steps_used=local_used, flags=["--local"],
        note="" if local_predicted is not None else "no cluster run's probe to predict from",
    )  # fmt: skip
    return [alone, *rows]


def _figure(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: Sequence[Row]) -> str:
    header = (
        f"{'workers':>7} {'link':<8} {'Mbit/s':>7} {'cap':>5} | {'mode':<13} {'step s':>7} "
        f"{'speedup':>7} {'MB/step':>8} | {'predicted s':>11} {'error %':>7}  note"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        error = "-" if r.prediction_error is None else f"{100 * r.prediction_error:+.1f}"
        lines.append(
            f"{r.workers:>7} {r.link:<8} {r.rate_mbit:>7.1f} {r.cap:>5.3f} | {r.mode:<13} "
            f"{_figure(r.step_s, '.3f'):>7} {_figure(r.speedup, '.2f'):>7} "
            f"{_figure(r.master_mb_per_step, '.1f'):>8} | "
            f"{_figure(r.predicted_step_s, '.3f'):>11} {error:>7}  {r.note}"
        )
    return "\n".join(lines)


# -- the command ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    mode_lines = "; ".join(
        f"{m.name} ({' '.join(m.flags) or 'no flag'}{', needs ' + m.needs if m.needs else ''})"
        for m in MODES
    )
    p = argparse.ArgumentParser(
        prog="sudo .venv/bin/python benchmarks/testbed.py",
        description=(
            "Scaled cluster testbed (root): the master and every worker in its own network "
            "namespace and CPU cgroup, each process capped at the same fraction of a core (one "
            "BLAS thread), links shaped with tc per node (switched) or through one shared "
            "medium, link rates scaled by the same factor as compute so that the compute-to-"
            "bandwidth ratio is a laptop's on gigabit (switched) or 100 Mbit/s Wi-Fi (shared). "
            "Runs, side by side, the master alone and every mode through the workers, and "
            "prints step times, speedups over the master alone, MB per step on the master's "
            "link and the simulator's prediction."
        ),
        epilog=f"modes: {mode_lines}; all (at once, of these the available ones: "
        f"{' '.join(m.name for m in MODES if m.in_all)})",
    )
    p.add_argument("--network", default="paper-150-800", help="network preset (paper-150-800)")
    p.add_argument("--batch", type=positive(int), default=16, help="images per step (16)")
    p.add_argument(
        "--workers", type=positive(int), nargs="+", default=[4], metavar="N",
        help="worker counts, a testbed each (4)",
    )  # fmt: skip
    p.add_argument(
        "--link", choices=LINK_KINDS, nargs="+", default=[SWITCHED_LINK],
        help="switched: every node's link at the rate each way; shared: one medium that all "
        "traffic shares, between any two nodes, both ways (switched)",
    )  # fmt: skip
    p.add_argument(
        "--cap", type=positive(float), metavar="FRACTION",
        help=f"CPU cap of every process, a fraction of one core (default: {MAX_TOTAL_CAP} / "
        "(workers + 1)); caps together at most "
        f"{MAX_TOTAL_CAP} cores",
    )  # fmt: skip
    p.add_argument(
        "--laptop-gflops", type=positive(float), default=LAPTOP_GFLOPS,
        help=f"what one laptop core computes, GFLOPS ({LAPTOP_GFLOPS:g}; see the module "
        "docstring for why)",
    )  # fmt: skip
    p.add_argument(
        "--core-gflops", type=positive(float),
        help="this machine's core on the network's convolutions, GFLOPS (default: measured at "
        "the start, one BLAS thread, uncapped, per CPU second)",
    )  # fmt: skip
    p.add_argument(
        "--rate-mbit", type=positive(float),
        help="link rate in Mbit/s instead of the scaled one",
    )  # fmt: skip
    p.add_argument(
        "--master-port-unlimited", action="store_true",
        help="switched: leave the master's own port unshaped (only the workers' links limit)",
    )  # fmt: skip
    p.add_argument("--steps", type=positive(int), default=6, help="measured steps per run (6)")
    p.add_argument(
        "--rounds", type=positive(int), default=1,
        help="run the master alone and every mode this many times, alternating, and pool their "
        "steps: drift on a shared machine then hits all alike (1)",
    )  # fmt: skip
    p.add_argument(
        "--warmup", type=int, default=2,
        help="steps left out at the start of every run (2: connections, caches)",
    )  # fmt: skip
    p.add_argument(
        "--modes", nargs="+", default=list(DEFAULT_MODES), metavar="MODE",
        help=f"modes to run through the workers ({' '.join(DEFAULT_MODES)})",
    )  # fmt: skip
    p.add_argument(
        "--speeds", choices=("trace", "probe"), default="trace",
        help="the prediction's node speeds: each run's own per-layer compute_seconds (trace), "
        "or the probe its master ran before training (probe) (trace)",
    )  # fmt: skip
    p.add_argument("--no-link-check", action="store_true", help="skip the bulk TCP check")
    p.add_argument("--keep-traces", metavar="DIR", help="write the runs' traces here")
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    return p


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, or None."""
    if args.warmup < 0:
        return f"--warmup must be >= 0, got {args.warmup}"
    try:
        modes_named(args.modes)
    except ValueError as e:
        return f"--modes: {e}"
    from hetconv.model import PRESETS

    if args.network not in PRESETS:
        return f"--network {args.network!r} is not one of {', '.join(PRESETS)}"
    for workers in args.workers:
        cap = args.cap or MAX_TOTAL_CAP / (workers + 1)
        if cap > 1:
            return f"--cap {cap:g} is more than one core"
        try:
            CpuCap("check", cap)
        except ValueError as e:
            return f"{workers} workers: {e}"
        if cap * (workers + 1) > MAX_TOTAL_CAP + 1e-9:
            return (
                f"--cap {cap:g} x {workers + 1} processes = {cap * (workers + 1):.2f} cores, "
                f"more than {MAX_TOTAL_CAP} of this machine's"
            )
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    wrong = check_arguments(args)
    if wrong:
        print(f"testbed: {wrong}", file=sys.stderr)
        return 2
    for link in args.link:
        why = cluster_testbed_unavailable(link)
        if why is not None:
            print(f"testbed: {why}", file=sys.stderr)
            return 2
    modes, notes = runnable_modes(modes_named(args.modes), train_help())
    for note in notes:
        print(f"testbed: {note}", file=sys.stderr)
    stale = remove_stale(sys.stderr)
    if stale:
        print(f"testbed: removed what a killed run left: {', '.join(stale)}", file=sys.stderr)
    # Both end the run through KeyboardInterrupt, which tears the testbed down.
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    rows: list[Row] = []
    try:
        core = args.core_gflops
        if core is None:
            core = measure_core_gflops(args.network, args.batch)
            print(
                f"this core: {core:.1f} GFLOPS on {args.network} batch {args.batch} convolutions "
                "(cpu backend, one thread, uncapped; per CPU second)",
                file=sys.stderr,
            )
        with tempfile.TemporaryDirectory(prefix="hetconv-testbed-") as scratch:
            folder = Path(args.keep_traces or scratch)
            folder.mkdir(parents=True, exist_ok=True)
            for workers in args.workers:
                for link in args.link:
                    rows += run_configuration(args, workers, link, modes, core, folder)
    except KeyboardInterrupt:
        print("testbed: interrupted; everything it started is removed", file=sys.stderr)
        return 130
    except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as e:
        print(f"testbed: error: {e}", file=sys.stderr)
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print(
        f"{args.network}, batch {args.batch}: step = median of {args.steps} steps after "
        f"{args.warmup} warmup, x {args.rounds} round(s); speedup = master alone (same cap) / "
        f"mode; MB/step = both ways on the master's link; laptop core "
        f"{args.laptop_gflops:g} GFLOPS, this core {rows[0].core_gflops:.1f}"
        if rows
        else "no rows"
    )
    print(format_table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps([asdict(r) for r in rows], indent=1) + "\n", encoding="utf-8"
        )
    return 0


__all__ = [
    "ALL",
    "MODES",
    "Mode",
    "Row",
    "Scale",
    "format_table",
    "main",
    "measure_core_gflops",
    "measured",
    "predict",
    "predict_alone",
    "run_configuration",
    "runnable_modes",
]


if __name__ == "__main__":
    sys.exit(main())
