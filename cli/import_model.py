"""``hetconv import``: an ONNX graph exported from PyTorch as a .json spec and its weights."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import HelpFormatter


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import",
        help="read a network exported from PyTorch (ONNX) as a .json spec and its weights",
        description=(
            "Read an ONNX graph that torch.onnx.export wrote from a torchvision-style CNN "
            "(Conv, BatchNormalization, Relu, MaxPool, AveragePool, GlobalAveragePool, Add, "
            "Concat, Flatten, Gemm, Dropout) and write it as a .json model spec, with its "
            "weights (parameters and batch norm's running statistics) as an .npz beside it. "
            "Anything else is refused, naming the node and its operator. Export with "
            "training=torch.onnx.TrainingMode.PRESERVE so that batch norm stays a layer of "
            "its own. `hetconv train --model NET.onnx` reads the graph the same way, with no "
            "files written. Needs the onnx package (pip install 'hetconv[onnx]')."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("graph", metavar="NET.onnx", help="the ONNX graph")
    p.add_argument(
        "-o",
        "--output",
        metavar="NET.json",
        help="where to write the spec (default: the graph's path with .json)",
    )
    p.add_argument(
        "--weights",
        metavar="NET.npz",
        help="where to write the weights (default: the spec's path with .npz)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    import shlex

    import numpy as np

    from hetconv.onnx_import import import_onnx

    graph = Path(args.graph)
    if graph.suffix.lower() != ".onnx":
        raise ValueError(f"{graph}: expected an .onnx file")
    if not graph.is_file():
        raise ValueError(f"{graph} does not exist")
    spec_path = Path(args.output) if args.output else graph.with_suffix(".json")
    if spec_path.suffix != ".json":
        raise ValueError(f"-o {spec_path}: expected a .json file (what --model takes)")
    weights_path = Path(args.weights) if args.weights else spec_path.with_suffix(".npz")
    if weights_path.suffix != ".npz":
        raise ValueError(f"--weights {weights_path}: expected an .npz file")
    imported = import_onnx(graph)
    spec_path.write_text(json.dumps(imported.spec, indent=1) + "\n", encoding="utf-8")
    tmp = weights_path.with_name(weights_path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **imported.weights)
    tmp.replace(weights_path)
    shape = "x".join(map(str, imported.input_shape))
    print(
        f"wrote {spec_path} ({len(imported.spec)} layers, input {shape}) and {weights_path} "
        f"({len(imported.weights)} arrays)"
    )
    print(
        "train it: hetconv train --model "
        f"{shlex.quote(str(spec_path))} --load {shlex.quote(str(weights_path))}"
    )
    return 0
