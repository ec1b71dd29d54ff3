"""Spot checks of the ring's sum (:mod:`hetconv.ring`): each worker's own gradient, which the
ring never sends to the master, as a few numbers the master can check.

A worker keeps a copy of its own gradient before the ring sums it in place. After the ring it
answers :data:`SKETCHES` sketches of that copy -- signed sums of its sums over blocks of
:data:`SKETCH_BLOCK` values, the signs drawn from a seed that is the digest of the ring's sum
itself (:func:`sketch_seed`: known to no rank before every contribution is in) -- and the sum
of its absolute values and the seed (:func:`sketch_answer`). The master checks:

* every step, that every worker drew its signs from the sum the master joined of the ranks'
  chunks (:func:`answered_seed`: a rank whose copy of the sum differs drew others), and that the
  sketches of every contribution (the workers' and the master's own range's) add up to the
  sketch of that sum (:func:`sum_differs`): a worker that changed what it passed on, or answered
  a sketch of something else, breaks that;
* on the steps the spot checker draws, a drawn worker's sketch against the sketch of its range
  recomputed on the master (:func:`sketch_comparison`, by the worker's own seed), as the split
  by images through the master compares the whole gradient: a worker whose gradient was wrong
  is caught so.

A sketch is linear in the gradient, so the sums compare up to float32 round-off: a wrong
contribution is missed only where each of its blocks sums to what it should, or the signs
cancel its error in all :data:`SKETCHES` sketches at once.
"""

from __future__ import annotations

import math

import numpy as np

from .ring import SKETCH_VALUES, digest, digest_of_values, digest_values, split64

#: Signed sums each worker answers. Its answer's values: these, its absolute sum, its seed and
#: the digest of the batch norm sums it took (:func:`sums_digest`), each as 4 values of 16 bits.
SKETCHES = SKETCH_VALUES - 9
SEED = slice(SKETCHES + 1, SKETCHES + 5)
SUMS = slice(SKETCHES + 5, SKETCHES + 9)
#: Values per block: the signs are drawn per block, not per value (a gradient of 9 million
#: values, vgg11's, has 36 thousand blocks; its block sums are one pass over it).
SKETCH_BLOCK = 256


#: Bytes of a gradient per second of a whole core that one pass of the checks over it takes:
#: the digest of the sum (the sketches' seed) and its block sums on the master, a worker's
#: sketch answer of its own gradient (13-20 ms for paper-150-800's 14 MB on an AMD EPYC core,
#: ``python benchmarks/spot_checks.py --passes``).
CHECK_BYTES_PER_S = 0.7e9


def check_pass_seconds(nbytes: float, costs=None) -> float:
    """Seconds of one pass of the checks (:data:`CHECK_BYTES_PER_S`) over ``nbytes`` of
    gradient, at the share of a core ``costs`` were scaled to
    (:meth:`hetconv.dataparallel.CollectiveCosts.scaled`, as its adds)."""
    from hetconv.dataparallel import CollectiveCosts

    share = (costs or CollectiveCosts()).sum_bytes_per_s / CollectiveCosts().sum_bytes_per_s
    return nbytes / (CHECK_BYTES_PER_S * share)


def check_seconds(checks, alone_s: float, workers: int, step_s: float) -> float:
    """What the ring's spot checks (``checks``: their ``every`` and ``ranges``, as
    :class:`hetconv.master.spotcheck.SpotCheckConfig` holds them) cost a step on average
    beside its passes: on a drawn step (one in ``every``) the master recomputes the drawn
    ranges (``ranges`` of the workers, each about an equal share of the batch, at its speed
    for the whole batch ``alone_s``) while the workers compute a step of ``step_s`` (the same
    step's, or with batch norm the next one's): only what passes that step counts."""
    if not checks.every or not workers:
        return 0.0
    ranges = alone_s * min(checks.ranges, workers) / workers
    return max(0.0, ranges - step_s) / checks.every


def check_pricing(checks, seconds_per_image: float, workers: int):
    """A ``check(images, beside_s)`` (:func:`hetconv.ring.master_range_pays`',
    :func:`hetconv.imagecost.simulate_image_split`'s) for ``checks`` (their ``every`` and
    ``ranges``; None: no checks, None returned): :func:`check_seconds` with the master
    recomputing at ``seconds_per_image`` drawn ranges of ``workers``; by the checks' chance,
    never a step's draw."""
    if checks is None:
        return None
    return lambda images, beside_s: check_seconds(
        checks, seconds_per_image * images, workers, beside_s
    )


