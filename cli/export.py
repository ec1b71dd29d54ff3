"""``hetconv export``: a trained network as an ONNX graph."""

from __future__ import annotations

import argparse

from hetconv.argtypes import positive_int
from hetconv.description import UINT8
from hetconv.model import PRESETS

from .common import HelpFormatter
from .modes import add_model_flag, model_help


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
            "Write the network of trained weights as an ONNX graph in evaluation mode, checked "
            "with onnx.checker: it takes float32 `input` (N, C, H, W), normalised as in "
            "training (raw pixels with --include-normalisation), and gives `logits` "
            "(N, classes). MODEL is a model .npz (hetconv train's "
            "model.npz or --save), a checkpoint file or folder, or a run folder; what hetconv "
            "train writes says its network, input shape, classes and normalisation, so nothing "
            "else is needed, and the graph's metadata states them. Weights written before "
            "they described themselves need --model and --input-shape. Needs the onnx package "
            "(pip install 'hetconv[onnx]')."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "weights", metavar="MODEL", help="the weights: a model .npz, a checkpoint, or a run folder"
    )
    which = p.add_mutually_exclusive_group()
    add_model_flag(
        which,
        help=f"{model_help()}; without it, the network MODEL records (weights that record none "
        "need it)",
    )
    which.add_argument("--spec", metavar="SPEC.json", help="a .json spec (as --model SPEC.json)")
    p.add_argument(
        "--input-shape", type=_shape_chw, metavar="C,H,W",
        help="the images' channels, height and width; without it, what MODEL records, or an "
        ".onnx network's graph",
    )  # fmt: skip
    p.add_argument(
        "--classes", type=positive_int, metavar="N",
        help="a preset's class count (its last fc's outputs; default 10)",
    )  # fmt: skip
    p.add_argument(
        "--include-normalisation",
        action="store_true",
        help="start the graph with the training data's normalisation, so that `input` takes "
        "raw values as the data held them: pixels 0..255 (as float32) for image folders, "
        "CIFAR, synthetic and uint8 .npz data; a float32 .npz's values as they are",
    )
    p.add_argument("-o", "--output", required=True, metavar="OUT.onnx", help="where to write")
    p.set_defaults(func=run)


def _network(args: argparse.Namespace, described, what: str):
    """(spec, input shape or None) from the flags, else from the weights' description."""
    from hetconv.onnx_import import load_network

    if args.spec is not None and not args.spec.endswith(".json"):
        raise ValueError(f"--spec {args.spec}: expected a .json file")
    name = args.spec if args.spec is not None else args.preset
    if args.classes is not None and name not in PRESETS:
        raise ValueError("--classes is for a preset; a spec's last fc says its outputs")
    if name is not None:
        network = load_network(name, classes=args.classes)
        return network.spec, network.input_shape
    if described is None:
        raise ValueError(
            f"{what} does not record its network (written before weight files described "
            "themselves): give --model NETWORK, the preset, .json spec or .onnx graph it was "
            "trained as"
        )
    return list(described.spec), described.input_shape


def run(args: argparse.Namespace) -> int:
    from hetconv.onnx_export import export_onnx
    from hetconv.training.checkpoint import read_model

    weights, described, what = read_model(args.weights)
    spec, shape = _network(args, described, what)
    input_shape = args.input_shape or (described.input_shape if described else None) or shape
    if input_shape is None:
        raise ValueError(
            f"--input-shape C,H,W is required: {what} does not record it, and a preset or a "
            ".json spec does not say it"
        )
    if args.include_normalisation and described is None:
        raise ValueError(
            f"--include-normalisation: {what} does not record its input's normalisation "
            "(written before weight files described themselves)"
        )
    export_onnx(
        spec, weights, input_shape, args.output, described, normalise=args.include_normalisation
    )
    shown = f"float32 (N, {', '.join(map(str, input_shape))})"
    if described is None:
        how = "normalised as in training (the weights do not record how)"
    elif args.include_normalisation:
        how = "raw " + ("pixels 0..255" if described.raw == UINT8 else "values")
        how += f"; the graph normalises them: {described.formula()}"
    else:
        how = f"normalised: {described.formula()}"
    if described is not None:
        how += (
            f", mean {' '.join(f'{m:.4g}' for m in described.mean)}, std "
            f"{' '.join(f'{s:.4g}' for s in described.std)} (in the graph's metadata)"
        )
    print(f"wrote {args.output} from {what}: input {shown}, {how}")
    return 0
