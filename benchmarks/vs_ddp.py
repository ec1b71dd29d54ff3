"""hetconv against heterogeneous data parallelism (PyTorch DDP) on the scaled testbed (root).

The peer a user with spare laptops would try first: every machine holds the whole model,
trains it on a slice of the global batch proportional to its measured speed, and the
gradients are averaged with weights equal to the slices' shares of the batch (exact: the same
step as one process on the whole batch; ``benchmarks/ddp_rank.py`` does it, and a test proves
it). Per (network, batch, workers, link), side by side on the testbed of
``benchmarks/testbed.py`` (same namespaces, CPU caps, shaped links, one BLAS / intra-op thread
per process, same scaling of compute and links to laptops):

1. **hetconv**: :func:`testbed.run_configuration` with one mode of its :data:`testbed.MODES`
   (``--mode``, default ``all``: every offered mode at once, hetconv's best), which also runs
   the master alone (``hetconv train --local``) at the same cap.
2. **DDP**, in a testbed built the same way: a single torch process on the whole batch in the
   master's namespace and cap (torch alone), then rank 0 in the master's namespace and ranks
   1..N in the workers', gloo over the bridge; every rank first times a few local steps on
   ``batch / (N + 1)`` images (all at once, under their caps), the global batch is split by
   those speeds (largest remainder), and DDP trains.
3. **The simulator** predicts both: hetconv's step as ``benchmarks/testbed.py`` does
   (:func:`testbed.predict`), DDP's with :func:`hetconv.dataparallel.simulate_data_parallel`
   (ring all-reduce as gloo runs it, bucketed overlap as DDP does) from the ranks' probed
   speeds, the testbed's link rate (TCP goodput) and round trip, and the collective's software
   costs scaled by ``1 / cap``.

A row: both step times (median of the steps after ``--warmup``), ``ratio`` = hetconv / DDP
(below 1: hetconv is faster), each engine alone on the same cap (hetconv's engine, oneDNN by
default or numpy with ``--engine cpu``, and torch's own may differ: ``hetconv_alone_s`` against
``torch_alone_s`` is the engines, each one's speedup over its own alone is the strategy), the
predicted steps, the winner predicted and measured among hetconv, DDP and one machine (the
faster engine alone), and the peak resident memory (``VmHWM``) of each scheme's worker
processes: a hetconv worker holds its kernel slices and the maps of a call, a DDP rank the
whole model, its gradients, optimizer state and activations.

Example (on this 2-core machine about 7 minutes for paper-50-500's eight configurations, 20
for paper-500-1500's at batch 16, 45 at batch 64, mostly the engines alone and DDP on the
shared medium)::

    sudo .venv/bin/python benchmarks/vs_ddp.py --network paper-50-500 paper-500-1500 \\
        --batch 16 64 --workers 2 4 --link switched shared --json vs_ddp.json

On networks with batch norm DDP's ranks each normalise their own slice of the batch: a
different model from hetconv's and one process's. ``--ddp-synced-batchnorm`` runs DDP a second
time with the batch's statistics summed over the ranks (the same model; a test proves its step
equals one process's), its step in the row's note and in ``ddp_synced_step_s``.

The hetconv runs and the DDP runs of a configuration follow each other in two testbeds built
alike, not interleaved: on a machine others load, drift between them enters the ratio (the
rows' ``cap_received`` says what the caps gave the hetconv runs).
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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import testbed as hetconv_testbed  # benchmarks/testbed.py (this folder is on sys.path)

from hetconv.argtypes import positive
from hetconv.simulations.testbed import (
    LINK_KINDS,
    SWITCHED_LINK,
    ClusterTestbed,
    cluster_testbed_unavailable,
    finished_output,
    remove_stale,
    tcp_goodput_mbps,
    with_blas_threads,
)

RANK_PROGRAM = Path(__file__).with_name("ddp_rank.py")
DDP_PORT = 29500
HETCONV, DDP, ONE_MACHINE = "hetconv", "ddp", "one machine"


@dataclass
class Comparison:
    """One configuration: hetconv's mode against DDP, measured and predicted."""

    network: str
    batch: int
    workers: int
    link: str  # switched / shared
    mode: str  # hetconv's mode (benchmarks/testbed.py MODES)
    hetconv_step_s: float | None
    ddp_step_s: float | None
    ratio: float | None  # hetconv / ddp
    predicted_winner: str | None
    measured_winner: str | None
    hetconv_alone_s: float | None  # hetconv train --local, same cap
    torch_alone_s: float | None  # one torch process, same cap, whole batch
    hetconv_speedup: float | None  # over hetconv alone
    ddp_speedup: float | None  # over torch alone
    hetconv_predicted_s: float | None
    ddp_predicted_s: float | None
    ddp_prediction_error: float | None  # predicted / measured - 1
    hetconv_alone_predicted_s: float | None
    torch_alone_predicted_s: float | None
    hetconv_worker_mb: float | None  # peak RSS (VmHWM), the largest worker process
    ddp_worker_mb: float | None  # the same for DDP ranks 1..N
    ddp_rank0_mb: float | None
    torch_alone_mb: float | None
    ddp_batches: list[int] = field(default_factory=list)
    ddp_images_per_s: list[float] = field(default_factory=list)  # each rank's probe
    ddp_master_mb_per_step: float | None = None  # gradients on the master's link (model)
    hetconv_master_mb_per_step: float | None = None
    rate_mbit: float = 0.0
    cap: float = 0.0
    scale: float = 0.0
    core_gflops: float = 0.0
    rtt_ms: float = 0.0
    cap_received: float = 0.0
    engine: str = "cpu"  # hetconv's convolution engine (--engine)
    note: str = ""
    ddp_synced_step_s: float | None = None  # --ddp-synced-batchnorm: DDP training hetconv's model
    ddp_synced_speedup: float | None = None  # over torch alone
    ddp_synced_predicted_s: float | None = None


