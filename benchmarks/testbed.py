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
flag runs only when ``hetconv train --help-all`` lists it: ``fused`` (``--stages fused``) is
skipped, with a note, until that flag lands, and runs from then on. ``all`` is every available
mode marked ``in_all`` at once.

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

The modes are in ``testbed_modes.py``, the prediction in ``testbed_predict.py`` (beside this
file); every name is importable from here.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The modules beside this one, also where it is loaded by path rather than run.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)

from testbed_modes import (  # noqa: E402
    ALL,
    BASE,
    DEFAULT_MODES,
    EQUAL_SHARES,
    EXACT,
    EXACT_HEAD,
    FABRIC,
    MODES,
    Mode,
    modes_named,
    runnable_modes,
    train_help,
)
from testbed_predict import measured, predict, predict_alone, settled  # noqa: E402
from testbed_scale import (  # noqa: E402
    LAPTOP_GFLOPS,
    LAPTOP_LINK_MBIT,
    MAX_TOTAL_CAP,
    Scale,
    measure_core_gflops,
)

from hetconv.argtypes import positive  # noqa: E402
from hetconv.simulations.cpucap import add_period_flag, apply_period  # noqa: E402
from hetconv.simulations.testbed import (  # noqa: E402
    LINK_KINDS,
    SWITCHED_LINK,
    ClusterTestbed,
    CpuCap,
    cluster_testbed_unavailable,
    remove_stale,
    tcp_goodput_mbps,
)

MASTER_ALONE = "master_alone"


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
    engine = getattr(args, "engine", "cpu")
    if engine != "cpu":  # the master's own share and --local on it; the workers' backend too
        common += ["--engine", engine]
    print(
        f"\n{args.network} batch {args.batch}, {workers} worker(s), {link} link: cap {cap:.3f} "
        f"core per process, scale {scale.factor:.3f} = {cap:.3f} x {core_gflops:.1f} / "
        f"{args.laptop_gflops:g} GFLOPS, rate {rate:.1f} Mbit/s"
        + (" (--rate-mbit)" if args.rate_mbit else f" = {scale.factor:.3f} x "
           f"{scale.laptop_link_mbit:g}"),
        file=log,
        flush=True,
    )  # fmt: skip
    runs = [(MASTER_ALONE, ["--local"])] + [(m.name, m.arguments(link)) for m in modes]
    traces, failures, rtt, cap_received = _run_all(
        args, workers, link, runs, cap, rate, timeout, common, scratch, log, before_teardown
    )
    base = dict(
        network=args.network, batch=args.batch, workers=workers, link=link, rate_mbit=rate,
        laptop_link_mbit=scale.laptop_link_mbit, cap=cap, scale=scale.factor,
        core_gflops=core_gflops, laptop_gflops=args.laptop_gflops, rtt_ms=1e3 * rtt,
        cap_received=cap_received,
    )  # fmt: skip
    return _rows(args, link, modes, traces, failures, base, rate, rtt, cap)


def _run_all(
    args: argparse.Namespace,
    workers: int,
    link: str,
    runs: Sequence[tuple[str, list[str]]],
    cap: float,
    rate: float,
    timeout: float,
    common: list[str],
    scratch: Path,
    log,
    before_teardown: Callable[[ClusterTestbed], None] | None,
) -> tuple[dict[str, list[str]], dict[str, str], float, float]:
    """The testbed for (``workers``, ``link``) with its links and caps checked, and every run
    of ``runs`` (name, flags) in it ``--rounds`` times; returns each run's traces, why a run
    failed (by name), the links' round trip and what the caps gave, over the cap."""
    traces: dict[str, list[str]] = {name: [] for name, _ in runs}
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
        # (idle while the master trains alone)
        addresses = bed.start_workers(backend=getattr(args, "engine", "cpu"))
        connect = ["--connect-timeout", "180"] + [f for a in addresses for f in ("--worker", a)]
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
    return traces, failures, rtt, cap_received


def _rows(
    args: argparse.Namespace,
    link: str,
    modes: Sequence[Mode],
    traces: dict[str, list[str]],
    failures: dict[str, str],
    base: dict,
    rate: float,
    rtt: float,
    cap: float,
) -> list[Row]:
    """The rows of one configuration, the master alone first: each mode's measured step
    (``traces``; a failed one's reason from ``failures``) beside its prediction."""
    rows = []
    local_s, _, local_used = measured(traces[MASTER_ALONE], args.warmup)
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
        note = "; ".join(n for n in (note, settled(traces[mode.name])) if n)
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


def add_engine_flag(p: argparse.ArgumentParser) -> None:
    """``--engine``: hetconv's convolution engine on the testbed (master and workers)."""
    from hetconv.backends import resolve_engine

    p.add_argument(
        "--engine", choices=("auto", "cpu", "onednn"), default="auto",
        type=lambda name: resolve_engine(name)[0],  # auto: named at once, the rows carry it
        help="hetconv's convolution engine: the master's (--engine, --local's too) and the "
        "workers' backend: onednn, cpu, or auto (default: onednn where its library loads, "
        "else cpu). The scale is measured with cpu",
    )  # fmt: skip


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
    add_period_flag(p)
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
    add_engine_flag(p)
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
    apply_period(args)
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
    "BASE",
    "DEFAULT_MODES",
    "EQUAL_SHARES",
    "EXACT",
    "EXACT_HEAD",
    "FABRIC",
    "LAPTOP_GFLOPS",
    "LAPTOP_LINK_MBIT",
    "MASTER_ALONE",
    "MAX_TOTAL_CAP",
    "MODES",
    "Mode",
    "Row",
    "Scale",
    "build_parser",
    "check_arguments",
    "format_table",
    "main",
    "measure_core_gflops",
    "measured",
    "modes_named",
    "predict",
    "predict_alone",
    "run_configuration",
    "runnable_modes",
    "train_help",
]


if __name__ == "__main__":
    sys.exit(main())
