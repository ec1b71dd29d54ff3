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

With batch norm a range's gradient takes the whole batch's statistics. Each worker answers its
parts of the step's batch norm sums (float64, as :func:`~hetconv.ring.split64`'s parts) and the
digest of the sums it took; the master joins the parts in rank order as the ring does, checks
that every worker took those sums, and recomputes a drawn worker's range with them in place of
the range's own (:class:`_Replay`), comparing its parts of the sums too. So a check costs the
drawn ranges, not the whole batch; it runs once the answers are in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from hetconv.imagesplit import images_gradients
from hetconv.ring import MASTER, flat, join64
from hetconv.ringcheck import (
    SUMS,
    answered_seed,
    check_seconds,
    sketch_answer,
    sketch_comparison,
    sketch_seed,
    sum_differs,
    sums_digest,
)
from hetconv.ringcheck import check_pricing as pricing

from .spotcheck import (
    IMAGES_RTOL,
    SKETCH_REST_RTOL,
    SKETCH_SCALE_RTOL,
    Comparison,
    SpotCheckFailed,
    norm_scale,
)

#: The layer name a ring's checks are filed under in the step's spot-check record.
RING_LAYER = "ring"


def check_pricing(checker, seconds_per_image: float, workers: int):
    """:func:`hetconv.ring.master_range_pays`' ``check``: what ``checker``'s checks (a spot
    checker, or None: no checks) add to a step on average (:func:`check_seconds`), the master
    recomputing at ``seconds_per_image`` ranges of ``workers``; by their chance, never a
    step's draw, so the ranges the choice cuts tell no worker which steps are checked."""
    return pricing(None if checker is None else checker.config, seconds_per_image, workers)


def drawn_ranges(split, model, x, labels, step: int, ring) -> tuple:
    """On a step the spot checker draws, ``ranges`` workers of the ring (``--spot-check-sample``)
    drawn in secret, as (the drawn ring entries, each one's (gradients, losses) recomputed
    here); the master recomputes them now, while the workers compute, but with batch norm (a
    range needs the whole batch's sums, which come with the answers: None, recomputed then).
    Else empty."""
    checker = split.spot_checks
    if checker is None or not checker.due or not ring:
        return ()
    picks = checker.ranges(RING_LAYER, len(ring))
    drawn = [ring[int(i)] for i in picks]
    if split._batchnorm:
        return drawn, None
    start = time.perf_counter()
    ranges = _recomputed(split, model, x, labels, step, drawn)
    checker.seconds += time.perf_counter() - start
    return drawn, ranges


def check_ring(split, model, x, labels, step, ring, answers, summed, master_part, drawn=()):
    """``summed`` (by parameter) where the checks pass, else None (the master computes the
    step). ``master_part``: the master's own range's part, where it computed one; ``drawn``:
    :func:`drawn_ranges`'s."""
    checker = split.spot_checks
    names = list(model.parameters())
    vector = flat([summed[n] for n in names])
    sketches = [answers[n.name][7] for n, _, _ in ring]
    seed = sketch_seed(vector)  # the digest of every value: taken once
    if master_part is not None:
        sketches.append(sketch_answer(flat([master_part[0][n] for n in names]), vector, seed))
    totals = _totals(ring, answers) if split._batchnorm else None
    why = _why_refused(vector, seed, sketches, ring, answers, totals, split._batchnorm)
    checked, ranges = (list(drawn[0]), dict(drawn[1] or {})) if drawn else ([], {})
    if split._batchnorm and checked and not why:  # run while the next step computes
        params, buffers = _state(model)
        split._late = LateCheck(
            step, checked, totals, {n.name: answers[n.name] for n, _, _ in checked}, x, labels,
            params, buffers, {k: np.array(v) for k, v in split._momentum.items()},
        )  # fmt: skip
        return summed
    if why:
        split._events.emit("ring_sum_differs", None, why=why,
                           action="every range recomputed on the master")  # fmt: skip
        checked = list(ring)
    if split._batchnorm and totals is None:
        checked = []  # no whole batch's sums to recompute a range with: refused unchecked
    start = time.perf_counter()
    rest = [r for r in checked if r[0].name not in ranges]
    ranges.update(_recomputed(split, model, x, labels, step, rest, totals))
    caught = False
    for node, _, _ in checked:
        try:
            checker.compare(
                node, RING_LAYER, "step", _comparisons(answers[node.name], ranges[node.name], names)
            )
        except SpotCheckFailed as e:
            split.membership.lose(node, e)
            split._placed.pop(node.name, None)
            split._record[node.name].update(spot_check="failed")
            caught = True
    checker.seconds += time.perf_counter() - start
    return None if caught or why else summed