def block_sums(vector: np.ndarray) -> np.ndarray:
    """float64 sums of ``vector``'s consecutive blocks of :data:`SKETCH_BLOCK` values (the
    last one short)."""
    v = np.asarray(vector, np.float32).reshape(-1)
    full = v.size // SKETCH_BLOCK
    sums = v[: full * SKETCH_BLOCK].reshape(full, SKETCH_BLOCK).sum(axis=1, dtype=np.float64)
    if v.size > full * SKETCH_BLOCK:
        sums = np.append(sums, v[full * SKETCH_BLOCK :].sum(dtype=np.float64))
    return sums


def sketch_seed(summed: np.ndarray) -> int:
    """The seed of a step's signs: the digest of the ring's sum (every value)."""
    return int.from_bytes(digest([np.asarray(summed, np.float32)]), "little")


def sketches(vector: np.ndarray, seed: int) -> np.ndarray:
    """float64 (:data:`SKETCHES`,): signed sums of ``vector``'s block sums, the signs drawn
    from ``seed``."""
    blocks = block_sums(vector)
    signs = np.random.default_rng(seed).integers(0, 2, (SKETCHES, blocks.size), np.int8)
    return (2.0 * signs - 1.0) @ blocks


def sketch_answer(own: np.ndarray, summed: np.ndarray, seed: int | None = None) -> np.ndarray:
    """float32 (:data:`SKETCH_VALUES`,): what a worker answers of its ``own`` gradient (before
    the ring summed it) once the ring's sum ``summed`` is known (the batch norm sums' digest
    0: the worker sets it, :func:`sums_digest`). ``seed``: :func:`sketch_seed` of ``summed``
    where already taken (the digest of every value: the master's check takes it once)."""
    out = np.zeros(SKETCH_VALUES, np.float32)
    seed = sketch_seed(summed) if seed is None else seed
    out[:SKETCHES] = sketches(own, seed)
    out[SKETCHES] = np.abs(own).sum(dtype=np.float64)
    out[SEED] = digest_values(seed.to_bytes(8, "little"))
    return out


def answered_seed(answer: np.ndarray) -> int:
    """The seed a :func:`sketch_answer` drew its signs from."""
    return int.from_bytes(digest_of_values(answer[SEED]), "little")


def sums_digest(totals: np.ndarray) -> np.ndarray:
    """4 float32 values: the digest of the batch norm sums (float64, every sum of the step in
    order) a worker took from the ring, as :func:`~hetconv.ring.split64`'s exact parts."""
    return digest_values(digest([split64(np.asarray(totals, np.float64))]))


def sum_differs(
    summed: np.ndarray, answers: list[np.ndarray], seed: int | None = None
) -> tuple[bool, float, float]:
    """(whether the sketches ``answers`` -- every contribution's :func:`sketch_answer`, the
    master's own range's included -- do not add up to the sketch of ``summed``, the largest
    difference, what it may be): the sum's float32 round-off is at most one half-unit per
    addition of each value, so the difference may be (contributions + 2) x 2**-24 of the
    contributions' absolute sums, and the sketches' own float32 rounding. ``seed``:
    :func:`sketch_seed` of ``summed`` where already taken."""
    want = sketches(summed, sketch_seed(summed) if seed is None else seed)
    got = np.sum([np.asarray(a[:SKETCHES], np.float64) for a in answers], axis=0)
    absolute = float(sum(float(a[SKETCHES]) for a in answers))
    allowed = (len(answers) + 2) * 2.0**-23 * absolute + 1e-30
    worst = float(np.max(np.abs(got - want)))
    return bool(worst > allowed or not math.isfinite(worst)), worst, allowed


def sketch_comparison(answer: np.ndarray, mine: np.ndarray) -> tuple:
    """(the worker's sketches, the master's of its recomputed gradient ``mine`` by the seed
    the worker answered, their scale) for a ``norm`` comparison: the 2-norm over the sketches
    of the larger of the block sums' and the values' 2-norms (what round-off in a
    recomputation moves them by, at most)."""
    vector = np.asarray(mine, np.float32).reshape(-1)
    want = sketches(vector, answered_seed(answer))
    scale = math.sqrt(SKETCHES) * max(
        float(np.linalg.norm(block_sums(vector))), float(np.linalg.norm(vector.astype(np.float64)))
    )
    return np.asarray(answer[:SKETCHES], np.float64), want, scale


__all__ = [
    "CHECK_BYTES_PER_S",
    "SKETCHES",
    "SKETCH_BLOCK",
    "SKETCH_VALUES",
    "SEED",
    "SUMS",
    "answered_seed",
    "block_sums",
    "check_pass_seconds",
    "check_pricing",
    "check_seconds",
    "sketch_answer",
    "sketch_comparison",
    "sketch_seed",
    "sketches",
    "sum_differs",
    "sums_digest",
]
