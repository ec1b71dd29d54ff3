"""Shares that settle, once, on the nodes' measured finish times a few steps after the plan.

The probe times each node on the whole layer once, before training. On a shared machine the
probes of identical nodes, one at a time, differ by up to 16-21 % (paper-150-800 on the
testbed, best of 2; at once, as :func:`~.probing.probe_every` runs them by default, mostly
1-5 %), and the planned split follows that noise: the worker whose probe came out slow gets
fewer kernels and waits for the others every step (``benchmarks/testbed.py --modes exact_head
exact_head_equal``). The plan also does not see all of the master's own work in a phase (its
calls' bookkeeping, the summing of the workers' parts): at paper-150-800 batch 64 on the
testbed the master got the most kernels (165-180 against the workers' 150-167) and the step
grew with its share (2.61-2.62 s at 160-165, 2.76-2.97 s at 174-180). :mod:`.rebalancing`
cannot see either: it compares a node with its own first steps, not with the other nodes.

After ``steps`` steps on the planned shares (the first :data:`WARMING_STEPS` after a plan are
left out: they fault in memory and were 10-40 % slower on the testbed), each
node's median wall time per layer (forward + backward; a worker's from request sent to answer
in, as the master sees it; the master's from the phase's start to its own piece, and what it
does beside it, done) gives its measured seconds per kernel, ``wall / share``, and the kernels
are split again in proportion to the inverse, the paper's rule on measured figures instead of
the probe (their total stays). What every node pays whatever its share (its copy of a
replicated block, the halo, the call) is in those figures too, so the split moves toward equal
walls but not all the way: it never overshoots, and on identical workers it moves a worker the
probe found slow about half way back (paper-150-800 at batch 16 on the testbed: workers
at 162 172 165 129 kernels taking about 0.60 0.60 0.62 0.52 s go to 159 167 157 145). Where some
node's share would move by ``change`` or more, the nodes' probe figures are scaled by
``k_old / k_new`` so that the planner splits that way from then on (after a rebalance, and when
workers come or go). A node without a measured wall (a master that computes no share) is left
out and keeps its figure.

Walls whose spread is within three times the steps' own scatter (the largest median absolute
deviation of a node's walls), or under ``change`` of their mean, move nothing: on small
layers, where every call's fixed cost and the machine's noise are most of a wall, the walls say
nothing about the split. It settles once a run.
"""

from __future__ import annotations

import collections
import statistics
import threading
from collections.abc import Mapping, Sequence

from hetconv.balance import kernel_shares

from .membership import ACTIVE, Node
from .rebalancing import per_layer

#: Steps after a plan that settling does not measure: the first two steps' page faults and first
#: allocations made them 10-40 % slower than the rest (paper-150-800 on the testbed: 1.25-1.39 s
#: and 0.85-0.94 s, then 0.78-0.91 s at batch 16; 3.1-3.5 s, then 2.6-3.7 s, then 2.4-2.6 s at
#: batch 64).
WARMING_STEPS = 2


def settled_shares(shares: Sequence[int], walls: Sequence[float]) -> list[int]:
    """Kernels split again in proportion to ``share / wall`` (each node's measured kernels
    per second), their total kept, by largest remainders
    (:func:`~hetconv.balance.kernel_shares`)."""
    if len(shares) != len(walls) or not shares:
        raise ValueError("shares and walls must be as long, and not empty")
    if min(shares) < 1 or not min(walls) > 0:
        raise ValueError(f"shares {list(shares)} must be >= 1 and walls {list(walls)} > 0")
    return kernel_shares(sum(shares), [w / k for k, w in zip(shares, walls, strict=True)])


class SettleMonitor:
    """Per node and layer, wall seconds of the steps since the plan; :meth:`settle` once.

    Args:
        steps: measured steps before settling (0: never; the split stays as planned).
        change: the least relative move of some node's share that is worth re-splitting.
    """

    def __init__(self, steps: int, change: float = 0.05):
        if steps < 0 or not 0 < change:
            raise ValueError(f"settling after {steps} steps on a change of {change}")
        self.steps, self.change = steps, change
        self.done = False  # settled (never, with steps 0: due() is False then)
        self._walls: dict[str, dict[str, collections.deque]] = {}
        self._seen = 0
        self._warming = WARMING_STEPS
        self._lock = threading.Lock()

    def observe(self, records: Mapping[str, Mapping], any_failed: bool) -> None:
        """Keep a step's walls (``records``: node name -> layer -> phase figures); steps with a
        failure are left out, as are the first :data:`WARMING_STEPS` after a plan."""
        if not self.steps or self.done or any_failed:
            return
        if self._warming:
            self._warming -= 1
            return
        with self._lock:
            for name, layer, wall in per_layer(records, "wall_seconds"):
                self._walls.setdefault(name, {}).setdefault(
                    layer, collections.deque(maxlen=self.steps)
                ).append(wall)
            self._seen += 1

    def due(self) -> bool:
        return bool(self.steps) and not self.done and self._seen >= self.steps

    def settle(self, nodes: Sequence[Node], shares: Mapping[str, Sequence[int]]) -> str:
        """Scale the nodes' figures where their walls say the split is off; what moved, in
        words (``''``: nothing). ``shares``: layer -> kernels per node (master first)."""
        if self.done:
            return ""
        self.done = True
        moved = []
        with self._lock:
            for layer, split in shares.items():
                chosen = [
                    i
                    for i, node in enumerate(nodes)
                    if i < len(split)
                    and node.state == ACTIVE
                    and split[i] > 0
                    and node.probe_seconds.get(layer, 0) > 0
                    and len(self._walls.get(node.name, {}).get(layer, ())) >= self.steps
                    and min(self._walls[node.name][layer]) > 0  # (a master's wall of 0: none)
                ]
                if len(chosen) < 2:
                    continue
                seen = [self._walls[nodes[i].name][layer] for i in chosen]
                walls = [statistics.median(w) for w in seen]
                # Only a spread beyond the steps' own scatter says anything: three times the
                # largest median absolute deviation, and ``change`` of the mean wall.
                scatter = max(
                    statistics.median(abs(v - m) for v in w)
                    for w, m in zip(seen, walls, strict=True)
                )
                spread = max(walls) - min(walls)
                if spread <= max(3 * scatter, self.change * statistics.fmean(walls)):
                    continue
                old = [split[i] for i in chosen]
                new = settled_shares(old, walls)
                if min(new) < 1 or max(abs(b - a) / a for a, b in zip(old, new, strict=True)) < (
                    self.change
                ):
                    continue
                for i, a, b in zip(chosen, old, new, strict=True):
                    nodes[i].probe_seconds[layer] *= a / b
                pairs = zip(chosen, old, new, strict=True)
                moves = " ".join(f"{nodes[i].name} {a}->{b}" for i, a, b in pairs)
                moved.append(f"{layer} {moves}")
        return "; ".join(moved)

    def forget(self) -> None:
        """New shares before settling: measurements so far were made at the old ones."""
        with self._lock:
            self._walls.clear()
            self._seen = 0
            self._warming = WARMING_STEPS