# -- DDP on the testbed --------------------------------------------------------------------------


@dataclass
class DdpRun:
    step_s: float
    batches: list[int]
    images_per_s: list[float]
    alone_s: float | None
    alone_mb: float | None
    rank_mb: list[float]
    rtt_s: float


def _last_json(output: str, what: str) -> dict:
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = "\n".join(output.splitlines()[-20:])
    raise RuntimeError(f"{what} printed no result:\n{tail}")


def _finish(process: subprocess.Popen, timeout: float, what: str) -> dict:
    return _last_json(finished_output(process, timeout, what, tail_lines=20), what)


def _timeout(network: str, batch: int, steps: int, cap: float, core: float, rate: float):
    """A generous bound on one run: start-up, and every step as if one process computed it
    at a third of the cap's speed and also sent every gradient twice over the link."""
    from hetconv.dataparallel import parameter_bytes
    from hetconv.model import load_spec
    from hetconv.workload import network_layers

    flops = sum(ly.shape.flops_forward * ly.step_passes for ly in network_layers(network, batch))
    wire = 4 * parameter_bytes(load_spec(network))
    step = 3 * flops / (cap * core * 1e9) + wire / (tcp_goodput_mbps(rate) * 1e6 / 8)
    return 300 + 3 * steps * step


def run_ddp(
    args: argparse.Namespace, workers: int, link: str, cap: float, rate: float, core: float, log,
    synced: bool = False,
) -> DdpRun:  # fmt: skip
    """Torch alone, then DDP over every node, in a testbed like hetconv's; ``synced``: DDP
    with batch norm over the whole batch (``ddp_rank.py --synced-batchnorm``), no torch
    alone."""
    steps = args.warmup + args.steps
    timeout = _timeout(args.network, args.batch, steps + 3, cap, core, rate)
    env = with_blas_threads(dict(os.environ, PYTHONUNBUFFERED="1"), 1)
    base = [sys.executable, "-I", str(RANK_PROGRAM), "--network", args.network,
            "--batch", str(args.batch), "--steps", str(steps)]  # fmt: skip
    base += ["--synced-batchnorm"] if synced else []
    alone = None
    with ClusterTestbed(workers, link, rate, cap, not args.master_port_unlimited) as bed:
        rtt = statistics.median(bed.ping(host) for host in bed.worker_hosts)
        if not synced:
            print("  torch alone ...", file=log, flush=True)
            alone = _finish(bed.spawn([*base, "--alone"], env, bed.master), timeout, "torch alone")
        world = workers + 1
        print(f"  ddp, {world} ranks{', batch norm synced' if synced else ''} ...", file=log,
              flush=True)  # fmt: skip
        ranks = [
            bed.spawn(
                [
                    *base,
                    "--world",
                    str(world),
                    "--rank",
                    str(rank),
                    "--master-addr",
                    bed.master.ip,
                    "--port",
                    str(DDP_PORT),
                    "--ifname",
                    host.interface,
                ],
                env,
                host,
            )  # fmt: skip
            for rank, host in enumerate(bed.hosts)
        ]
        results = [_finish(p, timeout, f"ddp rank {i}") for i, p in enumerate(ranks)]
    measured = results[0]["step_s"][args.warmup :]
    return DdpRun(
        step_s=statistics.median(measured),
        batches=results[0]["batches"],
        images_per_s=results[0]["speeds"],
        alone_s=statistics.median(alone["step_s"][args.warmup :]) if alone else None,
        alone_mb=alone["peak_rss_mb"] if alone else None,
        rank_mb=[r["peak_rss_mb"] for r in results],
        rtt_s=rtt,
    )


