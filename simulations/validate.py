"""Check the simulator against real training runs over shaped network links.

For every link rate (and worker count) this builds a small real cluster on this machine and
compares the simulator's step time with the measured one:

* **The network**: :class:`~.testbed.Testbed`, one network namespace per worker joined to the
  master (root namespace) by its own veth pair, both ends shaped with a token bucket at the
  rate. The simulator sees a *switched* network: a port per worker, the master's side unlimited.
* **The run.** ``hetconv worker --backend cpu`` inside each namespace (one BLAS thread, as
  :class:`~hetconv.master.launch.LocalWorkers` starts them) and the real master,
  ``hetconv train --worker ... --trace``, in the root namespace, also with one BLAS thread
  unless ``--master-blas-threads`` says otherwise (see below).
* **The prediction**, made without fitting anything to the run's network timings:

  - link: the tc rate as TCP goodput (:func:`~.testbed.tcp_goodput_mbps`: 1448 payload bytes in
    every 1514-byte frame, 0.956 of the rate; a bulk TCP transfer over the shaped link before
    the run checks it), and the idle round trip, ICMP echo before the run;
  - bytes: the cost model's own (:func:`~hetconv.workload.call_bytes`), which
    equal what the trace records (checked when the trace is read);
  - per-call software costs: the loopback figures of the shipped ``this-machine`` scenario
    (benchmarks/transport.py), not this run's;
  - kernel shares: what the master chose (from the trace: configuration, not timing);
  - convolution speed of every node: from the trace's ``compute_seconds`` (``--speeds trace``,
    the default: medians per layer and phase, as :mod:`.calibrate` takes them) or from the probe
    the master ran before training, which the trace's plan record holds (``--speeds probe``,
    :func:`~.trace.read_plan`); compute is not what is being validated. The master's other work
    ("comp") is the trace's mean.

* **What the simulator does not model here**: every process shares this machine's 2 cores. The
  trace's compute figures include that contention; the probe's (one node at a time) do not (the
  "other speeds" column shows what it costs), and neither knows the CPU that gRPC and the
  kernel's network stack take, which begins to matter at 1000 Mbit/s.

What the first runs showed, and what came of it:

* With the master's OpenBLAS on 2 threads (its default here), its own small GEMMs now and then
  took 100-300 ms instead of 2-10 ms: in about a third of the steps of the first runs (-18 %
  at 20 Mbit/s), in none of a later run; a loop of such GEMMs alone showed it too, at times.
  The simulator cannot know that, so the master runs with 1 thread here, as the workers do.
* A streamed call (over 1 MiB) waited while the master computed its own share: the cpu
  backend's GEMMs went through ``scipy.linalg.blas.sgemm`` (f2py), which holds the GIL that the
  call's Python needs to start and for every chunk. That cost 0.33-0.57 of the master's compute
  time per call, at every rate, and the cost model got a term for it
  (:attr:`~hetconv.costmodel.WireCosts.compute_stall`). The backend now calls the
  same sgemm through ctypes, which releases the GIL: the stall is gone (paper-50-500 at batch
  32 over 1000 Mbit/s: 0.58 s per step instead of 0.72 s) and the term defaults to 0.

Measured and predicted step times are means over the run's steps after the first (which opens
connections and warms caches). Needs root, ``ip`` and ``tc``::

    python -m hetconv.simulations.validate [--rates 5 20 100] [--workers 1 2]
        [--preset tiny|paper-50-500] [--batch 16] [--steps N] [--json PATH]

Everything it creates (namespaces, veth pairs, processes) is removed on the way out, also on
Ctrl-C or SIGTERM. Killed outright (SIGKILL), it leaves no process behind and the next run
removes the namespaces and pairs it left (:func:`~.testbed.remove_stale`).
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

from hetconv.argtypes import positive

from .testbed import (
    Testbed,
    remove_stale,
    tcp_goodput_mbps,
    testbed_unavailable,
    with_blas_threads,
)

DEFAULT_RATES = (5.0, 20.0, 100.0)
DEFAULT_WORKERS = (1, 2)
TARGET_ERROR = 0.15  # within 15 % per case


@dataclass
class Case:
    """One validated configuration: its inputs, what was measured and what was predicted."""

    preset: str
    batch: int
    workers: int
    rate_mbps: float
    goodput_mbps: float  # what the prediction assumes
    goodput_measured_mbps: float | None  # a bulk TCP transfer over the idle link
    rtt_ms: float
    steps: int  # measured (the first left out)
    shares: dict[str, list[int]]
    gflops: list[dict[str, float]]  # per node, master first, per layer (what was used)
    speeds: str  # "trace" or "probe"
    measured_s: float
    measured_comm_s: float
    measured_conv_s: float
    measured_comp_s: float
    predicted_s: float
    predicted_comm_s: float
    predicted_conv_s: float
    predicted_s_other_speeds: float | None  # with the other speed source, for contention
    tbf_drops: int
    master_blas_threads: int  # 0: the library's default
    calls: list[dict] = field(default_factory=list)  # per worker call: measured vs predicted

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


# -- the prediction ------------------------------------------------------------------------------


def _gflops_from_probe(probes: dict[str, float], layers) -> dict[str, float]:
    return {
        layer.name: layer.shape.flops_forward * layer.step_passes / probes[layer.name] / 1e9
        for layer in layers
        if probes.get(layer.name) and math.isfinite(probes[layer.name])
    }


def probe_speeds(trace: str, cal, layers) -> list[dict[str, float]]:
    """Per node of ``cal`` (master first) and layer the GFLOPS of the probe the master ran
    before the steps ``cal`` used: the trace's latest plan record at or before the first of
    them (:func:`~.trace.read_plan`). A master that computes nothing has no probe; it gets the
    median of the others (and no kernels).

    Raises:
        ValueError: no plan record (a trace of an older hetconv), or none with a probe figure
            for every node.
    """
    from .trace import read_plan

    plan = read_plan(trace, min(cal.step_numbers) if cal.step_numbers else None)
    probes = plan.probe_seconds()
    missing = [name for name in cal.node_names if name not in probes]
    if missing:
        raise ValueError(f"trace {trace}: the plan record names no node {', '.join(missing)}")
    gflops = [_gflops_from_probe(probes[name], layers) for name in cal.node_names]
    known = [g for per_layer in gflops for g in per_layer.values()]
    if not known:
        raise ValueError(f"trace {trace}: the plan record holds no probe figure")
    return [p or {layer.name: statistics.median(known) for layer in layers} for p in gflops]


def predict(trace: str, rate_mbps: float, rtt_s: float, speeds: str = "trace", wire=None):
    """The simulator's step for the run in ``trace`` on links of ``rate_mbps`` (tc rate) with
    round trip ``rtt_s``. Only the run's shares, compute figures (or probes: ``speeds="probe"``)
    and comp come from the trace.

    Returns (StepResult, per-node layer GFLOPS used, calibration of the trace).
    """
    from hetconv.costmodel import MBIT, SWITCHED, SimCluster, SimNode, simulate_step

    from .calibrate import calibrate
    from .scenario import load_scenario

    cal = calibrate(trace)
    layers = cal.layers()
    if speeds == "probe":
        gflops = probe_speeds(trace, cal, layers)
    elif speeds == "trace":
        gflops = [dict(g) for g in cal.layer_gflops]
    else:
        raise ValueError(f"speeds {speeds!r} is not 'trace' or 'probe'")
    main = max(layers, key=lambda layer: layer.shape.flops_forward).name
    link = MBIT * tcp_goodput_mbps(rate_mbps)
    nodes = [
        SimNode(name, per_layer.get(main) or statistics.mean(per_layer.values()), per_layer)
        for name, per_layer in zip(cal.node_names, gflops, strict=True)
    ]
    # The master's side: one shaped veth per worker, so no capacity shared between workers
    # (an unlimited port; each flow is capped by its worker's link).
    workers = tuple(
        SimNode(n.name, n.gflops, n.layer_gflops, bytes_per_s=link, rtt_s=rtt_s) for n in nodes[1:]
    )
    wire = wire if wire is not None else load_scenario("this-machine").wire
    master_compute = any(split[0] for split in cal.shares.values())
    cluster = SimCluster(nodes[0], workers, SWITCHED, master_compute=master_compute, wire=wire)
    comp = cal.comp_per_image_s * cal.batch
    result = simulate_step(
        cluster, layers, cal.shares, comp, cal.stage_modes, cal.kernel_modes or "sent",
        split_images=cal.replica_split, split_master=cal.split_master,
    )  # fmt: skip
    return result, gflops, cal


def _call_comparison(trace: str, result, cal) -> list[dict]:
    """Per worker call (layer, phase): mean measured wall seconds and the predicted ones."""
    from .calibrate import read_trace

    records = read_trace(trace)
    used = records[1:] if len(records) > 1 else records
    rows = []
    for phase in result.phases:
        workers = [
            name for i, name in enumerate(cal.node_names[1:], start=1) if cal.shares[phase.layer][i]
        ]
        for name, predicted in zip(workers, phase.worker_ends_s, strict=True):
            walls = [r["nodes"][name][phase.layer][phase.phase]["wall_seconds"] for r in used]
            rows.append(
                {
                    "worker": name,
                    "layer": phase.layer,
                    "phase": phase.phase,
                    "measured_s": statistics.mean(walls),
                    "predicted_s": predicted,
                }
            )
    return rows


# -- one case ------------------------------------------------------------------------------------


def _master_timeout(preset: str, batch: int, steps: int, rate_mbps: float) -> float:
    """A generous bound on the run's length, for the master: every call as if one worker had
    every kernel."""
    from hetconv.workload import PHASES, call_bytes, network_layers

    layers = network_layers(preset, batch)
    worst = sum(
        call_bytes(layer, phase, layer.kernels).total for layer in layers for phase in PHASES
    )
    return 180 + 4 * (steps + 2) * worst / (tcp_goodput_mbps(rate_mbps) * 1e6 / 8)


def _train(
    bed: Testbed,
    addresses: list[str],
    arguments: list[str],
    timeout: float,
    master_blas_threads: int,
) -> None:
    """The real master, ``hetconv train`` with ``arguments``, through the testbed's workers."""
    command = [sys.executable, "-I", "-m", "hetconv", "train"]
    for address in addresses:
        command += ["--worker", address]
    env = with_blas_threads(dict(os.environ, HETCONV_TOKEN=bed.token), master_blas_threads)
    master = bed.spawn([*command, *arguments], env)
    try:
        output, _ = master.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the master did not finish within {timeout:.0f} s") from None
    if master.returncode != 0:
        raise RuntimeError(f"the master failed ({master.returncode}):\n{output}")


