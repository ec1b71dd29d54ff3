"""``hetconv report``: a training run's figures."""

from __future__ import annotations

import argparse
import sys

from .common import HelpFormatter


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="draw a training run's figures",
        description=(
            "Draw the figures of a run folder that hetconv train wrote (runs/NAME), as PNGs in "
            "its figures/: loss and accuracy (training and held-out), the step-time breakdown, "
            "each node's share and compute time, and bytes per step. Needs matplotlib "
            "(pip install 'hetconv[plot]')."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("run", metavar="RUN", help="the run folder (or its metrics.csv)")
    p.add_argument("--out", metavar="DIR", help="write the PNGs here (default: RUN/figures)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hetconv.training.report import ReportUnavailable, draw_report

    try:
        figures = draw_report(args.run, args.out)
    except ReportUnavailable as e:
        raise ValueError(str(e)) from None
    for figure in figures:
        if figure.path is not None:
            print(figure.path)
        else:
            print(f"({figure.name}: none, {figure.skipped})", file=sys.stderr)
    return 0
