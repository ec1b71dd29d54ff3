"""The training run, apart from where its convolutions run: the loop (:mod:`.loop`), its
configuration (:mod:`.config`), data and evaluation (:mod:`.datasets`), checkpoints
(:mod:`.checkpoint`, :mod:`.fingerprint`), the run folder and its tables (:mod:`.rundir`,
:mod:`.metrics`), the trace (:mod:`.trace`), stopping at a step boundary (:mod:`.stopping`),
the console lines (:mod:`.console`) and the figures (:mod:`.report`).

It imports only the core (``hetconv.*``): the master's cluster is one executor it may be
given, as :class:`hetconv.conv.LocalConv` is another.
"""

from .config import TrainConfig, TrainResult
from .loop import train
from .stopping import TrainingInterrupted

__all__ = ["TrainConfig", "TrainResult", "TrainingInterrupted", "train"]