def run_case(
    preset: str,
    batch: int,
    steps: int,
    workers: int,
    rate_mbps: float,
    speeds: str = "trace",
    trace_dir: str | None = None,
    check_link: bool = True,
    master_blas_threads: int = 1,
    master_compute: bool = True,
) -> Case:
    """Build the testbed, train, predict, tear down. See the module docstring."""
    timeout = _master_timeout(preset, batch, steps, rate_mbps)
    with tempfile.TemporaryDirectory(prefix="hetconv-validate-") as scratch:
        folder = Path(trace_dir) if trace_dir else Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        trace = str(folder / f"{preset}-b{batch}-w{workers}-{rate_mbps:g}mbit.jsonl")
        arguments = [
            "--preset", preset, "--batch", str(batch), "--steps", str(steps),
            "--trace", trace, "--no-progress", "--eval-size", "0",
            "--train-size", str(max(batch * steps, 256)), "--connect-timeout", "60",
        ]  # fmt: skip
        if not master_compute:
            arguments.append("--no-master-compute")
        with Testbed(workers, rate_mbps) as bed:
            rtt = statistics.median(bed.ping(link) for link in bed.links)
            measured_goodput = (
                statistics.mean(bed.goodput_mbps(link) for link in bed.links)
                if check_link
                else None
            )
            addresses = bed.start_workers()
            _train(bed, addresses, arguments, timeout, master_blas_threads)
            drops = bed.tbf_drops()
        result, gflops, cal = predict(trace, rate_mbps, rtt, speeds)
        other = "probe" if speeds == "trace" else "trace"
        try:
            other_s = predict(trace, rate_mbps, rtt, other)[0].step_s
        except ValueError:
            other_s = None
        calls = _call_comparison(trace, result, cal)
    return Case(
        preset=preset,
        batch=batch,
        workers=workers,
        rate_mbps=rate_mbps,
        goodput_mbps=tcp_goodput_mbps(rate_mbps),
        goodput_measured_mbps=measured_goodput,
        rtt_ms=1e3 * rtt,
        steps=cal.steps,
        shares={k: list(v) for k, v in cal.shares.items()},
        gflops=gflops,
        speeds=speeds,
        measured_s=cal.measured["step_s"],
        measured_comm_s=cal.measured["comm_s"],
        measured_conv_s=cal.measured["conv_s"],
        measured_comp_s=cal.measured["comp_s"],
        predicted_s=result.step_s,
        predicted_comm_s=result.comm_s,
        predicted_conv_s=result.conv_s,
        predicted_s_other_speeds=other_s,
        tbf_drops=drops,
        master_blas_threads=master_blas_threads,
        calls=calls,
    )


