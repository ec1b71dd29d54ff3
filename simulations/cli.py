"""``hetconv simulate``: predict a cluster's step time from a scenario or a real run's trace.

What the command runs (:func:`run`, with the arguments :mod:`hetconv.cli.simulate` declares)
and says (:func:`describe`, :func:`describe_calibration`); the command line itself, and
``python -m hetconv.cli.simulate`` alone, are :mod:`hetconv.cli.simulate`'s.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

# The simulator itself (protobuf, scipy) is imported when the command runs, not when the
# ``hetconv`` parser is built for another subcommand.

POLICIES = ("compute", "link")  # hetconv.balance.POLICIES; a test keeps them equal
WIRE_FORMATS = ("float32", "float16", "bfloat16")  # hetconv.formats.FORMAT_LABELS; the same

DESCRIPTION = (
    "Predict the step time of a cluster (communication, convolution on the slowest node, the "
    "rest) and its speedup over training on the master alone, from a scenario file or from the "
    "trace of a real run (`hetconv train --trace FILE`), under the paper's compute-only kernel "
    "shares and under link-aware shares. SCENARIO is a shipped scenario's name (see --list) "
    "or a .toml file."
)


# A SCENARIO that is a number or a list of them: the old habit of giving an option several
# values (`--nodes 1 2,4`), which now takes one list.
_VALUES = re.compile(r"^[0-9.,]+$")


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
        elif figure.how:
            shown.append(f"{network} {figure.how}")
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
    from .scenario import shipped_scenarios
    from .sweep import format_bandwidth_checks, format_table, run_scenario

    _paper_modes(args)
    if args.replicate not in ("off", "auto") and args.stages == "unfused":
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
    split = _split(args)
    scenarios = _scenarios(args)
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
            split=split,
            exchange=args.exchange,
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
            "exchange); images-* = hetconv's whole network split by images (--split images; "
            "gradients through the master or a ring among the workers); * = the fastest; a = "
            "the row `hetconv train --split auto` runs (spot checks on)"
        )
    _write_outputs(args, rows)
    return 0


#: ``--paper-modes``: the reference paper's modes (convolutions only, kernels sent every step),
#: in place of ``hetconv train``'s defaults.
PAPER_MODES = {
    "split": "kernels",
    "stages": "unfused",
    "kernels": "sent",
    "replicate": "off",
    "overlap": "off",
    "head": "master",
}


#: The flags of the split by kernels, at their defaults (as `hetconv train` reads them): one
#: given makes ``--split auto`` the split by kernels, and ``--split images`` refuses it.
KERNEL_SPLIT_ONLY = (("wire_format", None), ("stages", "auto"), ("kernels", "auto"),
                     ("replicate", "auto"), ("overlap", "auto"), ("head", "auto"))  # fmt: skip


def _split(args: argparse.Namespace) -> str:
    """The split to simulate, as ``hetconv train`` resolves ``--split`` with workers named:
    ``auto`` is the split by kernels where a flag of the split by kernels is given.

    Raises:
        ValueError: ``--split images`` with a flag of the split by kernels.
    """
    given = [f"--{dest.replace('_', '-')}" for dest, default in KERNEL_SPLIT_ONLY
             if getattr(args, dest, default) != default]  # fmt: skip
    if args.split == "images" and given:
        raise ValueError(f"--split images splits no layer by kernels: drop {given[0]}")
    return "kernels" if given and args.split == "auto" else args.split


def _paper_modes(args: argparse.Namespace) -> None:
    """With ``--paper-modes``, the paper's modes in ``args``; a mode flag given beside it (one
    not at ``hetconv train``'s default, auto) is refused."""
    if not getattr(args, "paper_modes", False):
        return
    given = [
        f"--{dest} {getattr(args, dest)}"
        for dest, mode in PAPER_MODES.items()
        if getattr(args, dest) not in ("auto", mode)
    ]
    if given:
        raise ValueError(
            f"--paper-modes sets the paper's modes; drop {', '.join(given)} or --paper-modes"
        )
    for dest, mode in PAPER_MODES.items():
        setattr(args, dest, mode)


def _scenarios(args: argparse.Namespace) -> list:
    """The scenarios to run: those named, calibrated from ``--from-trace`` when given, with
    the wire format and comp basis the arguments ask for."""
    from .calibrate import calibrate
    from .scenario import load_scenario

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
    else:  # a network without a figure (a .json spec, an .onnx graph): measured here
        from .comptime import with_measured_comp

        log = None if args.quiet else sys.stdout
        scenarios = [with_measured_comp(s, args.network or s.networks, log) for s in scenarios]
    return scenarios


def _write_outputs(args: argparse.Namespace, rows: list) -> None:
    """The rows as ``--json``, ``--csv`` and ``--plot`` ask."""
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
