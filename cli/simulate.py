"""``hetconv simulate``: its flags (the mode flags from :mod:`.modes`, with ``hetconv train``'s
defaults, and ``--paper-modes`` for the paper's) and :func:`main`, the command alone (``python
-m hetconv.cli.simulate``); what it runs is :func:`hetconv.simulations.cli.run`."""

from __future__ import annotations

import argparse
import sys

from hetconv.argtypes import positive
from hetconv.simulations.cli import DESCRIPTION, PAPER_MODES, POLICIES, run

from .common import HelpFormatter
from .modes import TRAIN_DEFAULTS, add_mode_flags, add_model_flag

MAX_NODES = 1024

#: The mode flags simulate takes; their defaults are train's, so that a prediction describes
#: the run `hetconv train` makes (a test keeps them equal).
MODE_DESTS = ("split", "exchange", "stages", "kernels", "replicate", "overlap", "head")
DEFAULTS = {**{dest: TRAIN_DEFAULTS[dest] for dest in MODE_DESTS}, "wire_format": None}
#: The mode flags' choices here, in the order simulate has always listed them.
_CHOICES = {
    "split": ("auto", "kernels", "images"),
    "exchange": ("auto", "master", "ring"),
    "stages": ("unfused", "fused", "auto"),
    "kernels": ("sent", "resident", "auto"),
    "replicate": ("off", "first", "split", "split_all", "auto"),
    "overlap": ("off", "on", "auto"),
    "head": ("master", "split", "auto"),
}
#: What simulate adds to the mode flags' meaning.
_NOTES = {
    "split": "here auto simulates both splits and marks (a) the row train would run; with a flag "
    "of the split by kernels given (--stages, --kernels, --replicate, --overlap, --head, "
    "--wire-format, --paper-modes) the split by kernels, as train",
    "exchange": "which image-split rows are simulated (auto: both)",
    "wire_format": "replaces the scenario's [wire] format; default float32",
    "stages": "the master's other work (comp) is as the scenario or trace says, in every mode",
    "kernels": "resident counts halo kernels out, edge kernels back and a sync every 20 steps",
    "replicate": "split's shares are planned as for first",
}


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hetconv simulate``.

    Every option takes one value (a list is comma separated, and an option may be repeated),
    so options and scenarios may come in any order; parse with ``parse_intermixed_args`` for
    scenarios on both sides of an option (:func:`main` and ``hetconv simulate`` do).
    """
    _add_cluster(parser)
    add_mode_flags(parser, DEFAULTS, choices=_CHOICES, notes=_NOTES)
    parser.add_argument(
        "--paper-modes",
        action="store_true",
        help="predict the reference paper's way of running instead of `hetconv train`'s "
        "defaults: "
        + " ".join(f"--{dest} {mode}" for dest, mode in PAPER_MODES.items())
        + " (a mode flag beside it is refused)",
    )
    _add_outputs(parser)


def _add_cluster(parser: argparse.ArgumentParser) -> None:
    """The scenarios and what of them to vary: nodes, bandwidths, networks, batches, the
    master's other work and the share policies."""
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
    add_model_flag(
        parser,
        dest="network",
        type=_names,
        action="extend",
        help="the networks to simulate, as `hetconv train --model` takes one: presets, .json "
        "specs or .onnx graphs, e.g. paper-50-500,paper-500-1500 (replaces the scenario's; "
        "--preset is its other name)",
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
        "numpy measured on this project's machine for a preset, or here and now, in a few "
        "local steps, for a .json or .onnx network) or paper (the reference paper's reported "
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


def _add_outputs(parser: argparse.ArgumentParser) -> None:
    """The data-parallel rows, the outputs, and the trace to calibrate from."""
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
        help="the network the traced run trained, as its --model, where the trace should not "
        "say (default: the one its plan record names; a trace of an older hetconv: the preset "
        "that matches it)",
    )
    parser.add_argument("--trace-network", dest="trace_network", help=argparse.SUPPRESS)
    parser.add_argument(
        "--quiet", action="store_true", help="print only the table, not the assumptions"
    )


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="predict a larger cluster's step time and speedup",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
        intermixed=True,
    )
    add_arguments(p)
    p.set_defaults(func=run)


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
