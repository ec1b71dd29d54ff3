"""``--split auto``'s trial of the runner-up: where the split not chosen is predicted close to
the one chosen, both are run and timed, and the faster is kept.

The cost model is within about 15 % on the scaled testbed, either way: two splits predicted
within :data:`TRIAL_RANGE` of each other may be the other way round when run. Measured there
(paper-150-800 at batch 64, 4 workers, switched): the ring among the workers was predicted at
1.41 s a step against the split by kernels' 1.60 s, and ran 1.55-1.65 s; the split by kernels,
in another run of the same configuration, 1.29-1.41 s.

So where the runner-up (:func:`runner_up`) is within the range, the split chosen runs first
and is timed as the alone check times it (:mod:`.alonecheck`: the median of the steps after
the first :data:`~.alonecheck.SKIPPED`); where the runner-up's prediction beats that
(:func:`worth_trying`), the split is handed over (resident parameters and
their momentum fetched into the model) and the runner-up opened over the same workers, timed
alike; then the faster of the two is kept (the runner-up only where faster by
:data:`TRIAL_MARGIN`: a tie goes to the prediction), or the master alone where both are slower
than it by the alone check's margin. The step that decides carries ``split_trial`` in the
trace, and the console says it in one line. A trial costs the runner-up's steps and one or two
openings of a split (connecting and placing; the split by kernels takes the probes it made at
start), once per run.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetconv.imagesplit import IMAGES, KERNELS

from .alonecheck import CHECK_MARGIN

#: The runner-up is tried where predicted at most this much slower than the split chosen.
TRIAL_RANGE = 0.25
#: How much faster (a fraction of the first split's median step) the runner-up must run to be
#: kept: the medians of a few steps scatter by a few per cent.
TRIAL_MARGIN = 0.02
#: The trial's record's name for each way it may keep.
FIRST, TRIED, ALONE = "first", "trial", "alone"


def way_name(split: str, exchange: str | None) -> str:
    """A split as the choice's ``predicted_s`` names it: ``kernels``, ``images (ring)``."""
    return split if split == KERNELS else f"{IMAGES} ({exchange})"


def runner_up(choice: dict, allowed: Sequence[str]) -> dict | None:
    """The best way of the split ``choice`` (:func:`hetconv.imagecost.choose_split`'s) did not
    take, among the exchanges ``allowed``, where predicted within :data:`TRIAL_RANGE` of the
    way taken: ``{"split", "exchange", "predicted_s"}``; None where there is none so close."""
    predicted = choice["predicted_s"]
    taken = predicted.get(way_name(choice["split"], choice["exchange"]))
    if choice["split"] == KERNELS:
        ways = {e: predicted.get(way_name(IMAGES, e)) for e in allowed}
        ways = {e: s for e, s in ways.items() if s}
        if not ways:
            return None
        exchange = min(ways, key=ways.get)
        split, seconds = IMAGES, ways[exchange]
    else:
        split, exchange, seconds = KERNELS, None, predicted.get(KERNELS)
    if not taken or not seconds or seconds > taken * (1 + TRIAL_RANGE):
        return None
    return {"split": split, "exchange": exchange, "predicted_s": seconds}


def worth_trying(first_s: float, trial: dict) -> bool:
    """Whether the runner-up ``trial`` (:func:`runner_up`'s) is run once the split chosen has
    been timed at ``first_s`` a step (the alone check's median): only where its predicted step
    beats that by :data:`TRIAL_MARGIN`, as it must to be kept (:func:`decide`). The trial is
    there for a prediction that was wrong; where the split chosen runs at least as fast as the
    runner-up is predicted, only a runner-up faster than its own prediction could win, and
    trying it costs two openings of a split (each a few seconds of placing and probing) and
    its steps. Measured on the testbed (paper-150-800 at batch 64, 4 workers, switched), the
    ring was never faster than predicted: chosen at 2.41 s, it ran 2.79-3.10 s and the kernel
    split, predicted 2.78 s, won its trial (tried: 2.79 s is over 2.78 s); with the kernel
    split chosen at 2.41 s and run at 2.26-2.75 s, the ring (predicted 2.53 s) ran 2.66 s and
    more in its trial and lost it (not tried now)."""
    return trial["predicted_s"] < first_s * (1.0 - TRIAL_MARGIN)


def decide(first_s: float, trial_s: float, alone_s: float) -> str:
    """Which to keep (:data:`FIRST`, :data:`TRIED` or :data:`ALONE`) from the medians of the
    split run first and of the runner-up, and the master alone's step."""
    if min(first_s, trial_s) > alone_s * (1.0 + CHECK_MARGIN):
        return ALONE
    return TRIED if trial_s < first_s * (1.0 - TRIAL_MARGIN) else FIRST


#: How the console names each exchange of a split by images.
EXCHANGE_WORDS = {"master": "gradients through the master", "ring": "ring among the workers"}


def said(split: str, exchange: str | None) -> str:
    """A split as the console names it: ``the split by images (ring among the workers)``."""
    if split == KERNELS:
        return "the split by kernels"
    if exchange is not None and exchange.startswith("cut:"):  # hetconv.cutcost.CUT_WAY
        return f"the network cut after {exchange[4:]}'s block"
    return f"the split by images ({EXCHANGE_WORDS.get(exchange, exchange)})"


def describe_planned(trial: dict) -> str:
    """The choice's line's words for a trial to come."""
    return (
        f"{said(trial['split'], trial['exchange'])} is predicted within {TRIAL_RANGE:.0%}, so "
        "both are run a few steps and the faster kept"
    )


def describe_start(trial: dict, step: int) -> str:
    """The console's line as the runner-up opens after ``step``."""
    return (
        f"split trial after step {step}: {said(trial['split'], trial['exchange'])}, predicted "
        f"{trial['predicted_s']:.3g} s a step, is tried next, and the faster kept"
    )


def describe_skipped(trial: dict, first: dict, step: int) -> str:
    """The console's line where the runner-up is not tried (:func:`worth_trying`): ``first``
    is ``{"split", "exchange", "seconds"}`` of the split chosen."""
    return (
        f"split trial after step {step}: {said(first['split'], first['exchange'])} ran "
        f"{first['seconds']:.3g} s a step, no slower than {said(trial['split'], trial['exchange'])}"
        f" is predicted ({trial['predicted_s']:.3g} s): it is not tried"
    )


def describe(record: dict, step: int) -> str:
    """The console's line for the trial's decision after ``step`` (``record``: the trace's
    ``split_trial``)."""
    first, tried = record["first"], record["trial"]
    head = (
        f"split trial after step {step}: by {first['way']} {first['seconds']:.3g} s a step, "
        f"by {tried['way']} {tried['seconds']:.3g} s, the master alone {record['alone_s']:.3g} s"
    )
    if record["kept"] == ALONE:
        return head + ": the workers are released and the master trains on alone"
    kept = first if record["kept"] == FIRST else tried
    return head + f": {said(kept['split'], kept['exchange'])} is kept"


__all__ = [
    "ALONE",
    "FIRST",
    "TRIAL_MARGIN",
    "TRIAL_RANGE",
    "TRIED",
    "decide",
    "describe",
    "describe_planned",
    "describe_skipped",
    "describe_start",
    "runner_up",
    "said",
    "way_name",
    "worth_trying",
]
