"""Figures of a training run (``hetconv report runs/NAME``), drawn from its ``metrics.csv``.

Each is a PNG in the run's ``figures/`` folder, sized for a report page (8 x 4.5 inches at
150 dpi):

- ``loss.png``: training loss per step and its moving average, held-out loss at each
  evaluation;
- ``accuracy.png``: the same for accuracy;
- ``step_time.png``: each step's time, stacked: communication, convolution (slowest node),
  other computation;
- ``nodes.png``: each node's share of the kernels and its compute time per step (runs with
  workers);
- ``bytes.png``: megabytes on the master's link per step, per node (runs with workers).

In both, a worker that answered but had no kernel (``metrics.csv``'s zeros) is drawn at 0 and
named ``idle: no share`` with its steps, and one that was lost (its cells empty from a step
on) has its line broken there, a dotted line at that step, and ``lost at step N`` beside its
name (:func:`node_notes`), so a worker with no work is never mistaken for one that crashed.

Runs of many steps are drawn as means over bins of consecutive steps (the legend or the axis
says so), so the lines stay readable. matplotlib is optional (``pip install 'hetconv[plot]'``),
imported only here, and draws with its non-interactive Agg backend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .metrics import Metrics, read_metrics

FIGSIZE = (8.0, 4.5)  # inches
DPI = 150
MAX_POINTS = 200  # steps drawn one by one up to this; beyond, means over bins of steps
_TRAIN_COLOUR, _HELD_OUT_COLOUR = "#1f77b4", "#d62728"
_PARTS = (
    ("comm_seconds", "communication", "#d95f02"),
    ("conv_seconds", "convolution (slowest node)", "#1b9e77"),
    ("other_seconds", "other computation", "#7570b3"),
)


class ReportUnavailable(RuntimeError):
    """matplotlib is not installed."""


@dataclass(frozen=True)
class Figure:
    """A figure written, or one left out and why."""

    name: str
    path: Path | None
    skipped: str | None = None


def _figure_class():
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ReportUnavailable("figures need matplotlib: pip install 'hetconv[plot]'") from None
    matplotlib.use("Agg")
    from matplotlib.figure import Figure as MplFigure

    return MplFigure


def _new_figure(rows: int = 1):
    mpl_figure = _figure_class()
    size = FIGSIZE if rows == 1 else (FIGSIZE[0], FIGSIZE[1] * 1.45)
    fig = mpl_figure(figsize=size, dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=10)
    return fig, axes


def _bins(steps: int) -> int:
    """Steps per bin: 1 up to :data:`MAX_POINTS` steps."""
    return max(1, int(np.ceil(steps / MAX_POINTS)))


def _binned(x: np.ndarray, y: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Means of ``y`` over bins of ``width`` consecutive rows, at the bins' mean ``x``."""
    if width == 1:
        return x, y
    cut = np.arange(0, len(x), width)
    counts = np.diff(np.append(cut, len(x)))
    return np.add.reduceat(x, cut) / counts, np.add.reduceat(y, cut) / counts


