"""The ``hetconv`` command line."""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .model import PRESETS


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the empty ones that would only say 'None' or 'False'."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a network",
        description=(
            "Train a CNN preset on the synthetic set (offline, the default) or CIFAR-10. "
            "Today every convolution runs in this process on the cpu backend (--local); "
            "distributing them across workers builds on this command."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--local",
        action="store_true",
        help="run every convolution in this process (the only mode today)",
    )
    p.add_argument(
        "--preset",
        default="tiny",
        help=f"network: one of {', '.join(PRESETS)}, or a .json spec file",
    )
    p.add_argument(
        "--dataset",
        choices=["synthetic", "cifar10"],
        default="synthetic",
        help="offline synthetic CIFAR-shaped set, or the real CIFAR-10 files",
    )
    p.add_argument(
        "--data-dir",
        help="folder with the CIFAR-10 python files (data_batch_1..5, test_batch) "
        "or its parent holding cifar-10-batches-py/",
    )
    length = p.add_mutually_exclusive_group()
    length.add_argument(
        "--steps",
        type=_positive_int,
        help="SGD steps (300 when neither --steps nor --epochs is given)",
    )
    length.add_argument("--epochs", type=_positive_float, help="passes over the training set")
    p.add_argument("--batch", type=_positive_int, default=32, help="images per step")
    p.add_argument("--seed", type=int, default=0, help="seed for weights, data and order")
    p.add_argument("--lr", type=_positive_float, default=0.01, help="learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum, in [0, 1)")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="L2 weight decay")
    p.add_argument(
        "--train-size", type=_positive_int, default=10_000, help="synthetic training images"
    )
    p.add_argument(
        "--eval-size", type=int, default=2_000, help="held-out images evaluated at the end"
    )
    p.add_argument("--save", metavar="NPZ", help="write the trained weights (PyTorch names)")
    p.add_argument("--load", metavar="NPZ", help="start from these weights")
    p.add_argument("--trace", metavar="JSONL", help="write one JSON object per step")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from hetconv.master.training import TrainConfig, train

    from .optim import SGDConfig

    config = TrainConfig(
        preset=args.preset,
        dataset=args.dataset,
        data_dir=args.data_dir,
        steps=args.steps,
        epochs=args.epochs,
        batch=args.batch,
        seed=args.seed,
        sgd=SGDConfig(lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay),
        train_size=args.train_size,
        eval_size=args.eval_size,
        trace=args.trace,
        save=args.save,
        load=args.load,
        progress=not args.no_progress,
    )
    train(config)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetconv",
        description="Train CNNs with their convolutions split across heterogeneous workers.",
    )
    parser.add_argument("--version", action="version", version=f"hetconv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_train(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("hetconv: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, FloatingPointError) as e:
        # Bad input is the user's to fix: one line naming it, not a traceback.
        print(f"hetconv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