# -- the table -----------------------------------------------------------------------------------


def format_table(cases: Sequence[Case]) -> str:
    header = (
        f"{'workers':>7} {'Mbit/s':>7} {'goodput':>13} {'rtt ms':>6} | {'measured s':>10} "
        f"{'predicted s':>11} {'error %':>8} | {'comm meas/pred s':>17} {'conv meas/pred s':>17}"
        f" | {'other speeds':>12}"
    )
    lines = [header, "-" * len(header)]
    for c in cases:
        goodput = (
            f"{c.goodput_measured_mbps:.2f}/{c.goodput_mbps:.2f}"
            if c.goodput_measured_mbps is not None
            else f"-/{c.goodput_mbps:.2f}"
        )
        other = (
            f"{100 * (c.predicted_s_other_speeds / c.measured_s - 1):+.1f} %"
            if c.predicted_s_other_speeds
            else "-"
        )
        flag = "" if abs(c.error) <= TARGET_ERROR else " !"
        lines.append(
            f"{c.workers:>7} {c.rate_mbps:>7g} {goodput:>13} {c.rtt_ms:>6.2f} | "
            f"{c.measured_s:>10.3f} {c.predicted_s:>11.3f} {100 * c.error:>+7.1f}{flag:<2}| "
            f"{c.measured_comm_s:>8.3f}/{c.predicted_comm_s:<8.3f} "
            f"{c.measured_conv_s:>8.3f}/{c.predicted_conv_s:<8.3f} | {other:>12}"
        )
    return "\n".join(lines)


