"""``hetconv evaluate``: held-out loss and accuracy of saved weights."""

from __future__ import annotations

import argparse
import os
import sys

from hetconv.argtypes import positive_float, positive_int

from .common import HelpFormatter
from .modes import add_model_flag


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="held-out loss and accuracy of saved weights",
        description=(
            "Evaluate saved weights on a dataset's held-out images and print the loss and "
            "accuracy. MODEL is a model .npz (hetconv train's model.npz or --save), a "
            "checkpoint file or folder, or a run folder (its model.npz, else its latest "
            "checkpoint). Inside a run folder, the network and data default to the run's "
            "config.toml; flags given here override it."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="weights: .npz, checkpoint, or run folder")
    add_model_flag(p)
    p.add_argument(
        "--dataset",
        choices=["synthetic", "cifar10", "cifar100", "folder", "npz", "auto"],
        help="what --data-dir holds (default: inferred; synthetic without --data-dir)",
    )
    p.add_argument("--data-dir", metavar="PATH", help="the dataset, as hetconv train takes it")
    p.add_argument(
        "--holdout-fraction",
        type=positive_float,
        metavar="F",
        help="for data without a held-out part of its own: the fraction training held out",
    )
    p.add_argument(
        "--eval-size",
        type=positive_int,
        metavar="N",
        help="evaluate the first N held-out images (default: all)",
    )
    p.add_argument(
        "--seed",
        type=int,
        help="the training run's seed (the synthetic held-out set is drawn from it)",
    )
    p.add_argument("--batch", type=positive_int, default=200, help="images per forward pass")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hetconv.conv import LocalConv
    from hetconv.model import Model
    from hetconv.onnx_import import load_network
    from hetconv.training.checkpoint import read_weights
    from hetconv.training.config import TrainConfig
    from hetconv.training.datasets import check_classes, evaluate, load_datasets
    from hetconv.training.rundir import CONFIG_NAME, find_run, read_config

    if not os.path.exists(args.model):
        raise ValueError(f"{args.model} does not exist: give a model .npz, a checkpoint or a run")
    run = find_run(args.model)
    saved = read_config(run / CONFIG_NAME) if run is not None else {}

    def setting(name: str, default=None):
        given = getattr(args, name.replace("-", "_"))
        return given if given is not None else saved.get(name, default)

    data_dir = setting("data-dir")
    dataset = setting("dataset") or ("auto" if data_dir else "synthetic")
    if args.data_dir and not args.dataset:
        dataset = "auto"  # another dataset than the run's: infer its kind
    preset = setting("preset", "tiny")
    config = TrainConfig(
        preset=preset,
        dataset=dataset,
        data_dir=data_dir,
        holdout_fraction=setting("holdout-fraction") if data_dir else None,
        seed=setting("seed", 0),
        train_size=1 if dataset == "synthetic" else TrainConfig.train_size,
        eval_size=args.eval_size,
        progress=False,
    )
    data = load_datasets(config)
    if not len(data.held_out):
        raise ValueError(f"the {data.kind} dataset has no held-out images to evaluate")
    spec = load_network(preset).spec
    check_classes(spec, data.held_out, preset)
    weights, what = read_weights(args.model)
    model = Model(spec, seed=0, executor=LocalConv(), input_shape=data.held_out.image_shape)
    try:
        model.load_state(weights)
    except ValueError as e:
        raise ValueError(f"{what} does not fit network {preset}: {e}") from None
    if run is not None:
        print(f"network and data from {run / CONFIG_NAME}", file=sys.stderr)
    loss, accuracy = evaluate(model, data.held_out, args.batch)
    source = data.kind if data.kind == "synthetic" else data_dir
    print(
        f"{what}: held-out loss {loss:.4f}, accuracy {100 * accuracy:.2f}% on "
        f"{len(data.held_out)} images of {source} ({data.held_out_from}; chance "
        f"{100 / data.held_out.num_classes:.0f}%)"
    )
    return 0