def _moving_average(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over at most ``window`` values (fewer at the start)."""
    sums = np.cumsum(np.insert(y, 0, 0.0))
    end = np.arange(1, len(y) + 1)
    start = np.maximum(end - window, 0)
    return (sums[end] - sums[start]) / (end - start)


def _headroom(ax, totals: np.ndarray) -> None:
    """From 0 to a third above the highest stack, so a legend on top covers no data."""
    top = float(np.max(totals)) if len(totals) else 0.0
    ax.set_ylim(0, top * 1.35 if top > 0 else 1.0)


def _trained(metrics: Metrics) -> np.ndarray:
    """The x axis: steps trained after each row (a step's row at its number + 1)."""
    return metrics["step"] + 1


def _step_axis(ax, metrics: Metrics) -> None:
    ax.set_xlabel("steps trained", fontsize=11)
    ax.set_xlim(left=0, right=max(float(_trained(metrics)[-1]), 1.0) * 1.01)


def _curve(metrics: Metrics, column: str, scale: float, ylabel: str, title: str, path: Path):
    fig, (ax,) = _new_figure()
    x, y = _trained(metrics), metrics[column] * scale
    window = max(1, min(50, len(y) // 10))
    if len(y) > 1:
        ax.plot(x, y, color=_TRAIN_COLOUR, alpha=0.25, linewidth=0.8, label="training batch")
    if window > 1:
        ax.plot(
            x,
            _moving_average(y, window),
            color=_TRAIN_COLOUR,
            linewidth=2,
            label=f"training, mean of the last {window} steps",
        )
    else:
        ax.plot(x, y, color=_TRAIN_COLOUR, linewidth=2, marker="o" if len(y) < 30 else None,
                label="training batch")  # fmt: skip
    held_steps, held_loss, held_accuracy = metrics.held_out()
    held = {"loss": held_loss, "accuracy": held_accuracy}[column] * scale
    if len(held):
        ax.plot(held_steps, held, color=_HELD_OUT_COLOUR, linewidth=2, marker="o",
                markersize=5, label="held-out set")  # fmt: skip
    ax.set_ylabel(ylabel, fontsize=11)
    unit = "%" if column == "accuracy" else ""
    if len(held):
        value = f"{held[-1]:.{1 if unit else 3}f}{unit}"
        title += f": held-out {value} after {held_steps[-1]:.0f} steps"
    ax.set_title(title, fontsize=13)
    if column == "accuracy":
        ax.set_ylim(-2, 102)
    else:
        ax.set_ylim(bottom=0)
    _step_axis(ax, metrics)
    ax.legend(fontsize=10, loc="best")
    fig.savefig(path)
    return path


def _step_time(metrics: Metrics, path: Path) -> Path:
    fig, (ax,) = _new_figure()
    width = _bins(len(metrics))
    x = _trained(metrics)
    parts = []
    for column, label, colour in _PARTS:
        bx, by = _binned(x, metrics[column] * 1e3, width)
        parts.append((by, label, colour))
    ax.stackplot(bx, *[p[0] for p in parts], labels=[p[1] for p in parts],
                 colors=[p[2] for p in parts], alpha=0.85, step=None)  # fmt: skip
    if len(bx) == 1:  # one point draws no area: show it as bars
        bottom = 0.0
        for values, _, colour in parts:
            ax.bar(bx, values, bottom=bottom, color=colour, width=0.6)
            bottom += values
    per = "" if width == 1 else f", mean over {width} steps"
    ax.set_ylabel(f"time per step (ms{per})", fontsize=11)
    total = metrics["seconds"][1:] if len(metrics) > 1 else metrics["seconds"]
    ax.set_title(
        f"Step time: mean {1e3 * np.mean(total):.0f} ms"
        + (" (after the first step)" if len(metrics) > 1 else ""),
        fontsize=13,
    )
    _headroom(ax, sum(p[0] for p in parts))
    _step_axis(ax, metrics)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, fontsize=10, loc="upper right", ncols=3)
    fig.savefig(path)
    return path


def _spans(steps: np.ndarray, mask: np.ndarray) -> list[tuple[int, int]]:
    """The runs of consecutive rows where ``mask`` holds, as (first step, last step)."""
    edges = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1
    return [(int(steps[a]), int(steps[b])) for a, b in zip(starts, ends, strict=True)]


def lost_steps(metrics: Metrics, node: str) -> list[int]:
    """The steps at which ``node`` was lost: its cells empty after a step that had them."""
    present = ~np.isnan(metrics.node("share", node))
    return [int(s) for s in metrics["step"][1:][present[:-1] & ~present[1:]]]


def node_notes(metrics: Metrics) -> dict[str, str]:
    """Per node, what happened to it beside its figures, for a legend: ``idle: no share at
    steps 240-299`` (it answered, with no kernel), ``lost at step 240``, both joined by ``; ``
    (the first two of each, then how many more); nodes with nothing to say are left out."""
    notes = {}
    for node in metrics.nodes:
        share = metrics.node("share", node)
        idle = _spans(metrics["step"], share == 0)
        said = [f"steps {a}-{b}" if b > a else f"step {a}" for a, b in idle[:2]]
        if len(idle) > 2:
            said.append(f"{len(idle) - 2} more")
        parts = [f"idle: no share at {', '.join(said)}"] if idle else []
        lost = lost_steps(metrics, node)
        if lost:
            more = f" and {len(lost) - 2} more" if len(lost) > 2 else ""
            parts.append(f"lost at step {', '.join(map(str, lost[:2]))}{more}")
        if parts:
            notes[node] = "; ".join(parts)
    return notes


def _label(node: str, notes: dict[str, str]) -> str:
    return f"{node} ({notes[node]})" if node in notes else node


def _mark_losses(ax, metrics: Metrics, colours: dict[str, str]) -> None:
    """A dotted line in the node's colour at each step a node was lost."""
    for node in metrics.nodes:
        for step in lost_steps(metrics, node):
            ax.axvline(step + 1, color=colours[node], linestyle=":", linewidth=1.5)


def _node_colours(nodes: list[str]) -> dict[str, str]:
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
               "#7f7f7f", "#bcbd22", "#17becf"]  # fmt: skip
    return {node: palette[i % len(palette)] for i, node in enumerate(nodes)}


def _nodes(metrics: Metrics, path: Path) -> Path:
    fig, (top, bottom) = _new_figure(rows=2)
    width = _bins(len(metrics))
    colours = _node_colours(metrics.nodes)
    x = _trained(metrics)
    marker = "o" if len(metrics) < 30 else None
    notes = node_notes(metrics)
    for index, node in enumerate(metrics.nodes):
        # Empty cells (not joined yet, or lost) are NaN: the line breaks there, and a bin
        # holding one is left out; an idle node's zeros are drawn.
        share, compute = metrics.node("share", node), metrics.node("compute_seconds", node)
        # Equal shares draw one line over another: a dash pattern per node keeps both seen.
        style = {"color": colours[node], "linewidth": 2, "marker": marker,
                 "label": _label(node, notes),
                 "linestyle": ("-", "--", ":", "-.")[index % 4]}  # fmt: skip
        bx, bs = _binned(x, 100 * share, width)
        top.plot(bx, bs, **style)
        bx, bc = _binned(x, 1e3 * compute, width)
        bottom.plot(bx, bc, **style)
    for ax in (top, bottom):
        _mark_losses(ax, metrics, colours)
    per = "" if width == 1 else f", mean over {width} steps"
    top.set_ylabel("share of kernels (%)", fontsize=11)
    top.set_ylim(-2, 102)
    top.set_title("Each node's share of the kernels and its compute time", fontsize=13)
    bottom.set_ylabel(f"compute per step (ms{per})", fontsize=11)
    bottom.set_ylim(bottom=0)
    _step_axis(bottom, metrics)
    top.legend(fontsize=10, loc="best", title="node", title_fontsize=10)
    fig.savefig(path)
    return path


def _bytes(metrics: Metrics, path: Path) -> Path:
    fig, (ax,) = _new_figure()
    width = _bins(len(metrics))
    colours = _node_colours(metrics.nodes)
    x = _trained(metrics)
    series = []
    notes = node_notes(metrics)
    for node in metrics.nodes:
        values = np.nan_to_num(metrics.node("bytes", node)) / 1e6
        bx, bv = _binned(x, values, width)
        if np.any(bv > 0):
            series.append((bv, _label(node, notes), colours[node]))
    _mark_losses(ax, metrics, colours)
    if series:
        ax.stackplot(bx, *[s[0] for s in series], labels=[s[1] for s in series],
                     colors=[s[2] for s in series], alpha=0.85)  # fmt: skip
        if len(bx) == 1:
            bottom = 0.0
            for values, _, colour in series:
                ax.bar(bx, values, bottom=bottom, color=colour, width=0.6)
                bottom += values
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles, labels, fontsize=10, loc="upper right", ncols=3)
        _headroom(ax, sum(s[0] for s in series))
    per = "" if width == 1 else f", mean over {width} steps"
    ax.set_ylabel(f"bytes per step (MB{per})", fontsize=11)
    ax.set_title(
        f"Bytes on the master's link, both ways: mean {np.mean(metrics['bytes']) / 1e6:.2f} MB "
        "per step",
        fontsize=13,
    )
    _step_axis(ax, metrics)
    fig.savefig(path)
    return path


def draw_report(run: str | os.PathLike, out: str | os.PathLike | None = None) -> list[Figure]:
    """Draw the figures of the run in folder ``run`` (or of a ``metrics.csv`` itself).

    Args:
        run: the run folder, or its ``metrics.csv``.
        out: where the PNGs go (default: ``figures/`` in the run folder).

    Returns:
        Every figure, written or left out (a run without workers has no nodes or bytes).

    Raises:
        ValueError: no ``metrics.csv`` there, or it holds no step.
        ReportUnavailable: matplotlib is missing.
    """
    run = Path(run)
    csv_path = run if run.is_file() else run / "metrics.csv"
    if not csv_path.is_file():
        raise ValueError(
            f"{run} holds no metrics.csv: give a run folder that `hetconv train` wrote (runs/NAME)"
        )
    metrics = read_metrics(csv_path)
    if not len(metrics):
        raise ValueError(f"{csv_path} holds no step yet: nothing to draw")
    _figure_class()  # matplotlib present, before any folder is made
    folder = Path(out) if out is not None else csv_path.parent / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    figures = [
        Figure("loss", _curve(metrics, "loss", 1.0, "cross-entropy loss", "Loss",
                              folder / "loss.png")),
        Figure("accuracy", _curve(metrics, "accuracy", 100.0, "accuracy (%)", "Accuracy",
                                  folder / "accuracy.png")),
        Figure("step_time", _step_time(metrics, folder / "step_time.png")),
    ]  # fmt: skip
    if metrics.nodes:
        figures.append(Figure("nodes", _nodes(metrics, folder / "nodes.png")))
        figures.append(Figure("bytes", _bytes(metrics, folder / "bytes.png")))
    else:
        why = "a run without workers (--local): no nodes and nothing on a link"
        figures += [Figure("nodes", None, why), Figure("bytes", None, why)]
    return figures


__all__ = [
    "DPI",
    "FIGSIZE",
    "Figure",
    "ReportUnavailable",
    "draw_report",
    "lost_steps",
    "node_notes",
]