def format_calls(case: Case) -> str:
    lines = [f"  {case.workers} worker(s) at {case.rate_mbps:g} Mbit/s, per call (mean wall s):"]
    for row in case.calls:
        lines.append(
            f"    {row['worker']:<18} {row['layer']:<6} {row['phase']:<8} measured "
            f"{row['measured_s']:.4f}  predicted {row['predicted_s']:.4f}  "
            f"({100 * (row['predicted_s'] / row['measured_s'] - 1):+.1f} %)"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hetconv.simulations.validate",
        description=(
            "Run real training over tc-shaped veth links (one network namespace per worker) and "
            "compare the simulator's step time with the measured one. Needs root, ip and tc."
        ),
    )
    p.add_argument(
        "--rates",
        type=positive(float),
        nargs="+",
        default=list(DEFAULT_RATES),
        metavar="MBIT",
        help="link rates (tc tbf, both directions), Mbit/s",
    )
    p.add_argument(
        "--workers",
        type=positive(int),
        nargs="+",
        default=list(DEFAULT_WORKERS),
        metavar="N",
        help="worker counts (one namespace and link each)",
    )
    p.add_argument("--preset", default="tiny", help="network (tiny, paper-50-500, ...)")
    p.add_argument(
        "--batch", type=positive(int), help="images per step (default: 16 for tiny, 8 otherwise)"
    )
    p.add_argument(
        "--steps",
        type=positive(int),
        default=8,
        help="training steps per case (the first is left out of the means)",
    )
    p.add_argument(
        "--speeds",
        choices=("trace", "probe"),
        default="trace",
        help="node convolution speeds from the trace's compute_seconds or the master's probe "
        "(the trace's plan record)",
    )
    p.add_argument(
        "--master-blas-threads",
        type=int,
        default=1,
        metavar="N",
        help="BLAS threads of the master (0: the environment's or the library's default)",
    )
    p.add_argument(
        "--no-master-compute",
        action="store_true",
        help="the master computes no share (which also rules out its streamed calls' waits)",
    )
    p.add_argument(
        "--no-link-check",
        action="store_true",
        help="skip the bulk TCP transfer that checks the goodput assumption",
    )
    p.add_argument("--keep-traces", metavar="DIR", help="write the runs' traces here")
    p.add_argument("--calls", action="store_true", help="also print every worker call")
    p.add_argument("--json", metavar="PATH", help="write the cases as a JSON list")
    return p


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 2:
        print("validate: --steps must be at least 2 (the first is left out)", file=sys.stderr)
        return 2
    why = testbed_unavailable()
    if why is not None:
        print(f"validate: {why}", file=sys.stderr)
        return 2
    batch = args.batch or (16 if args.preset == "tiny" else 8)
    stale = remove_stale(sys.stderr)
    if stale:
        print(f"validate: removed what a killed run left: {', '.join(stale)}", file=sys.stderr)
    # Both end the run through KeyboardInterrupt, which tears the testbed down (SIGINT too: a
    # shell starts background jobs with it ignored, and Python would keep ignoring it).
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    cases: list[Case] = []
    try:
        for workers in args.workers:
            for rate in args.rates:
                what = f"{args.preset} batch {batch}, {workers} worker(s) at {rate:g} Mbit/s"
                print(f"running {what}, {args.steps} steps ...", file=sys.stderr, flush=True)
                case = run_case(
                    args.preset, batch, args.steps, workers, rate, args.speeds,
                    args.keep_traces, check_link=not args.no_link_check,
                    master_blas_threads=args.master_blas_threads,
                    master_compute=not args.no_master_compute,
                )  # fmt: skip
                cases.append(case)
                if args.calls:
                    print(format_calls(case), file=sys.stderr)
    except KeyboardInterrupt:
        print("validate: interrupted; everything it started is removed", file=sys.stderr)
        return 130
    except (RuntimeError, ValueError, OSError) as e:
        print(f"validate: error: {e}", file=sys.stderr)
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print(
        f"{args.preset}, batch {batch}, {args.steps} steps per case (first left out); node speeds "
        f"from the {args.speeds}; goodput = measured bulk TCP / assumed (Mbit/s); "
        "'other speeds' = the error with the other speed source"
    )
    print(format_table(cases))
    worst = max(abs(c.error) for c in cases)
    print(f"largest error {100 * worst:.1f} % (target {100 * TARGET_ERROR:.0f} %)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        rows = [{**asdict(c), "error": c.error} for c in cases]
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


__all__ = [
    "Case",
    "format_calls",
    "format_table",
    "main",
    "predict",
    "probe_speeds",
    "run_case",
]


if __name__ == "__main__":
    sys.exit(main())
