"""Shares that follow measured speed: a node whose compute drifts gets its figures scaled.

Every ``every`` steps each active node's compute is compared with its own at the same share:
the median compute of the first period after the shares were planned is its baseline per layer,
and each later period's median is compared with that. (Comparing with the probe instead would
not do: a smaller share costs more per kernel, since the input's lowering does not shrink with
it, and the shares would feed on that.) A machine that gets busy slows down on every layer, so
a node's factor is the geometric mean over its layers: one noisy layer does not move it. A
factor at least ``change`` away from 1 scales the node's probe figures, and the planner splits
the kernels again.
"""

from __future__ import annotations

import collections
import statistics
import threading
from collections.abc import Sequence

import numpy as np

from .membership import ACTIVE, Node


def per_layer(records: dict[str, dict], figure: str):
    """``(node name, layer, forward + backward figure)`` of every layer in a step's
    ``records`` (node name -> layer -> phase figures) that ran both phases; ``figure``:
    ``"compute_seconds"`` or ``"wall_seconds"``."""
    for name, layers in records.items():
        for layer, figures in layers.items():
            if "forward" in figures and "backward" in figures:
                yield name, layer, figures["forward"][figure] + figures["backward"][figure]


def drift_text(name: str, factor: float) -> str:
    """A node's drift in words: ``127.0.0.1:50052 2.1x slower than its own baseline at the same
    share`` (``factor``: its compute now over its baseline; below 1 it got faster)."""
    if factor >= 1:
        return f"{name} {factor:.1f}x slower than its own baseline at the same share"
    return f"{name} {1 / factor:.1f}x faster than its own baseline at the same share"


class DriftMonitor:
    """Per node and layer, recent compute seconds at the current shares and their baseline.

    Args:
        every: steps between checks (0: never; the split stays as planned).
        change: the relative drift that counts.
    """

    def __init__(self, every: int, change: float):
        if every < 0 or not 0 < change:
            raise ValueError(
                f"rebalancing every {every} steps on a change of {change}: "
                "need steps >= 0 and a change > 0"
            )
        self.every, self.change = every, change
        self._windows: dict[str, dict[str, collections.deque]] = {}
        self._baselines: dict[str, dict[str, float]] = {}
        self._warming = True  # the next step's measurements are left out
        self._lock = threading.Lock()

    def due(self, step: int) -> bool:
        return bool(self.every) and step > 0 and step % self.every == 0

    def observe(self, records: dict[str, dict], any_failed: bool) -> None:
        """Keep the compute seconds of a step's calls (``records``: node name -> layer ->
        phase figures), forward + backward per layer. Steps in which a node failed are left
        out: the master's figures then include recomputed slices."""
        if not self.every or any_failed:
            return
        if self._warming:  # the first step on new shares: connections, caches, allocations
            self._warming = False
            return
        with self._lock:
            for name, layer, seconds in per_layer(records, "compute_seconds"):
                window = self._windows.setdefault(name, {}).setdefault(
                    layer, collections.deque(maxlen=self.every)
                )
                window.append(seconds)

    def drifted(self, nodes: Sequence[Node]) -> str:
        """Scale the figures of every active node whose speed has changed by ``change`` or
        more; what changed, in words (:func:`drift_text`, ``; `` between nodes; '' if
        nothing)."""
        least = max(3, self.every // 2)
        drifted = []
        with self._lock:
            for node in nodes:
                if node.state != ACTIVE:
                    continue
                ratios = []
                baselines = self._baselines.setdefault(node.name, {})
                for layer, window in self._windows.get(node.name, {}).items():
                    if len(window) < least or layer not in node.probe_seconds:
                        continue
                    seen = statistics.median(window)
                    window.clear()
                    baseline = baselines.setdefault(layer, seen)
                    ratios.append(seen / max(baseline, 1e-12))
                if not ratios:
                    continue
                factor = float(np.exp(np.mean(np.log(np.maximum(ratios, 1e-12)))))
                if abs(factor - 1) >= self.change:
                    for layer in node.probe_seconds:
                        node.probe_seconds[layer] *= factor
                    drifted.append(drift_text(node.name, factor))
        return "; ".join(drifted)

    def forget(self) -> None:
        """New shares: measurements so far were made at the old ones."""
        with self._lock:
            self._warming = True
            self._windows.clear()
            self._baselines.clear()

    def forget_node(self, name: str) -> None:
        """A worker came back: it may be another machine now, or less busy."""
        with self._lock:
            self._windows.pop(name, None)
            self._baselines.pop(name, None)


def replan_reason(
    came_or_went: bool, drift: DriftMonitor, settling, nodes: Sequence[Node], plans, step: int
) -> str | None:
    """Why the shares are planned again at ``step``, or None: workers came or went, a node's
    compute drifted (``drift``), or the shares settle on the nodes' finish times (``settling``,
    a :class:`~.settling.SettleMonitor`); ``plans``: layer -> its current plan."""
    if came_or_went:
        return "workers came or went"
    if drift.due(step):
        drifted = drift.drifted(nodes)
        if drifted:
            return f"{drifted}: kernels re-split by measured speed"
    if settling.due():
        settled = settling.settle(nodes, {name: plan.shares for name, plan in plans.items()})
        if settled:
            return f"settled on the nodes' finish times: {settled}"
    return None