@dataclass
class LateCheck:
    """A drawn step's check with batch norm, deferred: the master recomputes the drawn ranges
    while the next step's workers compute (:func:`run_late`), from what it kept of the step --
    its batch, the whole batch's sums, the drawn workers' answers, and its weights, running
    statistics and momentum before its update (to roll back to)."""

    step: int
    drawn: list
    totals: np.ndarray
    answers: dict
    x: np.ndarray
    labels: np.ndarray
    params: dict
    buffers: dict
    momentum: dict


def run_late(split, model) -> bool:
    """Run the deferred check, if one is pending. True where it caught a worker: that worker is
    lost, the master's copy (weights, running statistics, momentum) is rolled back to the
    checked step's and that step computed here from them (the whole batch), and every worker
    is placed again; the caller's step, computed from the refused sum's weights, must be
    computed here too."""
    late, split._late = split._late, None
    if late is None:
        return False
    checker, names = split.spot_checks, list(model.parameters())
    now = _state(model)
    _load(model, late.params, late.buffers)
    start = time.perf_counter()
    ranges = _recomputed(split, model, late.x, late.labels, late.step, late.drawn, late.totals)
    caught = False
    for node, _, _ in late.drawn:
        try:
            checker.compare(
                node,
                RING_LAYER,
                "step",
                _comparisons(late.answers[node.name], ranges[node.name], names),
            )
        except SpotCheckFailed as e:
            split.membership.lose(node, e)
            caught = True
    checker.seconds += time.perf_counter() - start
    if not caught:
        _load(model, *now)
        return False
    split._momentum = late.momentum
    split._placed.clear()
    batch = len(late.x)
    whole = split._local(model, late.x, late.labels, 0, batch, batch, late.step)
    split._set_gradients(model, [whole[0]])
    split._update(model, model.gradients(), {}, MASTER)
    split._events.emit(
        "step_recomputed", None, recomputed=late.step,
        why="a spot check of its ring, run during the next step, caught a worker",
    )  # fmt: skip
    return True


def _state(model) -> tuple[dict, dict]:
    return (
        {k: np.array(v) for k, v in model.parameters().items()},
        {k: np.array(v) for k, v in model.buffers().items()},
    )


def _load(model, params: dict, buffers: dict) -> None:
    for target, values in ((model.parameters(), params), (model.buffers(), buffers)):
        for name, value in values.items():
            target[name][...] = value


def _why_refused(vector, seed: int, sketches, ring, answers, totals, batchnorm: bool) -> str:
    """Why the step's sum (``vector``, its :func:`~hetconv.ringcheck.sketch_seed` ``seed``)
    does not add up ("" where it does)."""
    if any(answered_seed(a) != seed for a in sketches):
        return "the ranks' copies of the sum differ"
    if batchnorm:
        if totals is None:
            return "the workers' batch norm sums do not fit together"
        want = tuple(sums_digest(totals))
        if any(tuple(answers[n.name][7][SUMS]) != want for n, _, _ in ring):
            return "a worker took batch norm sums that are not the sums of every worker's parts"
    differs, worst, allowed = sum_differs(vector, sketches, seed)
    if differs:
        return f"the sketches do not add up: {worst:.3g} apart, {allowed:.3g} allowed"
    return ""


def _totals(ring, answers) -> np.ndarray | None:
    """The step's batch norm sums as every worker took them (its parts joined in rank order,
    as :meth:`~hetconv.worker.ring.RingCalls.sum64` joins them); None where the workers'
    parts are not of one size."""
    streams = [answers[n.name][8] for n, _, _ in ring]
    if not streams or len({s.size for s in streams}) != 1 or streams[0].size % 2:
        return None
    return join64(streams)


