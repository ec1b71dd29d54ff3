"""``hetconv simulate``: predict a cluster's step time from a scenario or a real run's trace.

Wired into the ``hetconv`` command as a subcommand through :func:`add_arguments` and
:func:`run`; :func:`main` runs it alone (``python -m hetconv.simulations.cli``).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

from hetconv.argtypes import positive

# The simulator itself (protobuf, scipy) is imported when the command runs, not when the
# ``hetconv`` parser is built for another subcommand.

MAX_NODES = 4096
POLICIES = ("compute", "link")  # hetconv.balance.POLICIES; a test keeps them equal
WIRE_FORMATS = ("float32", "float16", "bfloat16")  # hetconv.formats.FORMAT_LABELS; the same

DESCRIPTION = (
    "Predict the step time of a cluster (communication, convolution on the slowest node, the "
    "rest) and its speedup over training on the master alone, from a scenario file or from the "
    "trace of a real run (`hetconv train --trace FILE`), under the paper's compute-only kernel "
    "shares and under link-aware shares. SCENARIO is a shipped scenario's name (see --list) "
    "or a .toml file."
)


def _nodes(text: str) -> list[int]:
    """``8``, ``1..32`` (inclusive) or ``1,2,4``."""
    out = []
    for part in text.split(","):
        lo, sep, hi = part.partition("..")
        try:
            values = range(int(lo), int(hi) + 1) if sep else [int(part)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not N, A..B or N,M,...") from None
        for n in values:
            if not 1 <= n <= MAX_NODES:
                raise argparse.ArgumentTypeError(f"{n} nodes: must be 1..{MAX_NODES}")
            out.append(n)
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r} names no cluster size")
    return out


def _listed(kind):
    """An option value that lists one or more ``kind`` values, comma separated (``5,100``)."""

    def parse(text: str) -> list:
        return [kind(part) for part in text.split(",")]

    parse.__name__ = getattr(kind, "__name__", "value")  # what argparse names in an error
    return parse


def _names(text: str) -> list[str]:
    names = [part for part in text.split(",") if part]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names nothing")
    return names


class _DeprecatedNetwork(argparse.Action):
    """``--network``, simulate's old word for the CNN: extends ``--preset`` and says so once."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(
            f"{parser.prog}: note: {option_string} is now --preset (the word `hetconv train` "
            "uses for the network; there --network is the LAN); it will go",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), *values])


