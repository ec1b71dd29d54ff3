"""The ``hetconv`` command: its parser, one module per command, and how bad input and
interruptions are reported."""

from __future__ import annotations

import argparse
import sys

from hetconv import __version__

from .common import CommandParser
from .devices import add as add_devices
from .evaluate import add as add_evaluate
from .export import add as add_export
from .import_model import add as add_import
from .plan import add as add_plan
from .report import add as add_report
from .simulate import add as add_simulate
from .train import add as add_train
from .train_config import apply_config
from .worker import add as add_worker


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetconv",
        description="Train CNNs with their convolutions split across heterogeneous workers.",
    )
    parser.add_argument("--version", action="version", version=f"hetconv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    sub.required = True
    for add in (add_train, add_worker, add_evaluate, add_report, add_devices, add_simulate,
                add_plan, add_export, add_import):  # fmt: skip
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    try:
        if getattr(args, "config", None):
            apply_config(args, argv)
        return args.func(args)
    except KeyboardInterrupt as e:
        from hetconv.training import TrainingInterrupted

        if isinstance(e, TrainingInterrupted):
            saved = [f"model {e.model}"] if e.model is not None else []
            if e.checkpoint is not None:
                saved.append(f"checkpoint {e.checkpoint}")
            where = "saved " + ", ".join(saved) if saved else "nothing saved"
            if e.checkpoint is None:
                where += "; its checkpoint could not be written (see above)"
            resume = getattr(e, "resume_command", "the same command with --resume")
            print(
                f"hetconv: {e}: {where}; to continue from the latest checkpoint: {resume}",
                file=sys.stderr,
            )
            return 128 + e.signum
        hint = (
            " (nothing saved: --no-run-dir without --checkpoint-dir keeps nothing of a run "
            "stopped early)"
            if getattr(args, "no_run_dir", False) and not getattr(args, "checkpoint_dir", None)
            else ""
        )
        print(f"hetconv: interrupted{hint}", file=sys.stderr)
        return 130
    except (ValueError, OSError, FloatingPointError) as e:
        # Bad input is the user's to fix: one line naming it, not a traceback, with the
        # prefix argparse gives the command's usage errors.
        print(f"hetconv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        # A worker that failed or could not be reached or started: named, no traceback.
        print(f"hetconv {args.command}: error: {e}", file=sys.stderr)
        return 1