def _comparisons(answer, mine, names) -> list[Comparison]:
    """A worker's sketches and losses (and batch norm parts) against its range's here."""
    got, want, scale = sketch_comparison(answer[7], flat([mine[0][n] for n in names]))
    out = [
        *sketch_comparisons(got, want, scale),
        Comparison("losses", "the losses", answer[1], mine[1],
                   float(np.abs(mine[1]).max(initial=0.0)), False),
    ]  # fmt: skip
    if len(mine) > 2:  # its parts of batch norm's sums
        parts = join64([answer[8]]) if answer[8].size else np.zeros(0)
        want_parts = mine[2] if parts.shape == mine[2].shape else np.zeros_like(parts)
        out.append(Comparison("sums", "its parts of batch norm's sums", parts, want_parts,
                              norm_scale(mine[2]), False, IMAGES_RTOL, norm=True))  # fmt: skip
    return out


def sketch_comparisons(got: np.ndarray, want: np.ndarray, scale: float) -> list[Comparison]:
    """A worker's sketches ``got`` against the master's ``want`` (of its range recomputed; of
    ``scale``, :func:`~hetconv.ringcheck.sketch_comparison`'s) as a scaling and what is left:
    their projection on the master's, 1 within :data:`~.spotcheck.SKETCH_SCALE_RTOL`, and the
    rest across them under :data:`~.spotcheck.SKETCH_REST_RTOL` of the scale. A non-finite or
    (against none) nonzero answer fails the first."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    norm2 = float(want @ want)
    if norm2 > 0:
        projection = float(got @ want) / norm2
        rest = got - projection * want
    else:  # the master computed nothing: so must the worker have
        projection, rest = (1.0 if not got.any() else np.inf), got
    if not np.isfinite(projection) or not np.isfinite(got).all():
        projection, rest = np.inf, np.full_like(got, np.inf)
    return [
        Comparison("sketches", "the scale of the sketches of its own gradient over the "
                   "master's (their projection: 1 when honest)", np.array([projection]),
                   np.array([1.0]), 1.0, False, SKETCH_SCALE_RTOL),
        Comparison("sketches", "the sketches of its own gradient beyond that scale", rest,
                   np.zeros_like(rest), scale, False, SKETCH_REST_RTOL, norm=True),
    ]  # fmt: skip


def _recomputed(split, model, x, labels, step: int, drawn, totals=None) -> dict:
    """Each drawn worker's range computed here from the step's weights: (gradients, losses),
    and with batch norm its parts of the sums, the whole batch's sums ``totals`` taken in
    their place (the running statistics left as they were)."""
    batch = len(x)
    if not split._batchnorm:
        return {n.name: split._local(model, x, labels, f, c, batch, step)[:2]
                for n, f, c in drawn}  # fmt: skip
    before = {k: np.array(v) for k, v in model.buffers().items()}
    ranges = {}
    for node, first, count in drawn:
        rows = slice(first, first + count)
        replay = _Replay(totals)
        grads, losses, _ = images_gradients(
            model, x[rows], np.asarray(labels[rows]), first, batch, step, replay
        )
        ranges[node.name] = (grads, losses, replay.parts())
    for name, value in before.items():
        model.buffers()[name][...] = value
    return ranges


class _Replay:
    """``reduce`` for a range recomputed with the whole batch's sums: each call's total from
    ``totals`` in order, its own part kept (:meth:`parts`)."""

    def __init__(self, totals: np.ndarray):
        self.totals, self.at, self.kept = totals, 0, []

    def __call__(self, part: np.ndarray) -> np.ndarray:
        n = part.size
        if self.at + n > self.totals.size:  # fewer sums answered than a range takes: its own
            return np.asarray(part, np.float64)  # (the comparisons then tell)
        self.kept.append(np.asarray(part, np.float64))
        out = self.totals[self.at : self.at + n].copy()
        self.at += n
        return out

    def parts(self) -> np.ndarray:
        return np.concatenate(self.kept) if self.kept else np.zeros(0)


__all__ = [
    "RING_LAYER",
    "LateCheck",
    "check_pricing",
    "check_ring",
    "check_seconds",
    "drawn_ranges",
    "run_late",
    "sketch_comparisons",
]
