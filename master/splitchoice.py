"""``hetconv train --split auto``: each step split by kernels or by images, whichever the cost
model predicts faster for the cluster as measured at start.

:class:`SplitChoice` is the executor ``hetconv train`` gets with named or discovered workers.
It starts as a split by kernels (a :class:`~.cluster.Cluster`: it connects, measures every
worker's link and probes every node on every layer's real shape, then chooses each layer's
modes). When the training run asks for the predicted step (:meth:`SplitChoice.predict_step`,
with the master's other work timed), it compares, on those measurements:

* the split by kernels, with the modes the cluster chose (:func:`.records.predict_step`);
* the whole network split by images (:mod:`.imagesplit`), through the master and, where it
  may run (no TLS; :mod:`.ring`), by the ring among the workers
  (:func:`.records.image_split_steps`); a network with batch norm only by the ring;
* where the ring may run, the network cut in two after each block it may be cut after
  (:mod:`.cutsplit`, :mod:`hetconv.cutcost`): its first part by images with the ring, the
  rest on the master.

Where the split by kernels stays and its plan keeps every kernel on the master (each worker not
worth its link or its compute), the master trains alone, as ``--local`` (no calls, the engine's
own strides), and the workers are released: the split line says so.

Workers on the master's own machine share its cores, which the predictions do not model:
with any such worker the split by kernels stays. A split by images is chosen only when
predicted at least :data:`~hetconv.imagecost.SPLIT_MARGIN` faster than the split by kernels
(:func:`~hetconv.imagecost.choose_split`): the cost model is within about 15 % on the testbed,
and the kernel split is the one it has been validated on longest.
Choosing it closes the kernel split's connections and opens the split by images over the same
workers (those found on the LAN still followed). A few steps in, the split chosen is timed
against the master training alone, and the workers are released where it is slower
(:mod:`.alonecheck`); where the other split is predicted close, it is run and timed next, and
the faster kept (:mod:`.splittrial`). Every later call goes to the split chosen;
the plan record's ``split_choice`` says which, each way's predicted step and why, and the
console says it in one line.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TextIO

from hetconv.cutcost import CUT_WAY
from hetconv.imagecost import SPLIT_MARGIN, choose_split, describe_choice
from hetconv.imagesplit import IMAGES, KERNELS
from hetconv.ring import AUTO, MASTER, RING

from . import splittrial
from .alonecheck import AloneCheck, time_alone
from .alonecheck import describe as describe_check
from .probing import on_this_machine


def allowed_exchanges(config, exchange: str) -> list[str]:
    """The exchanges a split by images may use here: ``--exchange`` if given, and the ring only
    without TLS (its workers' parts are plain TCP)."""
    ring_ok = config.tls_ca is None
    ways = [MASTER, RING] if exchange not in (MASTER, RING) else [exchange]
    return [w for w in ways if w != RING or ring_ok]


def ruled_out_exchanges(config, exchange: str) -> dict[str, str]:
    """For each exchange :func:`allowed_exchanges` leaves out, what rules it out and the
    flag that would allow it (the console names it where that way is predicted faster)."""
    if exchange in (MASTER, RING):
        return {}  # --exchange chose
    if config.tls_ca is not None:
        return {RING: "the ring refuses TLS (its workers' parts are plain TCP)"}
    return {}


def keeps_every_kernel(cluster) -> bool:
    """Whether ``cluster``'s plan gives the workers nothing: every layer's kernels on the
    master, no block replicated on them, no split head."""
    plans = getattr(cluster, "plans", {})
    return (
        bool(plans)
        and all(not any(plan.shares[1:]) for plan in plans.values())
        and not cluster.replicas.feeds
        and not cluster.head_fcs
    )


#: Backends that compute on a device of their own: a worker of one on the master's machine
#: does not compute on the master's cores (its host side is the calls and the copies).
OWN_DEVICE_BACKENDS = ("cuda",)


def sharing_cores(addresses: Sequence[str], backends: dict[str, str]) -> list[str]:
    """The workers at ``addresses`` that run on this machine and compute on its cores (not a
    GPU: ``backends``, address -> backend, :data:`OWN_DEVICE_BACKENDS`), which the
    predictions of a split by images do not model."""
    return [
        a for a in addresses
        if on_this_machine(a) and backends.get(a, "") not in OWN_DEVICE_BACKENDS
    ]  # fmt: skip


class SplitChoice:
    """The executor of ``--split auto`` (see the module's docstring): a proxy to the split
    chosen, which is a :class:`~.cluster.Cluster` until :meth:`predict_step` decides.

    Args:
        addresses, backend, config: the cluster's.
        exchange: ``--exchange``: which exchanges a split by images may use (``auto``: any).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        backend="cpu",
        config=None,
        exchange=AUTO,
        alone_check: bool = True,
    ):
        from .cluster import Cluster

        self.addresses, self._backend, self._exchange = list(addresses), backend, exchange
        self.inner = Cluster(addresses, backend, config)
        self._config = self.inner.config
        self._followed: tuple = (None, [])  # (the LAN discovery a split follows, found)
        self.choice: dict | None = None
        self._prepared: tuple = ()
        # never slower than one machine, measured early in the run (:mod:`.alonecheck`)
        self.alone_check = AloneCheck() if alone_check else None
        self._batch: tuple | None = None  # the step's (model, x, labels, step)
        self._handover: dict | None = None
        self._sgd = None
        # the runner-up tried where predicted close (:mod:`.splittrial`): what to try, then
        # its timing, the first split's median and the master alone's step
        self.trial: dict | None = None
        self._trial_check: AloneCheck | None = None
        self._first: dict | None = None
        self._predict_args: tuple = ()
        self._probes: dict[str, dict[str, float]] = {}  # every node's, at start

    @classmethod
    def with_exchange(cls, exchange: str, alone_check: bool = True):
        """A constructor with the cluster's signature, for ``--exchange EXCHANGE`` (and
        ``--alone-check``)."""
        return lambda addresses, backend="cpu", config=None: cls(
            addresses, backend, config, exchange, alone_check
        )

    def __getattr__(self, name: str):
        # Only what this class does not define itself: everything else is the chosen split's.
        return getattr(self.__dict__["inner"] if "inner" in self.__dict__ else None, name)

    def prepare(self, layers, batch: int, log: TextIO | None = None) -> None:
        self._prepared = (layers, batch, log)
        self.inner.prepare(layers, batch, log)
        # every node's probes, for the split by kernels opened again (the trial)
        self._probes = {n.name: dict(n.probe_seconds) for n in self.inner.nodes}

    def predict_step(
        self, comp_alone_s: float, comp_s: float, spec=None, chains_s=None
    ) -> dict | None:
        """The kernel split's prediction; with the model's ``spec``, the choice is made here
        (see the module's docstring) and the prediction is the chosen split's."""
        kernels = self.inner.predict_step(comp_alone_s, comp_s, spec, chains_s)
        if spec is None or kernels is None or "image_split_s" not in kernels:
            return kernels  # no worker reached or no probe: the split by kernels stays
        self._predict_args = (comp_alone_s, comp_s, spec, chains_s)
        allowed = allowed_exchanges(self.inner.config, self._exchange)
        if RING in allowed:  # the network cut in two: its first part by the ring
            allowed += [w for w in kernels["image_split_s"] if w.startswith(CUT_WAY)]
        # Where the split by kernels would train alone, a split by images predicted faster at
        # all is taken: the alone check measures it against the master alone and releases the
        # workers where it is not (resnet20 batch 64 on the testbed: the ring predicted 1.07x,
        # under the margin, and ran 0.30 s against 0.35 s alone).
        keeps = keeps_every_kernel(self.inner)
        alone = self.alone_check is not None and keeps
        self.choice = choose_split(
            kernels["step_s"], kernels["image_split_s"], allowed,
            ruled_out_exchanges(self.inner.config, self._exchange),
            margin=0.0 if alone else SPLIT_MARGIN,
        )  # fmt: skip
        if alone and self.choice["split"] == IMAGES:
            self.choice["why"] += (
                "; the split by kernels would train alone, and the alone check measures this "
                "against that"
            )
        shared = self._sharing_cores()
        if shared and self.choice["split"] == IMAGES:
            self.choice = {
                **self.choice, "split": KERNELS, "exchange": None,
                "why": f"{shared[0]} runs on this machine, sharing its cores, which the "
                "predictions do not model (the split by kernels stays)",
            }  # fmt: skip
        log = self._prepared[2]
        if self.choice["split"] == KERNELS and keeps:
            self._release()
        elif self.alone_check is not None and not keeps and not shared:
            self.trial = splittrial.runner_up(self.choice, allowed)
            if self.trial is not None:
                self.choice["trial"] = dict(self.trial)
                self.choice["why"] += "; " + splittrial.describe_planned(self.trial)
        if self.choice["split"] == IMAGES:
            self._open(IMAGES, self.choice["exchange"])
            step = kernels["image_split_s"][self.choice["exchange"]]
            kernels = {**kernels, "step_s": step, "speedup": kernels["alone_s"] / step}
        if log is not None:
            print(describe_choice(self.choice), file=log, flush=True)
        return kernels

    def _release(self) -> None:
        """The split by kernels keeps every kernel on the master: it trains alone, as
        ``--local`` (no calls, the engine's own strides), and the workers are released."""
        self._alone()
        self.choice = {
            **self.choice, "released": True,
            "why": f"{self.choice['why']}; the split by kernels keeps every kernel on the "
            "master: it trains alone, as --local, and the workers are released",
        }  # fmt: skip

    def _alone(self) -> None:
        """Close the split (its plan kept for the record); the master trains alone, as
        ``--local``."""
        from hetconv.conv import LocalConv

        self._record = self.inner.plan_record()
        self.inner.close()
        self.inner = LocalConv(self._backend)

    def _sharing_cores(self) -> list[str]:
        """The workers on this machine that compute on its cores (:func:`sharing_cores`)."""
        backends = {n.client.address: n.backend for n in self.inner.nodes if n.client}
        return sharing_cores(self.addresses, backends)

    def _open(self, split: str, exchange: str | None) -> None:
        """Close the split running and open ``split`` (by images with ``exchange``) over the
        same workers (those found on the LAN still followed), prepared and given the run's
        prediction arguments (the spec); a split by kernels that then keeps every kernel on
        the master trains alone."""
        from .cluster import Cluster
        from .ring import image_split_class

        old = self.inner
        membership = getattr(old, "membership", None)  # none where the master trains alone
        if membership is not None:
            self._followed = (getattr(membership, "_discovery", None),
                              sorted(getattr(membership, "_discovered", ())))  # fmt: skip
        followed, found = self._followed
        old.close()
        if split == IMAGES and exchange.startswith(CUT_WAY):
            from .cutsplit import cut_split_class

            way = cut_split_class(exchange.removeprefix(CUT_WAY))
        else:
            way = image_split_class(exchange) if split == IMAGES else Cluster
        self.inner = way(self.addresses, self._backend, self._config)
        if split == KERNELS:  # the probes at start hold: not again
            self.inner.known_probes = self._probes
        if followed is not None:
            self.inner.membership.follow(followed, found)
        self.inner.prepare(*self._prepared)
        if self._predict_args:
            self.inner.predict_step(*self._predict_args)  # the spec; a plan may keep all
        if self.choice is not None:
            self.choice = {**self.choice, "split": split, "exchange": exchange}
        if split == KERNELS and keeps_every_kernel(self.inner):
            self._alone()

    # -- the alone check (:mod:`.alonecheck`) --------------------------------------------

    def attach_optimizer(self, sgd) -> None:
        self._sgd = sgd
        self.inner.attach_optimizer(sgd)

    def begin_step(self, step: int) -> None:
        for check in (self.alone_check, self._trial_check):
            if check is not None:
                check.begin()
        self.inner.begin_step(step)

    def train_batch(self, model, x, labels, step: int):
        self._batch = (model, x, labels, step)
        return self.inner.train_batch(model, x, labels, step)

    def end_step(self) -> dict:
        record = self.inner.end_step()
        if self._trial_check is not None:
            if self._trial_check.end():
                record["split_trial"] = self._end_trial()
            return record
        check = self.alone_check
        if check is None or not check.end() or not self._checks_alone():
            return record
        from hetconv.optim import SGDConfig

        model, x, labels, step = self._batch
        alone_s = time_alone(model, x, labels, step, self._backend, self._sgd or SGDConfig())
        record["alone_check"] = result = check.decide(alone_s)
        if self.trial is not None and not splittrial.worth_trying(result["cluster_s"], self.trial):
            record["alone_check"] = result = self._skip_trial(result, step)
        if self.trial is not None:  # the runner-up next; the decision after it
            record["alone_check"] = result = {**result, "released": False, "trial": True}
            self._say(describe_check(result, step))
            self._start_trial(result)
            return record
        self._say(describe_check(result, step))
        if result["released"]:
            self._hand_over()
        return record

    def _say(self, line: str) -> None:
        log = self._prepared[2] if self._prepared else None
        if log is not None:
            print(line, file=log, flush=True)

    # -- the trial of the runner-up (:mod:`.splittrial`) --------------------------------

    def _skip_trial(self, check: dict, step: int) -> dict:
        """The split chosen ran (``check``, the alone check's) no slower than the runner-up is
        predicted (:func:`~.splittrial.worth_trying`): the runner-up is not tried; the check's
        record with what was not tried (``trial_skipped``)."""
        trial, self.trial = self.trial, None
        first = {"split": self.choice["split"], "exchange": self.choice["exchange"],
                 "seconds": check["cluster_s"]}  # fmt: skip
        self._say(splittrial.describe_skipped(trial, first, step))
        self.choice = {**self.choice, "trial": {**trial, "skipped": True}}
        skipped = {k: trial[k] for k in ("split", "exchange", "predicted_s")}
        return {**check, "trial_skipped": skipped}

    def _start_trial(self, check: dict) -> None:
        """The split chosen timed (``check``, the alone check's): hand it over and open the
        runner-up, timed alike."""
        way = splittrial.way_name(self.choice["split"], self.choice["exchange"])
        self._first = {
            "split": self.choice["split"], "exchange": self.choice["exchange"], "way": way,
            "seconds": check["cluster_s"], "alone_s": check["alone_s"],
        }  # fmt: skip
        self._say(splittrial.describe_start(self.trial, self._batch[3]))
        began = time.perf_counter()
        self._hand_over((self.trial["split"], self.trial["exchange"]))
        check["switch_s"] = round(time.perf_counter() - began, 3)
        self._trial_check = AloneCheck()

    def _end_trial(self) -> dict:
        """The runner-up timed: keep the faster, or the master alone (the trace's
        ``split_trial``)."""
        first, tried = self._first, self.trial
        trial_s = self._trial_check.decide(first["alone_s"])["cluster_s"]
        self._trial_check = None
        kept = splittrial.decide(first["seconds"], trial_s, first["alone_s"])
        record = {
            "first": {k: first[k] for k in ("split", "exchange", "way", "seconds")},
            "trial": {
                "split": tried["split"], "exchange": tried["exchange"], "seconds": trial_s,
                "way": splittrial.way_name(tried["split"], tried["exchange"]),
                "predicted_s": tried["predicted_s"],
            },
            "alone_s": first["alone_s"], "kept": kept,
        }  # fmt: skip
        self._say(splittrial.describe(record, self._batch[3]))
        began = time.perf_counter()
        if kept == splittrial.ALONE:
            self._hand_over()
        elif kept == splittrial.FIRST:
            self._hand_over((first["split"], first["exchange"]))
        record["switch_s"] = round(time.perf_counter() - began, 3)
        self.choice = {**self.choice, "trial": record}
        return record

    def _checks_alone(self) -> bool:
        """Whether the check can run now: a cluster working (not the master alone), a batch
        seen, and no worker computing on the master's cores (their timings compete)."""
        from hetconv.conv import LocalConv

        if isinstance(self.inner, LocalConv) or self._batch is None:
            self.alone_check.done = True
            return False
        if self._sharing_cores():
            self.alone_check.done = True
            return False
        return True

    def _hand_over(self, to: tuple[str, str | None] | None = None) -> None:
        """Close the split mid-run: its deferred checks finished, resident parameters and their
        momentum fetched into the model (:meth:`take_handover` gives the momentum to the
        training loop), then the split ``to`` (split, exchange) opened over the same workers,
        or, without one, the workers released and the master trains alone."""
        complete = getattr(self.inner, "complete", None)
        if complete is not None:
            complete()
        resident = self.inner.resident_parameters()
        self._handover = self.inner.gather_resident() if resident else {}
        if to is not None:
            self._open(*to)
            return
        self._alone()
        if self.choice is not None:
            self.choice = {**self.choice, "released": True}

    def take_handover(self) -> dict | None:
        """Once, after a step whose check changed the split (the workers released, or another
        split opened): the momentum buffers of the parameters the old split kept (by name;
        empty where none); the training loop gives every parameter to its optimizer or to the
        new split's (:func:`hetconv.training.loop.take_split`). None otherwise."""
        handover, self._handover = self._handover, None
        return handover

    def plan_record(self) -> dict:
        record = self.inner.plan_record() or dict(getattr(self, "_record", None) or {})
        if self.choice is not None:
            record["split_choice"] = self.choice
        return record

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> SplitChoice:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = [
    "OWN_DEVICE_BACKENDS",
    "SplitChoice",
    "allowed_exchanges",
    "keeps_every_kernel",
    "ruled_out_exchanges",
    "sharing_cores",
]