def predict_ddp(args: argparse.Namespace, link: str, rate: float, cap: float, core: float,
                run: DdpRun, synced: bool = False):  # fmt: skip
    """The simulator's DDP step for ``run``: ring all-reduce, bucketed overlap, the ranks'
    probed speeds and slices, the testbed's links (TCP goodput) and round trip, the
    collective's software costs at ``cap``; ``synced``: batch norm's statistics summed over
    the ranks. Returns the DataParallelResult."""
    from hetconv.costmodel import MBIT, SWITCHED, WIFI, SimCluster, SimNode, local_step_seconds
    from hetconv.dataparallel import RING, CollectiveCosts, simulate_data_parallel
    from hetconv.workload import network_layers

    goodput = MBIT * tcp_goodput_mbps(rate)
    gflops = cap * core
    workers = tuple(
        SimNode(f"w{i}", gflops, bytes_per_s=goodput if link == SWITCHED_LINK else math.inf,
             rtt_s=run.rtt_s)
        for i in range(len(run.batches) - 1)
    )  # fmt: skip
    if link == SWITCHED_LINK:
        port = math.inf if args.master_port_unlimited else goodput
        cluster = SimCluster(SimNode("master", gflops, bytes_per_s=port), workers, SWITCHED)
    else:
        cluster = SimCluster(SimNode("master", gflops), workers, WIFI, goodput)
    # The profile's split between convolutions and the rest (it times the overlap only; the
    # totals are the probed speeds): torch alone's step less its modelled convolutions.
    conv = local_step_seconds(cluster.master, network_layers(args.network, args.batch), 0.0)
    comp = max(0.0, run.alone_s - conv)
    return simulate_data_parallel(
        cluster,
        args.network,
        args.batch,
        comp,
        RING,
        overlap=True,
        costs=CollectiveCosts().scaled(cap),
        image_seconds=[1 / s for s in run.images_per_s],
        batches=run.batches,
        synced_batchnorm=synced,
    )


def _peak_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def winner(hetconv: float | None, ddp: float | None, alone: Sequence[float | None]):
    """The fastest of hetconv, DDP and one machine (the faster engine alone); None when a
    figure is missing."""
    if hetconv is None or ddp is None or not alone or any(v is None for v in alone):
        return None
    figures = {HETCONV: hetconv, DDP: ddp, ONE_MACHINE: min(alone)}
    return min(figures, key=lambda k: figures[k])


# -- a configuration -----------------------------------------------------------------------------


def _synced_ddp(args, workers, link, cap, rate, core, log, run: DdpRun | None, notes: list):
    """With ``--ddp-synced-batchnorm``: (DDP's step with batch norm synced, its prediction),
    each None where not run or failed; a line about it in ``notes``."""
    if not getattr(args, "ddp_synced_batchnorm", False):
        return None, None
    try:
        synced = run_ddp(args, workers, link, cap, rate, core, log, synced=True).step_s
    except RuntimeError as e:
        notes.append(f"ddp with synced batch norm failed: {str(e).splitlines()[0]}")
        return None, None
    predicted = predict_ddp(args, link, rate, cap, core, run, True).step_s if run else None
    against = (
        f" ({run.alone_s / synced:.2f}x torch alone, predicted {predicted:.3f} s)" if run else ""
    )
    notes.append(f"ddp with synced batch norm {synced:.3f} s{against}")
    return synced, predicted


