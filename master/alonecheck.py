"""Never slower than one machine, measured: ``--split auto``'s check, early in a run, of the
split it chose against the master training alone.

The choice of a split (:mod:`.splitchoice`) rests on predictions from probes; on the scaled
testbed a prediction was 30 % off (vgg11 at batch 64, 4 workers: the split by kernels
predicted 0.845 s a step and ran 1.199 s, the master alone 0.900 s). So after
:data:`CHECK_STEPS` steps (the first :data:`SKIPPED`, with their placements and warming
caches, left out) the master times one
step of the same network and batch as ``--local`` trains it (a twin of the model on the
master's own engine, its current weights, the step's batch; the best of two after one to warm
up, :func:`time_alone`), and where the cluster's median step is over that by more than
:data:`CHECK_MARGIN`, the workers are released and the master trains on alone: resident
kernels and their momentum are fetched into the model first, and the training loop takes
every parameter into its own optimizer (:meth:`~.splitchoice.SplitChoice.take_handover`), so
the run stays local training's to float32 round-off. The step's trace record says what was
measured (``alone_check``), and the console says it in one line.

Not where a worker runs on the master's machine and computes on its cores (their timings
compete: :func:`~.splitchoice.sharing_cores`), nor where the master trains alone already.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

#: Steps the cluster is timed over before the check, after the first SKIPPED: the steps just
#: after the start run slower (placements, caches; resnet20 at batch 64 on the testbed: the
#: median of steps 1-4 0.330 s, of the run's 0.299 s, against 0.340 s alone).
CHECK_STEPS = 4
SKIPPED = 2
#: How much slower than the master alone the cluster's median step may be and keep its
#: workers: the timings of a few steps scatter by a few per cent on a quiet machine.
CHECK_MARGIN = 0.05


def time_alone(model, x: np.ndarray, labels: np.ndarray, step: int, backend, sgd) -> float:
    """Seconds of one SGD step of ``model``'s network on the batch ``x``, ``labels`` trained
    in this process as ``--local`` trains it (on ``backend``, the master's engine), the best
    of two after one to warm up; a twin of the model with its current weights and statistics,
    nothing of the model touched."""
    from hetconv.conv import LocalConv
    from hetconv.layers import softmax_cross_entropy
    from hetconv.model import Model
    from hetconv.optim import SGD

    twin = Model(model.spec, model.input_shape, model.seed, LocalConv(backend))
    twin.load_state({k: np.array(v) for k, v in model.state().items()})
    optimizer = SGD(twin.parameters(), sgd)
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        _, grad, _ = softmax_cross_entropy(twin.forward(x, step=step), labels)
        twin.backward(grad)
        optimizer.step(twin.gradients())
        seconds.append(time.perf_counter() - start)
    return min(seconds[1:])


class AloneCheck:
    """The steps of a cluster timed (:meth:`begin`, :meth:`end`) until the check is due."""

    def __init__(self, steps: int = CHECK_STEPS, margin: float = CHECK_MARGIN):
        self.steps, self.margin = steps, margin
        self.seconds: list[float] = []
        self.done = False
        self._began: float | None = None

    def begin(self) -> None:
        self._began = time.perf_counter()

    def end(self) -> bool:
        """The step just done timed; True when the check is due now."""
        if self.done or self._began is None:
            return False
        self.seconds.append(time.perf_counter() - self._began)
        self._began = None
        return len(self.seconds) >= SKIPPED + self.steps

    def decide(self, alone_s: float) -> dict:
        """The check's record (``cluster_s``: the median of the steps timed but the first
        :data:`SKIPPED`; ``alone_s``; ``released``: whether the cluster is slower by more than
        the margin)."""
        self.done = True
        timed = self.seconds[SKIPPED:]
        cluster_s = statistics.median(timed)
        return {
            "cluster_s": cluster_s,
            "alone_s": alone_s,
            "steps": len(timed),
            "released": cluster_s > alone_s * (1.0 + self.margin),
        }


def describe(check: dict, step: int) -> str:
    """The console's line for the check after ``step``."""
    head = (
        f"alone check after step {step}: the cluster {check['cluster_s']:.3g} s a step "
        f"(median of {check['steps']}), the master alone {check['alone_s']:.3g} s"
    )
    if check["released"]:
        return head + ": the workers are released and the master trains on alone"
    if check.get("trial"):
        return head + ": the runner-up is tried before deciding (split trial)"
    return head + ": the cluster stays"


__all__ = ["CHECK_MARGIN", "CHECK_STEPS", "SKIPPED", "AloneCheck", "describe", "time_alone"]
