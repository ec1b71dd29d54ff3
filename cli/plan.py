"""``hetconv plan``: its flags (``--network`` from :mod:`.modes`); what it runs is
:func:`hetconv.simulations.plan.run`."""

from __future__ import annotations

import argparse

from hetconv.argtypes import positive_float, positive_int
from hetconv.simulations.plan import DESCRIPTION, run
from hetconv.training import TrainConfig

from .common import HelpFormatter
from .modes import add_mode_flags, add_model_flag, model_help

#: Which GFLOPS figure --master and --worker take (the same probe the worker prints at start).
PROBE_FIGURE = (
    "the GFLOPS `hetconv devices` prints for its device (the probe: paper-50-500's C2 at batch "
    "8, forward and backward), measured on an otherwise idle machine; `hetconv worker` prints "
    "the same probe at start, lower when other work shares its cores"
)


def _device(text: str) -> tuple[float, float | None]:
    """``GFLOPS`` or ``GFLOPS@MBIT``."""
    speed, _, link = text.partition("@")
    try:
        gflops, mbit = float(speed), (float(link) if link else None)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not GFLOPS or GFLOPS@MBIT (e.g. 45 or 45@100)"
        ) from None
    if not gflops > 0 or (mbit is not None and not mbit > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: GFLOPS and Mbit/s must be positive")
    return gflops, mbit


def _shape(text: str) -> tuple[int, int, int]:
    """``C,H,W``: the shape of one image."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not C,H,W: three positive integers (e.g. 3,64,64)"
        )
    return shape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hetconv plan``."""
    parser.add_argument("scenario", nargs="?", metavar="SCENARIO",
                        help="a shipped scenario's name or a .toml file (instead of --master "
                        "and --worker)")  # fmt: skip
    # train's defaults, so that a plan without them describes the run `hetconv train` makes
    add_model_flag(
        parser,
        TrainConfig.preset,
        help=model_help() + "; or a run folder or its model.npz: the network it trained, at "
        "its image shape",
    )
    parser.add_argument("--batch", type=positive_int, default=TrainConfig.batch,
                        help="images per step, as `hetconv train --batch`")  # fmt: skip
    parser.add_argument("--input-shape", type=_shape, metavar="C,H,W",
                        help="the shape of one image of the training data (`hetconv train` "
                        "prints it: N images of CxHxW); default: an .onnx graph's own, else "
                        "CIFAR's 3,32,32")  # fmt: skip
    parser.add_argument("--nodes", type=positive_int,
                        help="with a scenario: the master and this many - 1 of its workers "
                        "(default: every listed one)")  # fmt: skip
    parser.add_argument("--master", type=positive_float, metavar="GFLOPS",
                        help=f"the master's convolution speed: {PROBE_FIGURE}")  # fmt: skip
    parser.add_argument("--worker", type=_device, action="append", default=[],
                        metavar="GFLOPS[@MBIT]",
                        help="a worker's convolution speed, GFLOPS as for --master, and its "
                        "own link's Mbit/s when it differs (repeat per worker)")  # fmt: skip
    add_mode_flags(
        parser,
        {"network": None},
        choices={"network": ("switched", "wifi")},
        notes={"network": "default: the scenario's, else wifi"},
    )
    parser.add_argument("--bandwidth", type=positive_float, metavar="MBIT",
                        help="the link's real throughput, Mbit/s (default: the scenario's, "
                        "else 100 for wifi, 940 switched)")  # fmt: skip
    parser.add_argument(
        "--latency-ms",
        type=positive_float,
        default=None,
        help="round trip master <-> worker (default: the scenario's, else 3)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the ranked strategies as JSON")


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="which way to train is predicted fastest on a cluster",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
        intermixed=True,
    )
    add_arguments(p)
    p.set_defaults(func=run)
