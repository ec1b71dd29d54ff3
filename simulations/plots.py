"""Figures of a sweep: speedup vs nodes, speedup over nodes x bandwidth, step-time breakdown.

matplotlib is optional (``pip install 'hetconv[plot]'``) and imported only here, when a plot is
asked for; it draws to files with the non-interactive Agg backend.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from .sweep import Row

_POLICY_STYLE = {"compute": "-", "link": "--"}
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


def speedup_vs_nodes(rows: Sequence[Row], folder: Path) -> list[Path]:
    """Per scenario and batch: speedup against cluster size, one colour per network, solid for
    compute shares and dashed for link-aware ones, one panel per bandwidth."""
    plt = _pyplot()
    written = []
    for scenario in _unique(r.scenario for r in rows):
        mine = [r for r in rows if r.scenario == scenario]
        for batch in _unique(r.batch for r in mine):
            chosen = [r for r in mine if r.batch == batch]
            bandwidths = _unique(r.bandwidth_mbps for r in chosen)
            cols = min(3, len(bandwidths))
            nrows = -(-len(bandwidths) // cols)
            fig, axes = plt.subplots(
                nrows, cols, figsize=(5 * cols, 3.8 * nrows), squeeze=False, sharey=True
            )
            for ax, bandwidth in zip(axes.flat, bandwidths, strict=False):
                for color, network in enumerate(_unique(r.network for r in chosen)):
                    for policy in _unique(r.policy for r in chosen):
                        line = [
                            r
                            for r in chosen
                            if r.network == network
                            and r.policy == policy
                            and r.bandwidth_mbps == bandwidth
                        ]
                        ax.plot(
                            [r.nodes for r in line],
                            [r.speedup for r in line],
                            _POLICY_STYLE.get(policy, ":"),
                            marker="o",
                            markersize=3,
                            color=f"C{color % 10}",
                            label=f"{network} ({policy})",
                        )
                ax.axhline(1.0, color="grey", linewidth=0.8)
                ax.set_title(f"{bandwidth:g} Mbit/s")
                ax.set_xlabel("nodes (master included)")
                ax.set_xscale("log", base=2)
                ax.set_ylabel("speedup vs the master alone")
                ax.grid(alpha=0.3)
            for ax in list(axes.flat)[len(bandwidths) :]:
                ax.set_visible(False)
            axes.flat[0].legend(fontsize=7)
            fig.suptitle(f"{scenario}: speedup, batch {batch}")
            fig.tight_layout()
            path = folder / f"speedup-nodes-{_slug(scenario)}-b{batch}.png"
            fig.savefig(path, dpi=110)
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
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def breakdown_bars(rows: Sequence[Row], folder: Path) -> list[Path]:
    """Per scenario, network, batch and bandwidth: the step's communication, convolution and
    comp stacked, per cluster size, one bar per policy."""
    plt = _pyplot()
    written = []
    groups = _unique((r.scenario, r.network, r.batch, r.bandwidth_mbps) for r in rows)
    for scenario, network, batch, bandwidth in groups:
        chosen = [
            r
            for r in rows
            if (r.scenario, r.network, r.batch, r.bandwidth_mbps)
            == (scenario, network, batch, bandwidth)
        ]
        nodes = _unique(r.nodes for r in chosen)
        policies = _unique(r.policy for r in chosen)
        width = 0.8 / len(policies)
        fig, ax = plt.subplots(figsize=(max(5.0, 0.7 * len(nodes) * len(policies) + 2), 4))
        for p, policy in enumerate(policies):
            line = {r.nodes: r for r in chosen if r.policy == policy}
            xs = [i + (p - (len(policies) - 1) / 2) * width for i in range(len(nodes))]
            bottom = [0.0] * len(nodes)
            for key, label, color in _PARTS:
                heights = [getattr(line[n], key) if n in line else 0.0 for n in nodes]
                ax.bar(
                    xs,
                    heights,
                    width * 0.95,
                    bottom=bottom,
                    color=color,
                    hatch="//" if p else None,
                    edgecolor="white",
                    label=f"{label}" if p == 0 else None,
                )
                bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
            for x, n in zip(xs, nodes, strict=True):
                if n in line:
                    ax.text(x, bottom[nodes.index(n)], policy[0], ha="center", va="bottom",
                            fontsize=7)  # fmt: skip
        ax.set_xticks(range(len(nodes)), [str(n) for n in nodes])
        ax.set_xlabel("nodes (master included); bars: c = compute shares, l = link-aware")
        ax.set_ylabel("seconds per step")
        ax.set_title(f"{scenario}: {network}, batch {batch}, {bandwidth:g} Mbit/s", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = folder / (
            f"breakdown-{_slug(scenario)}-{_slug(network)}-b{batch}-{bandwidth:g}mbps.png"
        )
        fig.savefig(path, dpi=110)
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
