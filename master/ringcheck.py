"""Spot checks of the ring (:mod:`.ring`, :mod:`hetconv.ringcheck`): the master checks, from
each worker's sketches of its own gradient, that the ring's sum is the sum of what each node
computed, and, on the steps its spot checker draws, that a drawn worker computed its range
right.

A check that fails refuses the ring's sum: the step is computed here instead, from the same
weights (every range, or with batch norm the whole batch), so no step is lost and the step is
local training's; every worker, whose weights took the refused sum, is placed again next step.
A worker whose sketches differ from its range recomputed here is lost for the run, as one caught
by the split through the master is. Where the sketches of every contribution do not add up to
the sum's (a worker changed what it passed on, or sketched something else), every worker's range
is recomputed and compared: one whose sketches differ is lost; where none does, the sum is
refused all the same (``ring_sum_differs`` says so).
"""

from __future__ import annotations

import functools
import math
import time

import numpy as np

from hetconv.imagesplit import images_gradients
from hetconv.ring import flat
from hetconv.ringcheck import (
    answered_seed,
    sketch_answer,
    sketch_comparison,
    sketch_seed,
    sum_differs,
)

from .spotcheck import IMAGES_RTOL, Comparison, SpotCheckFailed

#: The layer name a ring's checks are filed under in the step's spot-check record.
RING_LAYER = "ring"


def drawn_ranges(split, model, x, labels, step: int, ring) -> tuple:
    """On a step the spot checker draws (``--spot-check-sample`` workers of the ring, drawn in
    secret), those workers' ranges recomputed here before their answers come -- the master
    runs it while the workers compute -- as (the drawn ring entries, the whole batch's part
    where batch norm needed it, each drawn worker's (gradients, losses)); else empty."""
    checker = split.spot_checks
    if checker is None or not checker.due or not ring:
        return ()
    picks = checker.sample(RING_LAYER, "forward", 0, slice(0, 1), len(ring), 1).images
    drawn = [ring[int(i)] for i in picks]
    start = time.perf_counter()
    whole, ranges = _recomputed(split, model, x, labels, step, drawn)
    checker.seconds += time.perf_counter() - start
    return drawn, whole, ranges


def check_ring(split, model, x, labels, step, ring, answers, summed, master_part, drawn=()):
    """``summed`` (by parameter) where the checks pass, else None; and the whole batch's part
    (gradients, losses, hits, seconds) where a check with batch norm computed it here (else
    None). ``master_part``: the master's own range's part, where it computed one; ``drawn``:
    :func:`drawn_ranges`'s."""
    checker = split.spot_checks
    names = list(model.parameters())
    vector = flat([summed[n] for n in names])
    sketches = [answers[n.name][7] for n, _, _ in ring]
    if master_part is not None:
        sketches.append(sketch_answer(flat([master_part[0][n] for n in names]), vector))
    seed = sketch_seed(vector)
    if all(answered_seed(a) == seed for a in sketches):
        differs, worst, allowed = sum_differs(vector, sketches)
    else:  # a rank's copy of the sum is not the one joined: the ranks summed apart
        differs, worst, allowed = True, math.inf, 0.0
    whole, ranges = (drawn[1], drawn[2]) if drawn else (None, {})
    checked = list(drawn[0]) if drawn else []
    if differs:
        split._events.emit(
            "ring_sum_differs", None, difference=float(f"{worst:.3g}"),
            allowed=float(f"{allowed:.3g}"), action="every range recomputed on the master",
            why="the sketches do not add up" if math.isfinite(worst)
            else "the ranks' copies of the sum differ",
        )  # fmt: skip
        start = time.perf_counter()
        rest = [r for r in ring if r[0].name not in ranges]
        more_whole, more = _recomputed(split, model, x, labels, step, rest)
        whole, checked = whole or more_whole, list(ring)
        ranges.update(more)
        checker.seconds += time.perf_counter() - start
    caught = False
    for node, _, _ in checked:
        own = flat([ranges[node.name][0][n] for n in names])
        got, want, scale = sketch_comparison(answers[node.name][7], own)
        comparisons = [
            Comparison("sketches", "the sketches of its own gradient", got, want, scale, False,
                       IMAGES_RTOL, norm=True),
            Comparison("losses", "the losses", answers[node.name][1], ranges[node.name][1],
                       float(np.abs(ranges[node.name][1]).max(initial=0.0)), False),
        ]  # fmt: skip
        try:
            checker.compare(node, RING_LAYER, "step", comparisons)
        except SpotCheckFailed as e:
            split.membership.lose(node, e)
            split._placed.pop(node.name, None)
            split._record[node.name].update(spot_check="failed")
            caught = True
    return (None, whole) if caught or differs else (summed, None)


def _recomputed(split, model, x, labels, step: int, drawn):
    """(the whole batch's part, where batch norm needed it, else None; each drawn worker's
    range's (gradients, losses) computed here from the step's weights). With batch norm a
    range's gradient takes the whole batch's statistics: the whole batch is computed first,
    its sums kept, and each range's sums are those (the running statistics left as the whole
    batch's pass set them)."""
    batch = len(x)
    if not split._batchnorm:
        ranges = {n.name: split._local(model, x, labels, f, c, batch, step) for n, f, c in drawn}
        return None, ranges
    kept = []

    def keep(sums: np.ndarray) -> np.ndarray:  # the whole batch's own sums are the batch's
        kept.append(np.array(sums, copy=True))
        return sums

    began = time.perf_counter()
    grads, losses, hits = images_gradients(model, x, np.asarray(labels), 0, batch, step, keep)
    whole = (grads, losses, hits, time.perf_counter() - began)
    after = {k: np.array(v) for k, v in model.buffers().items()}
    ranges = {}
    for node, first, count in drawn:
        rows = slice(first, first + count)
        replay = functools.partial(_next, iter(kept))
        got = images_gradients(model, x[rows], np.asarray(labels[rows]), first, batch, step, replay)
        ranges[node.name] = got[:2]
    for name, value in after.items():  # one pass's running statistics, the whole batch's
        model.buffers()[name][...] = value
    return whole, ranges


def _next(sums, _partial: np.ndarray) -> np.ndarray:
    """The whole batch's next sum, for a range's (whatever its own partial sum)."""
    return next(sums)


__all__ = ["RING_LAYER", "check_ring", "drawn_ranges"]