def compare(args, workers: int, link: str, mode, core: float, scratch: Path, log=sys.stderr):
    """hetconv's ``mode`` and DDP for (``workers``, ``link``): a :class:`Comparison`."""
    cap = args.cap or hetconv_testbed.MAX_TOTAL_CAP / (workers + 1)
    scale = hetconv_testbed.Scale(
        cap, core, args.laptop_gflops, hetconv_testbed.LAPTOP_LINK_MBIT[link]
    )
    rate = args.rate_mbit or scale.rate_mbit
    bed_args = argparse.Namespace(
        network=args.network, batch=args.batch, cap=cap, laptop_gflops=args.laptop_gflops,
        rate_mbit=args.rate_mbit, warmup=args.warmup, steps=args.steps, rounds=1,
        no_link_check=True, master_port_unlimited=args.master_port_unlimited, speeds="trace",
        engine=getattr(args, "engine", "cpu"),
    )  # fmt: skip
    memory: list[float] = []

    def worker_memory(bed: ClusterTestbed) -> None:
        memory.extend(m for w in bed.workers if (m := _peak_mb(w.process.pid)) is not None)

    rows = hetconv_testbed.run_configuration(
        bed_args, workers, link, [mode], core, scratch, log, before_teardown=worker_memory
    )
    alone, ours = rows[0], rows[1]
    notes = [ours.note] if ours.note else []
    try:
        run = run_ddp(args, workers, link, cap, rate, core, log)
    except RuntimeError as e:
        run = None
        notes.append(f"ddp failed: {str(e).splitlines()[0]}")
    synced, synced_predicted = _synced_ddp(args, workers, link, cap, rate, core, log, run, notes)
    predicted = predict_ddp(args, link, rate, cap, core, run) if run else None
    ddp_s = run.step_s if run else None
    torch_alone_pred = (
        args.batch / run.images_per_s[0] if run and run.images_per_s else None
    )  # (rank 0's probe, all ranks probing at once)
    return Comparison(
        engine=args.engine,
        network=args.network,
        batch=args.batch,
        workers=workers,
        link=link,
        mode=mode.name,
        hetconv_step_s=ours.step_s,
        ddp_step_s=ddp_s,
        ratio=ours.step_s / ddp_s if ours.step_s and ddp_s else None,
        predicted_winner=winner(
            ours.predicted_step_s,
            predicted.step_s if predicted else None,
            [alone.predicted_step_s, torch_alone_pred],
        ),
        measured_winner=winner(ours.step_s, ddp_s, [alone.step_s, run.alone_s if run else None]),
        hetconv_alone_s=alone.step_s,
        torch_alone_s=run.alone_s if run else None,
        hetconv_speedup=ours.speedup,
        ddp_speedup=run.alone_s / ddp_s if run else None,
        hetconv_predicted_s=ours.predicted_step_s,
        ddp_predicted_s=predicted.step_s if predicted else None,
        ddp_prediction_error=predicted.step_s / ddp_s - 1 if predicted and ddp_s else None,
        hetconv_alone_predicted_s=alone.predicted_step_s,
        torch_alone_predicted_s=torch_alone_pred,
        hetconv_worker_mb=max(memory, default=None),
        ddp_worker_mb=max(run.rank_mb[1:]) if run else None,
        ddp_rank0_mb=run.rank_mb[0] if run else None,
        torch_alone_mb=run.alone_mb if run else None,
        ddp_batches=run.batches if run else [],
        ddp_images_per_s=run.images_per_s if run else [],
        ddp_master_mb_per_step=predicted.master_bytes / 1e6 if predicted else None,
        hetconv_master_mb_per_step=ours.master_mb_per_step,
        rate_mbit=rate,
        cap=cap,
        scale=scale.factor,
        core_gflops=core,
        rtt_ms=ours.rtt_ms,
        cap_received=ours.cap_received,
        note="; ".join(notes),
        ddp_synced_step_s=synced,
        ddp_synced_speedup=run.alone_s / synced if run and synced else None,
        ddp_synced_predicted_s=synced_predicted,
    )


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: Sequence[Comparison]) -> str:
    header = (
        f"{'network':<15} {'batch':>5} {'wk':>2} {'link':<8} {'Mbit/s':>6} | {'hetconv':>7} "
        f"{'ddp':>7} {'ratio':>5} | {'het 1':>6} {'torch 1':>7} | {'pred het':>8} "
        f"{'pred ddp':>8} {'err %':>6} | {'winner pred / measured':<27} | {'MB/worker h/d':>13}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        error = "-" if r.ddp_prediction_error is None else f"{100 * r.ddp_prediction_error:+.1f}"
        match = "" if r.predicted_winner is None else (
            " ok" if r.predicted_winner == r.measured_winner else " MISS"
        )  # fmt: skip
        lines.append(
            f"{r.network:<15} {r.batch:>5} {r.workers:>2} {r.link:<8} {r.rate_mbit:>6.1f} | "
            f"{_f(r.hetconv_step_s, '.3f'):>7} {_f(r.ddp_step_s, '.3f'):>7} "
            f"{_f(r.ratio, '.2f'):>5} | {_f(r.hetconv_alone_s, '.3f'):>6} "
            f"{_f(r.torch_alone_s, '.3f'):>7} | {_f(r.hetconv_predicted_s, '.3f'):>8} "
            f"{_f(r.ddp_predicted_s, '.3f'):>8} {error:>6} | "
            f"{(r.predicted_winner or '-') + ' / ' + (r.measured_winner or '-') + match:<27} | "
            f"{_f(r.hetconv_worker_mb, '.0f'):>6}/{_f(r.ddp_worker_mb, '.0f'):<6}"
            + (f"  {r.note}" if r.note else "")
        )
    return "\n".join(lines)


# -- the command ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sudo .venv/bin/python benchmarks/vs_ddp.py",
        description=(
            "hetconv against heterogeneous data parallelism (PyTorch DDP over gloo: every node "
            "holds the whole model and trains a slice of the batch proportional to its "
            "measured speed, gradients weighted by batch share, exact) on the scaled testbed "
            "of benchmarks/testbed.py (root): the master and every worker in its own network "
            "namespace and CPU cgroup, one thread per process, links shaped as switched "
            "gigabit or a shared Wi-Fi-like medium, scaled with compute. Per configuration: "
            "step times of hetconv's mode and of DDP, each engine alone on the same cap, the "
            "simulator's predictions and winner, and each scheme's peak worker memory."
        ),
        epilog="ratio = hetconv / ddp (below 1: hetconv faster); one machine = the faster "
        "engine alone at the same cap. Needs root, ip, tc, the cgroup v1 cpu controller, and "
        "PyTorch (the dev extra).",
    )
    p.add_argument(
        "--network", nargs="+", default=["paper-50-500"], metavar="PRESET",
        help="network presets (paper-50-500)",
    )  # fmt: skip
    p.add_argument(
        "--batch", type=positive(int), nargs="+", default=[16], metavar="N",
        help="global batch sizes (16)",
    )  # fmt: skip
    p.add_argument(
        "--workers", type=positive(int), nargs="+", default=[2], metavar="N",
        help="worker counts; DDP runs N + 1 ranks, the master's machine one of them (2)",
    )  # fmt: skip
    p.add_argument(
        "--link", choices=LINK_KINDS, nargs="+", default=list(LINK_KINDS),
        help="switched: every node's link at the rate each way; shared: one medium every "
        "packet passes (both)",
    )  # fmt: skip
    p.add_argument(
        "--mode",
        default=hetconv_testbed.ALL,
        help="hetconv's mode, a name of benchmarks/testbed.py's modes (all: every offered one "
        "at once, its best)",
    )
    p.add_argument(
        "--cap", type=positive(float), metavar="FRACTION",
        help=f"CPU cap of every process (default {hetconv_testbed.MAX_TOTAL_CAP} / "
        "(workers + 1))",
    )  # fmt: skip
    p.add_argument(
        "--laptop-gflops", type=positive(float), default=hetconv_testbed.LAPTOP_GFLOPS,
        help=f"one laptop core, GFLOPS ({hetconv_testbed.LAPTOP_GFLOPS:g})",
    )  # fmt: skip
    p.add_argument(
        "--core-gflops", type=positive(float),
        help="this machine's core, GFLOPS (default: measured per network and batch)",
    )  # fmt: skip
    p.add_argument("--rate-mbit", type=positive(float), help="link rate instead of the scaled")
    p.add_argument(
        "--master-port-unlimited", action="store_true",
        help="switched: leave the master's own port unshaped",
    )  # fmt: skip
    p.add_argument("--steps", type=positive(int), default=4, help="measured steps per run (4)")
    p.add_argument("--warmup", type=int, default=1, help="steps left out at each start (1)")
    p.add_argument(
        "--ddp-synced-batchnorm", action="store_true",
        help="also run DDP with batch norm over the whole batch (ddp_rank.py "
        "--synced-batchnorm: the same model as hetconv's and one process's; DDP's ranks "
        "otherwise each normalise their own slice), its step in the row's note",
    )  # fmt: skip
    hetconv_testbed.add_engine_flag(p)
    hetconv_testbed.add_period_flag(p)
    p.add_argument("--keep-traces", metavar="DIR",
                   help="write hetconv's traces here, a folder per network and batch")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    return p


