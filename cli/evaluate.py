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
            "checkpoint). The network is the one the weights record (what hetconv train "
            "writes does), else the run's; inside a run folder, the data default to the run's "
            "config.toml; flags given here override both. The images are normalised as the "
            "weights record (the training data's mean and std)."
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
    from hetconv.training.checkpoint import read_model
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
    weights, described, what = read_model(args.model)
    spec_recorded = args.preset is None and described is not None
    if spec_recorded:
        preset, spec = described.network, list(described.spec)
    else:
        preset = setting("preset", "tiny")
        spec = load_network(preset).spec
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
    held_out = _normalised_as_recorded(data.held_out, described)
    check_classes(spec, held_out, preset)
    model = Model(spec, seed=0, executor=LocalConv(), input_shape=held_out.image_shape)
    try:
        model.load_state(weights)
    except ValueError as e:
        raise ValueError(f"{what} does not fit network {preset}: {e}") from None
    if run is not None:
        what_from = "data" if spec_recorded else "network and data"
        print(f"{what_from} from {run / CONFIG_NAME}", file=sys.stderr)
    loss, accuracy = evaluate(model, held_out, args.batch)
    source = data.kind if data.kind == "synthetic" else data_dir
    print(
        f"{what}: held-out loss {loss:.4f}, accuracy {100 * accuracy:.2f}% on "
        f"{len(data.held_out)} images of {source} ({data.held_out_from}; chance "
        f"{100 / data.held_out.num_classes:.0f}%)"
    )
    return 0


def _normalised_as_recorded(held_out, described):
    """The held-out set normalised by the mean and std the weights were trained with, where
    they record them for images of this kind (the same as the data's own for the run's data)."""
    import dataclasses

    from hetconv.description import UINT8

    if described is None or len(described.mean) != held_out.image_shape[0]:
        return held_out
    if (described.raw == UINT8) != (held_out.images.dtype.name == "uint8"):
        return held_out
    return dataclasses.replace(held_out, mean=described.mean, std=described.std)
