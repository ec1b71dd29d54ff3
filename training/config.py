"""What one training run is (:class:`TrainConfig`, what ``hetconv train``'s flags fill in) and
what it gives back (:class:`TrainResult`). The checks are here, so a Python caller is refused
what the command line refuses, with the same words."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field

from hetconv.data import DATASETS
from hetconv.optim import SGDConfig

from .checkpoint import DEFAULT_KEEP

DEFAULT_CHECKPOINT_EVERY = 100
DEFAULT_STEPS = 300  # when neither steps nor epochs is given
DEFAULT_TRAIN_SIZE = 10_000  # the synthetic training set's images


#: Why a synthetic set's size goes with no --data-dir (the command line refuses the flag given
#: at all, its default's value too; a TrainConfig any value but the default).
TRAIN_SIZE_WITH_DATA = (
    "--train-size sizes the synthetic set; with --data-dir the whole training set is "
    "used (--steps or --epochs say how much of it to see): drop --train-size"
)


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs; the CLI fills it from its flags."""

    preset: str = "tiny"  # a preset, a .json spec or an .onnx graph (onnx_import.load_network)
    dataset: str = "synthetic"  # one of hetconv.data.DATASETS, or "auto" (needs data_dir)
    data_dir: str | None = None  # a file or folder; see hetconv.data.load_dataset
    holdout_fraction: float | None = None  # for data without a held-out part of its own
    steps: int | None = None
    epochs: float | None = None
    batch: int = 32
    seed: int = 0
    sgd: SGDConfig = field(default_factory=SGDConfig)
    train_size: int = DEFAULT_TRAIN_SIZE  # synthetic set only
    eval_size: int | None = None  # held-out images evaluated (None: all; 0: no evaluation)
    eval_every: int | None = None  # steps between evaluations (besides every epoch and the end)
    eval_batch: int = 200
    trace: str | None = None
    run_dir: str | None = None  # the run folder of the outputs (announced; training.rundir)
    metrics: str | None = None  # metrics.csv (hetconv.training.metrics)
    tensorboard: str | None = None  # a folder for TensorBoard event files (needs tensorboardX)
    save: str | None = None  # also written when a signal stops the run at a step boundary
    load: str | None = None  # a model .npz, a checkpoint file or folder, or a run folder
    progress: bool = True
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # steps; DEFAULT_CHECKPOINT_EVERY with a directory
    checkpoint_keep: int = DEFAULT_KEEP
    resume: bool = False

    def __post_init__(self) -> None:
        self._check_length()
        self._check_data()
        self._check_outputs()

    def _check_length(self) -> None:
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.epochs is not None and not self.epochs > 0:
            raise ValueError(f"epochs must be > 0, got {self.epochs}")
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give either steps or epochs, not both")

    def _check_data(self) -> None:
        if self.dataset not in (*DATASETS, "auto"):
            raise ValueError(
                f"dataset {self.dataset!r} is not one of {', '.join(DATASETS)} or auto"
            )
        if self.data_dir and self.train_size != DEFAULT_TRAIN_SIZE:
            raise ValueError(TRAIN_SIZE_WITH_DATA)
        if self.dataset == "synthetic" and self.data_dir:
            raise ValueError(
                f"the synthetic dataset reads no files, so --data-dir {self.data_dir} would be "
                "ignored: drop --dataset synthetic (the kind is then inferred from the path) "
                "or name the dataset it holds"
            )
        if self.dataset != "synthetic" and not self.data_dir:
            raise ValueError(f"the {self.dataset} dataset needs --data-dir")
        if self.holdout_fraction is not None and not 0 < self.holdout_fraction < 1:
            raise ValueError(
                f"--holdout-fraction must lie between 0 and 1, got {self.holdout_fraction}"
            )
        if self.holdout_fraction is not None and self.dataset == "synthetic":
            raise ValueError("--holdout-fraction needs --data-dir (synthetic data has its own)")
        if self.train_size < 1 or (self.eval_size is not None and self.eval_size < 0):
            raise ValueError("train size must be >= 1 and eval size >= 0")
        if self.eval_every is not None and self.eval_every < 1:
            raise ValueError(f"evaluation interval must be >= 1, got {self.eval_every}")

    def _check_outputs(self) -> None:
        if self.tensorboard:
            require_tensorboard()
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"checkpoint interval must be >= 1, got {self.checkpoint_every}")
        if self.checkpoint_keep < 1:
            raise ValueError(f"checkpoints to keep must be >= 1, got {self.checkpoint_keep}")
        if not self.checkpoint_dir:
            if self.checkpoint_every is not None:
                raise ValueError("--checkpoint-every needs --checkpoint-dir")
            if self.resume:
                raise ValueError("--resume needs --checkpoint-dir")

    @property
    def checkpoint_interval(self) -> int:
        """Steps between checkpoints (only meaningful with ``checkpoint_dir``)."""
        return self.checkpoint_every or DEFAULT_CHECKPOINT_EVERY


@dataclass
class TrainResult:
    steps: int
    losses: list[float]
    train_accuracy: float  # over the last epoch's worth of steps, at most 50
    eval_accuracy: float | None
    eval_loss: float | None
    seconds: float
    conv_seconds: float
    images_per_second: float


def require_tensorboard() -> None:
    """Refuse TensorBoard output where tensorboardX is not installed."""
    if importlib.util.find_spec("tensorboardX") is None:
        raise ValueError("--tensorboard needs tensorboardX: pip install 'hetconv[tensorboard]'")


def total_steps(config: TrainConfig, train_size: int) -> int:
    steps_per_epoch = max(1, train_size // config.batch)
    if config.steps is not None:
        return config.steps
    if config.epochs is not None:
        return max(1, math.ceil(config.epochs * steps_per_epoch))
    return DEFAULT_STEPS
