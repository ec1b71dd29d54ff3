"""Figures of a sweep: speedup vs nodes, speedup over nodes x bandwidth, step-time breakdown.

matplotlib is optional (``pip install 'hetconv[plot]'``) and imported only here, when a plot is
asked for; it draws to files with the non-interactive Agg backend.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from .sweep import Row

#: Compute shares solid with filled circles, link-aware dashed with open squares: told apart in
#: the legend as well as on the plot.
_POLICY_STYLE = {
    "compute": {"linestyle": "-", "marker": "o", "markersize": 4},
    "link": {"linestyle": "--", "marker": "s", "markersize": 4, "markerfacecolor": "none"},
}
DPI = 110
MAX_WIDTH_IN = 14.0  # 1540 px at DPI: a figure a report can hold
_PARTS = (("comm_s", "communication", "#d95f02"), ("conv_s", "convolution (slowest node)",
          "#1b9e77"), ("comp_s", "comp (rest, on the master)", "#7570b3"))  # fmt: skip


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    """Raise :class:`PlotsUnavailable`, saying how to install it, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        raise PlotsUnavailable("plots need matplotlib: pip install 'hetconv[plot]'") from None


def _pyplot():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def _unique(values) -> list:
    return list(dict.fromkeys(values))


def _node_ticks(nodes: Sequence[int]) -> list[int]:
    """The cluster sizes to label on a log axis: all of them when few, else the powers of two
    among them and the ends."""
    nodes = sorted(set(nodes))
    if len(nodes) <= 12:
        return nodes
    return sorted({nodes[0], nodes[-1], *(n for n in nodes if n & (n - 1) == 0)})


