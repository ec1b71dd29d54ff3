"""Stopping training at a step boundary: the first SIGINT or SIGTERM lets the step finish and
be checkpointed, then training raises :class:`TrainingInterrupted`."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import TextIO

from tqdm import tqdm


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped at a step boundary on SIGINT or SIGTERM, after its checkpoint.

    Attributes:
        signum: the signal that asked for the stop.
        step: the steps done (and checkpointed, unless ``checkpoint`` is None).
        checkpoint: the file written, or None if writing it failed.
        model: the weights saved at the stop (the run's ``--save``), or None.
    """

    def __init__(self, signum: int, step: int, checkpoint: Path | None, model: Path | None = None):
        super().__init__(f"stopped after step {step} on {signal.Signals(signum).name}")
        self.signum, self.step, self.checkpoint, self.model = signum, step, checkpoint, model


class StopAtStepBoundary:
    """While active, the first SIGINT or SIGTERM asks the loop to stop after its step (which
    then writes a checkpoint); a second one interrupts at once, as Ctrl-C normally does.

    Handlers can only be installed from the main thread; elsewhere this does nothing and
    signals keep their usual effect.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, log: TextIO):
        self.log = log
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopAtStepBoundary:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        try:
            tqdm.write(
                f"{signal.Signals(signum).name}: stopping after this step to write a "
                "checkpoint (Ctrl-C again to stop at once, without one)",
                file=self.log,
            )
        except RuntimeError:  # the main thread was inside a write to the same stream
            pass
