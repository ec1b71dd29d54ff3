"""``hetconv export``: a trained network as an ONNX graph."""

from __future__ import annotations

import argparse

from hetconv.argtypes import positive_int
from hetconv.model import PRESETS

from .common import HelpFormatter
from .modes import add_model_flag


def _shape_chw(text: str) -> tuple[int, int, int]:
    """``C,H,W`` as three positive ints."""
    parts = text.replace("x", ",").split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not C,H,W (three positive integers)")
    return shape  # type: ignore[return-value]


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a trained network as an ONNX graph",
        description=(
            "Write the network of a weights file (what `hetconv train --save` wrote) as an "
            "ONNX graph in evaluation mode, checked with onnx.checker: it takes float32 "
            "`input` (N, C, H, W), normalised as in training, and gives `logits` "
            "(N, classes). Needs the onnx package (pip install 'hetconv[onnx]')."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("weights", metavar="MODEL.npz", help="the weights file")
    which = p.add_mutually_exclusive_group(required=True)
    add_model_flag(which)
    which.add_argument("--spec", metavar="SPEC.json", help="the network's .json spec")
    p.add_argument(
        "--input-shape", type=_shape_chw, metavar="C,H,W",
        help="the images' channels, height and width (required but for an .onnx network, "
        "whose graph says them)",
    )  # fmt: skip
    p.add_argument(
        "--classes", type=positive_int, metavar="N",
        help="a preset's class count (its last fc's outputs; default 10)",
    )  # fmt: skip
    p.add_argument("-o", "--output", required=True, metavar="OUT.onnx", help="where to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from hetconv.onnx_export import export_onnx
    from hetconv.onnx_import import load_network

    if args.spec is not None and not args.spec.endswith(".json"):
        raise ValueError(f"--spec {args.spec}: expected a .json file")
    name = args.spec if args.spec is not None else args.preset
    if args.classes is not None and name not in PRESETS:
        raise ValueError("--classes is for a preset; a spec's last fc says its outputs")
    network = load_network(name, classes=args.classes)
    input_shape = args.input_shape or network.input_shape
    if input_shape is None:
        raise ValueError("--input-shape is required: a preset or a .json spec does not say it")
    try:
        with np.load(args.weights, allow_pickle=False) as data:
            weights = {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, AttributeError) as e:
        raise ValueError(f"cannot read weights from {args.weights}: {e}") from None
    export_onnx(network.spec, weights, input_shape, args.output)
    print(f"wrote {args.output}")
    return 0
