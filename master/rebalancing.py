"""Shares that follow measured speed: a node whose compute drifts gets its figures scaled.

Every ``every`` steps each active node's compute is compared with its own at the same share:
the median compute of the first period after the shares were planned is its baseline per layer,
and each later period's median is compared with that. (Comparing with the probe instead would
not do: a smaller share costs more per kernel, since the input's lowering does not shrink with
it, and the shares would feed on that.) A machine that gets busy slows down on every layer, so
a node's factor is the geometric mean over its layers: one noisy layer does not move it. A
factor at least ``change`` away from 1 scales the node's probe figures, and the planner splits
the kernels again.

One check moves a node's figures by :data:`MOST_DRIFT` at most: a period's median whose baseline
was taken while the machine was busy for a moment (on one machine shared by master and workers,
8.8x slower in one period, 7.3x faster in the next) would otherwise swing the shares from one
end to the other; a drift that lasts goes on moving it at the next check. One noisy step does
not move it at all: the median of a period needs at least three steps, and half of them.

A worker whose shares all drop to zero (the ``link`` policy finds it a net loss at its figures)
would never be measured again: no call, no compute time. :class:`IdleProbes` probes such an
*idle* worker again, on a thread beside the training, ``every`` steps after it fell idle; its
fresh figures replace the scaled ones and the shares are planned again at the next step
boundary, so a worker that was busy for a while earns its work back. A probe that leaves it
idle doubles the wait before the next (at most :data:`MOST_IDLE_WAIT` periods); a probe that
fails loses the worker, as a failed call does.
"""

from __future__ import annotations

import collections
import statistics
import threading
from collections.abc import Sequence

import numpy as np

from .call import Call
from .membership import ACTIVE, Membership, Node

#: The most one check scales a node's figures by (either way).
MOST_DRIFT = 4.0
#: The longest wait before probing an idle worker again, in periods of ``every`` steps.
MOST_IDLE_WAIT = 16


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
                    scale = min(max(factor, 1 / MOST_DRIFT), MOST_DRIFT)
                    for layer in node.probe_seconds:
                        node.probe_seconds[layer] *= scale
                    text = drift_text(node.name, factor)
                    if scale != factor:
                        text += f" (its figures moved {MOST_DRIFT:.0f}x, the most one check may)"
                    drifted.append(text)
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


class IdleProbes:
    """Idle workers (active, no kernel of any layer) probed again so they can earn work back.

    Args:
        every: steps from a worker falling idle to its first probe (0: never probed again).
        probe: times every layer on a worker (connects, measures its link, probes), returning
            layer -> seconds; raises if it cannot (the cluster's own, as for a worker that
            comes back).
        membership: the cluster's (who is idle; a worker whose probe fails is lost).
        events: where ``worker_idle`` and ``worker_reprobed`` go (an
            :class:`~.events.EventLog`).
    """

    def __init__(self, every: int, probe, membership: Membership, events):
        self.every = every
        self._probe, self._membership, self._events = probe, membership, events
        self._due: dict[str, int] = {}  # idle worker -> the step its next probe starts after
        self._wait: dict[str, int] = {}  # worker -> steps between probes now (kept: it doubles)
        self._calls: dict[str, tuple[Node, Call]] = {}  # probes in flight

    def watch(self, step: int, plans) -> dict:
        """At the end of ``step``: note who is idle (event ``worker_idle`` as one falls idle)
        and start the probes due. Returns the step record's ``idle`` (the idle workers' names)
        when there are any, else ``{}``; ``plans``: layer -> its plan."""
        idle = self._membership.idle_workers(plans)
        names = {node.name for node in idle}
        for name in set(self._due) - names:  # it has work again, or is lost or gone
            del self._due[name]
        for node in idle:
            if node.name not in self._due:
                wait = self._wait.setdefault(node.name, self.every)
                self._due[node.name] = step + wait
                then = f"probed again after step {step + wait}" if self.every else "not probed"
                why = f"it answers but has no kernel of any layer; {then}"
                self._events.emit("worker_idle", node.name, reason=why)
            elif self.every and step >= self._due[node.name] and node.name not in self._calls:
                self._calls[node.name] = (node, Call(self._probe, node))
        return {"idle": sorted(names)} if names else {}

    def take(self, step: int, drift: DriftMonitor) -> str:
        """At the start of ``step``: the probes that have ended. Each worker's figures become
        what it measured now (its drift forgotten); one that failed is lost. Which workers
        were probed, in words ('' if none)."""
        probed = []
        for name, (node, call) in list(self._calls.items()):
            if not call.done():
                continue
            del self._calls[name]
            if node.state != ACTIVE:  # lost meanwhile: the monitor probes it as it comes back
                continue
            if call.failed():
                self._membership.lose(node, call.error())
                continue
            seconds = call.result()
            node.probe_seconds.update(seconds)
            drift.forget_node(name)
            wait = min(2 * self._wait.get(name, self.every), MOST_IDLE_WAIT * self.every)
            self._wait[name] = wait
            if name in self._due:  # if still idle after this step's plan, the next probe
                self._due[name] = step + wait
            figures = ", ".join(f"{layer} {1e3 * t:.1f} ms" for layer, t in seconds.items())
            self._events.emit("worker_reprobed", name, probe=figures)
            probed.append(name)
        if not probed:
            return ""
        were = "was" if len(probed) == 1 else "were"
        return f"{', '.join(probed)} had no kernel and {were} probed again"


def replan_reason(
    came_or_went: bool,
    drift: DriftMonitor,
    settling,
    nodes: Sequence[Node],
    plans,
    step: int,
    idle: IdleProbes | None = None,
) -> str | None:
    """Why the shares are planned again at ``step``, or None: workers came or went, an idle
    worker was probed again (``idle``), a node's compute drifted (``drift``), or the shares
    settle on the nodes' finish times (``settling``, a :class:`~.settling.SettleMonitor`);
    ``plans``: layer -> its current plan."""
    probed = idle.take(step, drift) if idle is not None else ""
    if came_or_went:
        return "workers came or went"
    if probed:
        return probed
    if drift.due(step):
        drifted = drift.drifted(nodes)
        if drifted:
            return f"{drifted}: kernels re-split by measured speed"
    if settling.due():
        settled = settling.settle(nodes, {name: plan.shares for name, plan in plans.items()})
        if settled:
            return f"settled on the nodes' finish times: {settled}"
    return None