def check_arguments(args: argparse.Namespace):
    """(what is wrong or None, the hetconv mode)."""
    from hetconv.model import PRESETS

    if args.warmup < 0:
        return f"--warmup must be >= 0, got {args.warmup}", None
    for network in args.network:
        if network not in PRESETS:
            return f"--network {network!r} is not one of {', '.join(PRESETS)}", None
    for batch in args.batch:
        for workers in args.workers:
            if batch < workers + 1:
                return (
                    f"--batch {batch} is less than {workers + 1} ranks: every DDP rank needs "
                    "an image"
                ), None
    try:
        hetconv_testbed.modes_named([args.mode])
    except ValueError as e:
        return f"--mode: {e}", None
    modes, notes = hetconv_testbed.runnable_modes([args.mode], hetconv_testbed.train_help())
    if not modes:
        return f"--mode {args.mode}: {'; '.join(notes)}", None
    for workers in args.workers:
        cap = args.cap or hetconv_testbed.MAX_TOTAL_CAP / (workers + 1)
        if cap * (workers + 1) > hetconv_testbed.MAX_TOTAL_CAP + 1e-9 or cap > 1:
            return (
                f"--cap {cap:g} x {workers + 1} processes is more than "
                f"{hetconv_testbed.MAX_TOTAL_CAP} cores"
            ), None
    try:
        import torch  # noqa: F401
    except ImportError:
        return "needs PyTorch for the DDP runs: pip install -e '.[dev]'", None
    return None, modes[0]


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    hetconv_testbed.apply_period(args)
    wrong, mode = check_arguments(args)
    if wrong:
        print(f"vs_ddp: {wrong}", file=sys.stderr)
        return 2
    for link in args.link:
        why = cluster_testbed_unavailable(link)
        if why is not None:
            print(f"vs_ddp: {why}", file=sys.stderr)
            return 2
    remove_stale(sys.stderr)
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    rows: list[Comparison] = []
    try:
        with tempfile.TemporaryDirectory(prefix="hetconv-vs-ddp-") as scratch:
            folder = Path(args.keep_traces or scratch)
            folder.mkdir(parents=True, exist_ok=True)
            for network in args.network:
                for batch in args.batch:
                    one = argparse.Namespace(**{**vars(args), "network": network, "batch": batch})
                    core = args.core_gflops or hetconv_testbed.measure_core_gflops(network, batch)
                    print(f"{network} batch {batch}: this core {core:.1f} GFLOPS", file=sys.stderr)
                    for workers in args.workers:
                        for link in args.link:
                            where = folder / f"{network}-b{batch}" if args.keep_traces else folder
                            where.mkdir(parents=True, exist_ok=True)  # (one folder a config)
                            rows.append(compare(one, workers, link, mode, core, where))
                            print(format_table(rows[-1:]).splitlines()[-1], file=sys.stderr)
                            if args.json:  # (after every row: a long run keeps what it has)
                                _write(args.json, rows)
    except KeyboardInterrupt:
        print("vs_ddp: interrupted; everything it started is removed", file=sys.stderr)
        return 130
    except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as e:
        print(f"vs_ddp: error: {e}", file=sys.stderr)
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print(
        f"step = median of {args.steps} steps after {args.warmup} warmup; hetconv = mode "
        f"{args.mode}; het 1 / torch 1 = each engine alone at the same cap; err = predicted "
        "ddp / measured - 1; MB/worker = peak RSS of the largest worker process, hetconv / ddp"
    )
    print(format_table(rows))
    if args.json:
        _write(args.json, rows)
    return 0


def _write(path: str, rows: Sequence[Comparison]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n", "utf-8")


__all__ = ["Comparison", "compare", "format_table", "main", "predict_ddp", "run_ddp", "winner"]


if __name__ == "__main__":
    sys.exit(main())