# A SCENARIO that is a number or a list of them: the old habit of giving an option several
# values (`--nodes 1 2,4`), which now takes one list.
_VALUES = re.compile(r"^[0-9.,]+$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hetconv simulate``.

    Every option takes one value (a list is comma separated, and an option may be repeated),
    so options and scenarios may come in any order; parse with ``parse_intermixed_args`` for
    scenarios on both sides of an option (:func:`main` and ``hetconv simulate`` do).
    """
    parser.add_argument(
        "scenario",
        nargs="*",
        metavar="SCENARIO",
        help="shipped scenario name or .toml file (several run one after the other)",
    )
    parser.add_argument(
        "--nodes",
        type=_nodes,
        action="extend",
        metavar="N",
        help="cluster sizes, master included: N, A..B or N,M,... (replaces the scenario's; "
        "may be repeated)",
    )
    parser.add_argument(
        "--bandwidth",
        type=_listed(positive(float)),
        action="extend",
        metavar="MBIT",
        help="network bandwidths in Mbit/s, e.g. 5 or 5,100,1000 (Wi-Fi medium or switch "
        "ports); devices that name their own link keep it",
    )
    parser.add_argument(
        "--preset",
        dest="network",
        type=_names,
        action="extend",
        metavar="NAME",
        help="the networks to simulate, as `hetconv train --preset`: presets or .json spec "
        "files, e.g. paper-50-500,paper-500-1500 (replaces the scenario's)",
    )
    parser.add_argument(
        "--network",
        dest="network",
        type=_names,
        action=_DeprecatedNetwork,
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--batch",
        type=_listed(positive(int)),
        action="extend",
        metavar="N",
        help="batch sizes, e.g. 64 or 64,256,1024",
    )
    parser.add_argument(
        "--comp",
        choices=("scenario", "paper"),
        default="scenario",
        help="the master's non-convolutional time: scenario (its [comp] table, or hetconv's "
        "numpy measured on this project's machine) or paper (the reference paper's reported "
        "share of a one-device step: 25 %% for paper-50-500 and 13 %% for paper-500-1500, "
        "interpolated for the other two, at every batch)",
    )
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        action="append",
        help="kernel shares: compute (the paper: w ∝ 1/probe time) or link (link-aware); "
        "default: both",
    )
    parser.add_argument(
        "--wire-format",
        choices=WIRE_FORMATS,
        help="the format of activations on the wire, as `hetconv train --wire-format` "
        "(replaces the scenario's [wire] format; default float32)",
    )
    parser.add_argument(
        "--stages",
        choices=("unfused", "fused", "auto"),
        default="unfused",
        help="how layers with ReLU/LRN/max-pool after them run, as `hetconv train --stages`: "
        "unfused (the paper's: only convolutions on the workers; the default here, so "
        "predictions compare with the paper's), fused (workers run the stage and send pooled "
        "maps), auto (per layer, fewer bytes wins: what `hetconv train` does by default). The "
        "master's other work (comp) is as the scenario or trace says, in every mode",
    )
    parser.add_argument(
        "--kernels",
        choices=("sent", "resident", "auto"),
        default="sent",
        help="whether fused layers' kernels cross the link each step, as `hetconv train "
        "--kernels`: sent (the default here, the paper's), resident (workers keep and update "
        "their slices: halo kernels out, edge kernels back, a sync every 20 steps), auto (per "
        "layer, fewer bytes wins: what `hetconv train` does by default). Needs --stages fused "
        "or auto to matter",
    )
    parser.add_argument(
        "--replicate",
        choices=("off", "first", "split", "split_all"),
        default="off",
        help="first: every node computes the first convolution's block from the images, as "
        "`hetconv train --replicate first` (the second layer's input and input gradient do not "
        "travel; each worker computes the whole first block); split: as first, each worker "
        "computing the block on its share of the images and exchanging the parts with the "
        "others on its own link (shares planned as for first); split_all: as split, with the "
        "master one of the nodes that share the images (its exchange on its port); all need "
        "--stages fused or auto. Default off (the paper's)",
    )
    parser.add_argument(
        "--overlap",
        choices=("off", "on", "auto"),
        default="off",
        help="on: fused layers' worker calls run in image groups, each group's output sent "
        "while the next computes and each group's backward started once its gradient is in, "
        "as `hetconv train --overlap on`; auto: where a worker's answer is over one message "
        "(what `hetconv train` does by default). Default off (the paper's). Needs "
        "--stages fused or auto",
    )
    parser.add_argument(
        "--head",
        choices=("master", "split", "auto"),
        default="master",
        help="split (or auto): the layer whose fused stage feeds the final fully connected "
        "layer directly computes it on the nodes where its kernels are resident (logits "
        "travel instead of pooled maps), as `hetconv train --head split` (what it does by "
        "default); master: the fc on the master. Default master (the paper's)",
    )
    parser.add_argument(
        "--no-data-parallel",
        action="store_true",
        help="leave out the data-parallel rows (dp-ring, dp-ps: every node trains the whole "
        "model on a speed-proportional slice of the batch, gradients summed by ring all-reduce "
        "or on the master, overlapped with backward as PyTorch's DDP does; -seq: after it)",
    )
    parser.add_argument("--plot", metavar="DIR", help="write figures (PNG) into DIR")
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    parser.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    parser.add_argument("--list", action="store_true", help="name the shipped scenarios")
    parser.add_argument(
        "--from-trace",
        metavar="FILE",
        help="calibrate devices (and, without SCENARIO, links) from a `hetconv train --trace` "
        "file and check the simulator against it",
    )
    parser.add_argument(
        "--trace-preset",
        dest="trace_network",
        metavar="NAME",
        help="the network the traced run trained, as its --preset (default: detected from the "
        "trace)",
    )
    parser.add_argument("--trace-network", dest="trace_network", help=argparse.SUPPRESS)
    parser.add_argument(
        "--quiet", action="store_true", help="print only the table, not the assumptions"
    )


def _mbit(value: float | None) -> str:
    return f"{value:g} Mbit/s" if value else "the network's"


def _describe_comp(scenario, networks) -> str:
    """Where the master's non-convolutional time (comp) comes from, per network."""
    from .paper import PAPER_COMP_FRACTIONS
    from .scenario import DEFAULT_COMP_MS_PER_IMAGE

    shown = []
    for network in networks:
        figure = scenario.comp.get(network)
        if scenario.comp_basis == "paper":
            how = "reported" if network in PAPER_COMP_FRACTIONS else "interpolated"
            shown.append(f"{network} {100 * (1 - figure.conv_fraction):.1f} % ({how})")
        elif figure is None:
            per_image = DEFAULT_COMP_MS_PER_IMAGE.get(network)
            shown.append(f"{network} {per_image:g} ms/image (hetconv's numpy, measured here)")
        elif figure.conv_fraction is not None:
            shown.append(f"{network} {100 * (1 - figure.conv_fraction):.1f} % of a local step")
        else:
            fixed = f" + {1e3 * figure.fixed_s:g} ms" if figure.fixed_s else ""
            shown.append(f"{network} {1e3 * (figure.per_image_s or 0):g} ms/image{fixed}")
    if scenario.comp_basis == "paper":
        return (
            "  comp (the master's non-convolutional layers), --comp paper: the paper's share of "
            "a one-CPU step at batch 1024, " + ", ".join(shown) + "; held at every batch, of "
            f"the master's ({scenario.master.name}) own convolution time"
        )
    return "  comp (the master's non-convolutional layers), per step: " + ", ".join(shown)


def describe(scenario, networks=None) -> str:
    """The scenario's inputs in words: what the table rests on (``networks``: the ones run,
    default the scenario's)."""
    from hetconv.costmodel import WIFI

    lines = [f"scenario {scenario.name}: {scenario.description}".rstrip(": ")]
    if scenario.source:
        lines.append(f"  from {scenario.source}")
    if scenario.fabric == WIFI:
        lines.append(
            f"  network: Wi-Fi, one shared half-duplex medium at {scenario.bandwidth_mbps:g} "
            "Mbit/s end to end: every transfer, both directions, shares it"
        )
    else:
        master_port = scenario.master.bandwidth_mbps or scenario.bandwidth_mbps
        lines.append(
            f"  network: switched, full duplex per port, {scenario.bandwidth_mbps:g} Mbit/s ports "
            f"(master {master_port:g} Mbit/s): requests share the master's upstream, answers its "
            "downstream"
        )
    lines.append(f"  round trip master <-> worker: {scenario.latency_ms:g} ms unless a device says")
    m = scenario.master
    lines.append(
        f"  master: {m.name}, {m.gflops:.0f} GFLOPS"
        + ("" if scenario.master_compute else ", computes no share")
    )
    if scenario.workers:
        shown = ", ".join(
            f"{d.name} {d.gflops:.0f}"
            + (f" @{d.bandwidth_mbps:g} Mbit/s" if d.bandwidth_mbps else "")
            for d in scenario.workers[:8]
        )
        more = f" and {len(scenario.workers) - 8} more" if len(scenario.workers) > 8 else ""
        lines.append(f"  workers (GFLOPS): {shown}{more}")
    p = scenario.population
    if p is not None:
        lines.append(
            f"  then workers drawn ~ N(mid, {p.sigma:g} x range) clipped to "
            f"{p.slowest_gflops:.0f}..{p.fastest_gflops:.0f} GFLOPS, seed {p.seed}, link "
            f"{_mbit(p.bandwidth_mbps)}"
        )
    if scenario.layer_efficiency:
        shown = ", ".join(f"{k} x{v:g}" for k, v in scenario.layer_efficiency.items())
        lines.append(f"  layer throughput relative to a device's GFLOPS: {shown}")
    lines.append(_describe_comp(scenario, networks or scenario.networks))
    w = scenario.wire
    lines.append(
        f"  per call: {1e3 * w.bundle_call_s:.2f} ms bundled, {1e3 * w.stream_call_s:.2f} ms "
        f"streamed; master's software moves at most {w.software_bytes_per_s / 1e9:g} GB/s; "
        f"dx parts summed at {w.sum_bytes_per_s / 1e9:g} GB/s; activations on the wire as "
        f"{w.format.label}"
    )
    return "\n".join(lines)


def describe_calibration(cal) -> str:
    """What a trace calibrated, and the simulator against the measured step."""
    lines = [
        f"calibrated from {cal.path}: network {cal.network}, batch {cal.batch}, "
        f"{cal.steps} steps (first left out)"
    ]
    for name, per_layer, link in zip(cal.node_names, cal.layer_gflops, cal.link_mbps, strict=True):
        gflops = ", ".join(f"{k} {v:.1f}" for k, v in per_layer.items())
        where = f", link {link:.0f} Mbit/s" if link else ""
        lines.append(f"  {name}: GFLOPS {gflops}{where}")
    lines.append(
        f"  per call (round trip + software): {1e3 * cal.wire.bundle_call_s:.2f} ms bundled, "
        f"{1e3 * cal.wire.stream_call_s:.2f} ms streamed; comp "
        f"{1e3 * cal.comp_per_image_s:.2f} ms per image"
    )
    for note in cal.notes:
        lines.append(f"  note: {note}")
    check = cal.check()
    shown = "  ".join(
        f"{key[:-2]} {1e3 * cal.measured[key]:.1f} / {1e3 * check[key]:.1f} ms" for key in check
    )
    lines.append(f"  check, traced shares, measured / simulated: {shown}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run ``hetconv simulate`` with parsed arguments; returns the exit status.

    Raises:
        ValueError: a bad scenario, trace or argument (the message names it).
        RuntimeError: ``--plot`` without matplotlib installed (the message says how).
    """
    from .calibrate import calibrate
    from .scenario import load_scenario, shipped_scenarios
    from .sweep import format_bandwidth_checks, format_table, run_scenario

    if args.replicate != "off" and args.stages == "unfused":
        raise ValueError(
            f"--replicate {args.replicate} feeds the second layer, which must run fused: add "
            "--stages fused (or auto)"
        )
    if args.plot:
        from .plots import require_matplotlib

        require_matplotlib()  # before any work, not after it
    if args.list:
        scenarios = shipped_scenarios()
        width = max(map(len, scenarios), default=0)
        for name, description in scenarios.items():
            print(f"{name:<{width}}  {description}")
        return 0
    if not args.scenario and not args.from_trace:
        raise ValueError("name a SCENARIO (see --list) or give --from-trace FILE")
    for name in args.scenario:
        if _VALUES.match(name):
            raise ValueError(
                f"{name!r} is no scenario: an option takes one value, so give several as one "
                "list (--nodes 1,2,4 or 1..8, --batch 64,1024) or repeat the option"
            )
    calibration = None
    if args.from_trace:
        calibration = calibrate(args.from_trace, args.trace_network)
        if not args.quiet:
            print(describe_calibration(calibration), end="\n\n")
    scenarios = [load_scenario(name) for name in args.scenario]
    if calibration is not None:
        scenarios = [calibration.scenario(s) for s in scenarios] or [calibration.scenario()]
    if args.wire_format:
        from hetconv.formats import format_named

        wire = {"format": format_named(args.wire_format)}
        scenarios = [replace(s, wire=replace(s.wire, **wire)) for s in scenarios]
    if args.comp == "paper":
        scenarios = [s.with_paper_comp(args.network or s.networks) for s in scenarios]
    nodes = list(dict.fromkeys(args.nodes)) if args.nodes else None
    rows = []
    for scenario in scenarios:
        got = run_scenario(
            scenario,
            nodes=nodes,
            bandwidths_mbps=args.bandwidth,
            networks=args.network,
            batches=args.batch,
            policies=args.policy,
            stages=args.stages,
            kernels=args.kernels,
            replicate=args.replicate,
            data_parallel=not args.no_data_parallel,
            overlap=args.overlap,
            head=args.head,
        )
        if not args.quiet:
            print(describe(scenario, args.network))
        print(format_table(got), end="\n\n")
        checks = format_bandwidth_checks(got)
        if checks:
            print(checks, end="\n\n")
        rows += got
    if not args.quiet:
        print(
            "step = comm + conv + comp, in the trace's terms: conv is each call's slowest node, "
            "comm the rest of its wall time; speedup is over local training on the master "
            "alone; bound = Amdahl's (local step / comp); dp-* = data parallelism (conv and comp: "
            "its slowest rank's; comm: what the gradient exchange adds; bound: with a free "
            "exchange); * = the fastest"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps([r.as_dict() for r in rows], indent=1) + "\n", encoding="utf-8"
        )
    if args.csv:
        _write_csv(rows, args.csv)
    if args.plot:
        from .plots import plot_all

        written = plot_all(rows, args.plot)
        print(f"{len(written)} figures written to {args.plot}")
    return 0


def _write_csv(rows, path: str) -> None:
    """The rows as CSV, one column per field (shares as JSON)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    records = [r.as_dict() for r in rows]
    fields = list(dict.fromkeys(key for record in records for key in record))
    with open(path, "w", newline="", encoding="utf-8") as out:
        writer = csv.DictWriter(out, fieldnames=fields)
        writer.writeheader()
        for record in records:
            writer.writerow(
                {k: json.dumps(v) if isinstance(v, dict) else v for k, v in record.items()}
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetconv simulate", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``hetconv simulate`` alone: parse ``argv``, run, and turn bad input into one line."""
    args = build_parser().parse_intermixed_args(argv)
    try:
        return run(args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"hetconv simulate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