def speedup_figure(rows: Sequence[Row], scenario: str, batch: int):
    """The speedup-vs-nodes figure of one scenario and batch (a matplotlib Figure): one panel
    per bandwidth, one colour per network, compute shares solid with filled circles, link-aware
    dashed with open squares, over a dotted y = 1 reference drawn beneath them."""
    plt = _pyplot()
    from matplotlib.ticker import NullLocator

    chosen = [r for r in rows if r.scenario == scenario and r.batch == batch]
    bandwidths = _unique(r.bandwidth_mbps for r in chosen)
    cols = min(3, len(bandwidths))
    nrows = -(-len(bandwidths) // cols)
    fig, axes = plt.subplots(
        nrows, cols, figsize=(5 * cols, 3.8 * nrows), squeeze=False, sharey=True
    )
    ticks = _node_ticks([r.nodes for r in chosen])
    for ax, bandwidth in zip(axes.flat, bandwidths, strict=False):
        for color, network in enumerate(_unique(r.network for r in chosen)):
            for policy in _unique(r.policy for r in chosen):
                line = [
                    r
                    for r in chosen
                    if r.network == network and r.policy == policy and r.bandwidth_mbps == bandwidth
                ]
                ax.plot(
                    [r.nodes for r in line],
                    [r.speedup for r in line],
                    color=f"C{color % 10}",
                    label=f"{network} ({policy})",
                    zorder=3,
                    **_POLICY_STYLE.get(policy, {"linestyle": ":", "marker": "x"}),
                )
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1.0, zorder=1)
        ax.set_title(f"{bandwidth:g} Mbit/s")
        ax.set_xlabel("nodes (master included)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(n) for n in ticks])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_ylabel("speedup vs the master alone")
        ax.grid(alpha=0.3, zorder=0)
    for ax in list(axes.flat)[len(bandwidths) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{scenario}: speedup, batch {batch}")
    fig.tight_layout()
    return fig


def speedup_vs_nodes(rows: Sequence[Row], folder: Path) -> list[Path]:
    """Per scenario and batch: :func:`speedup_figure`."""
    plt = _pyplot()
    written = []
    for scenario in _unique(r.scenario for r in rows):
        for batch in _unique(r.batch for r in rows if r.scenario == scenario):
            fig = speedup_figure(rows, scenario, batch)
            path = folder / f"speedup-nodes-{_slug(scenario)}-b{batch}.png"
            fig.savefig(path, dpi=DPI)
            plt.close(fig)
            written.append(path)
    return written


def speedup_heatmap(rows: Sequence[Row], folder: Path) -> list[Path]:
    """Per scenario, network, batch and policy with at least two bandwidths and two cluster
    sizes: speedup over nodes x bandwidth (green above 1, red below)."""
    plt = _pyplot()
    from matplotlib.colors import TwoSlopeNorm

    written = []
    groups = _unique((r.scenario, r.network, r.batch, r.policy) for r in rows)
    for scenario, network, batch, policy in groups:
        chosen = [
            r
            for r in rows
            if (r.scenario, r.network, r.batch, r.policy) == (scenario, network, batch, policy)
        ]
        nodes = sorted(_unique(r.nodes for r in chosen))
        bandwidths = sorted(_unique(r.bandwidth_mbps for r in chosen))
        if len(nodes) < 2 or len(bandwidths) < 2:
            continue
        grid = [[float("nan")] * len(nodes) for _ in bandwidths]
        for r in chosen:
            grid[bandwidths.index(r.bandwidth_mbps)][nodes.index(r.nodes)] = r.speedup
        values = [v for line in grid for v in line]
        low, high = min(min(values), 0.99), max(max(values), 1.01)
        fig, ax = plt.subplots(figsize=(1.0 + 0.65 * len(nodes), 1.2 + 0.45 * len(bandwidths)))
        image = ax.imshow(
            grid,
            origin="lower",
            aspect="auto",
            cmap="RdYlGn",
            norm=TwoSlopeNorm(vcenter=1.0, vmin=low, vmax=high),
        )
        for y, line in enumerate(grid):
            for x, value in enumerate(line):
                ax.text(x, y, f"{value:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(nodes)), [str(n) for n in nodes])
        ax.set_yticks(range(len(bandwidths)), [f"{b:g}" for b in bandwidths])
        ax.set_xlabel("nodes (master included)")
        ax.set_ylabel("bandwidth, Mbit/s")
        ax.set_title(f"{scenario}: {network}, batch {batch}, {policy} shares", fontsize=9)
        fig.colorbar(image, ax=ax, label="speedup")
        fig.tight_layout()
        path = folder / f"heatmap-{_slug(scenario)}-{_slug(network)}-b{batch}-{policy}.png"
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        written.append(path)
    return written


def breakdown_figure(rows: Sequence[Row], scenario: str, network: str, batch: int, bandwidth):
    """The step-time breakdown of one scenario, network, batch and bandwidth (a matplotlib
    Figure): one panel per policy, per cluster size the communication, convolution and comp
    side by side on a log axis (so a part a thousand times smaller than another still shows)
    and the whole step as a black bar across them; at most :data:`MAX_WIDTH_IN` wide."""
    plt = _pyplot()
    chosen = [
        r
        for r in rows
        if (r.scenario, r.network, r.batch, r.bandwidth_mbps)
        == (scenario, network, batch, bandwidth)
    ]
    nodes = _unique(r.nodes for r in chosen)
    policies = _unique(r.policy for r in chosen)
    width = min(MAX_WIDTH_IN, max(6.0, 2.0 + 0.3 * len(nodes) * len(_PARTS)))
    fig, axes = plt.subplots(
        len(policies), 1, figsize=(width, 0.8 + 2.6 * len(policies)), squeeze=False, sharex=True
    )
    positive = [getattr(r, key) for r in chosen for key, _, _ in _PARTS if getattr(r, key) > 0]
    low = min(positive, default=1e-3) / 2
    high = 2 * max((r.step_s for r in chosen), default=1.0)
    bar = 0.8 / len(_PARTS)
    for ax, policy in zip(axes.flat, policies, strict=True):
        line = {r.nodes: r for r in chosen if r.policy == policy}
        for p, (key, label, color) in enumerate(_PARTS):
            xs = [i + (p - (len(_PARTS) - 1) / 2) * bar for i in range(len(nodes))]
            heights = [getattr(line[n], key) if n in line else 0.0 for n in nodes]
            ax.bar(xs, heights, bar * 0.95, color=color, label=label, zorder=2)
        steps = [(i, line[n].step_s) for i, n in enumerate(nodes) if n in line]
        ax.hlines(
            [s for _, s in steps],
            [i - 0.45 for i, _ in steps],
            [i + 0.45 for i, _ in steps],
            color="black",
            linewidth=1.2,
            label="step",
            zorder=3,
        )
        ax.set_yscale("log")
        ax.set_ylim(low, high)
        ax.set_ylabel("seconds per step")
        ax.set_title(f"{policy} shares", fontsize=8)
        ax.grid(axis="y", alpha=0.3, zorder=0)
    last = axes.flat[-1]
    last.set_xticks(range(len(nodes)), [str(n) for n in nodes])
    last.set_xlabel("nodes (master included)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=4, fontsize=7, frameon=False)
    fig.suptitle(
        f"{scenario}: {network}, batch {batch}, {bandwidth:g} Mbit/s", fontsize=9, x=0.01, ha="left"
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def breakdown_bars(rows: Sequence[Row], folder: Path) -> list[Path]:
    """Per scenario, network, batch and bandwidth: :func:`breakdown_figure`."""
    plt = _pyplot()
    written = []
    groups = _unique((r.scenario, r.network, r.batch, r.bandwidth_mbps) for r in rows)
    for scenario, network, batch, bandwidth in groups:
        fig = breakdown_figure(rows, scenario, network, batch, bandwidth)
        path = folder / (
            f"breakdown-{_slug(scenario)}-{_slug(network)}-b{batch}-{bandwidth:g}mbps.png"
        )
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        written.append(path)
    return written


def plot_all(rows: Sequence[Row], folder: str | Path) -> list[Path]:
    """Every figure of ``rows`` into ``folder`` (created); returns the files written.

    Raises:
        PlotsUnavailable: matplotlib is not installed (the message says how to install it).
    """
    _pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return (
        speedup_vs_nodes(rows, folder)
        + speedup_heatmap(rows, folder)
        + breakdown_bars(rows, folder)
    )
