"""The training loop: data order, SGD steps, progress, held-out evaluation and the trace.

The loop does not know where convolutions run: it trains a :class:`~hetconv.model.Model`
whose executor is local today and the master's cluster when workers are named.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np
from tqdm import tqdm

from hetconv.conv import ConvExecutor, LocalConv
from hetconv.data import ImageDataset, epoch_order, load_cifar10, synthetic_cifar
from hetconv.layers import softmax_cross_entropy
from hetconv.model import Model, load_spec
from hetconv.optim import SGD, SGDConfig

from .checkpoint import (
    DEFAULT_KEEP,
    CheckpointDir,
    CheckpointError,
    TrainingState,
    compute_environment,
    fingerprint_differences,
    order_digest,
    run_fingerprint,
)

# Synthetic held-out data is drawn with a seed far from any training seed.
_SYNTHETIC_EVAL_SEED_OFFSET = 1_000_003
DEFAULT_CHECKPOINT_EVERY = 100
# "checkpoint written" lines on the console at most this often (the trace records every one).
_CHECKPOINT_MESSAGE_SECONDS = 5.0


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs; the CLI fills it from its flags."""

    preset: str = "tiny"
    dataset: str = "synthetic"
    data_dir: str | None = None
    steps: int | None = None
    epochs: float | None = None
    batch: int = 32
    seed: int = 0
    sgd: SGDConfig = field(default_factory=SGDConfig)
    train_size: int = 10_000  # synthetic set only
    eval_size: int = 2_000
    eval_batch: int = 200
    trace: str | None = None
    save: str | None = None
    load: str | None = None
    progress: bool = True
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # steps; DEFAULT_CHECKPOINT_EVERY with a directory
    checkpoint_keep: int = DEFAULT_KEEP
    resume: bool = False

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.epochs is not None and not self.epochs > 0:
            raise ValueError(f"epochs must be > 0, got {self.epochs}")
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give either steps or epochs, not both")
        if self.dataset not in ("synthetic", "cifar10"):
            raise ValueError(f"dataset {self.dataset!r} is not 'synthetic' or 'cifar10'")
        if self.dataset == "cifar10" and not self.data_dir:
            raise ValueError("the cifar10 dataset needs --data-dir")
        if self.train_size < 1 or self.eval_size < 0:
            raise ValueError("train size must be >= 1 and eval size >= 0")
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


def load_datasets(config: TrainConfig) -> tuple[ImageDataset, ImageDataset]:
    """(training set, held-out set) for the configured dataset."""
    if config.dataset == "cifar10":
        train = load_cifar10(config.data_dir, "train")
        test = load_cifar10(config.data_dir, "test")
    else:
        train = synthetic_cifar(config.train_size, seed=config.seed)
        test = synthetic_cifar(
            max(config.eval_size, 1), seed=config.seed + _SYNTHETIC_EVAL_SEED_OFFSET
        )
    if config.eval_size < len(test):
        test = test.split(config.eval_size)[0]
    return train, test


def evaluate(model: Model, data: ImageDataset, batch: int = 200) -> tuple[float, float]:
    """(mean loss, accuracy) of ``model`` on ``data``."""
    total_loss, correct = 0.0, 0
    for start in range(0, len(data), batch):
        indices = np.arange(start, min(start + batch, len(data)))
        x, y = data.batch(indices)
        loss, _, hits = softmax_cross_entropy(model.forward(x), y)
        total_loss += loss * len(indices)
        correct += int(hits.sum())
    return total_loss / max(len(data), 1), correct / max(len(data), 1)


class Trace:
    """One JSON object per line per step; the simulator calibrates from these files.

    Args:
        path: the JSON-lines file, or None for no trace.
        resume_step: continue an existing trace at this step: the records of earlier steps
            are kept, those of this step on (written after the checkpoint being resumed)
            and any torn last line are cut off, and new records are appended. None starts
            a new file.
    """

    def __init__(self, path: str | None, resume_step: int | None = None):
        self.kept = self.dropped = 0
        self._record_start = 0
        self._file: TextIO | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        if path and resume_step is not None:
            self.kept, self.dropped = _cut_trace(Path(path), resume_step)
            self._file = open(path, "a", encoding="utf-8")
        elif path:
            self._file = open(path, "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._record_start = self._file.tell()
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def replace_last(self, record: dict) -> None:
        """Rewrite the record written last (the file ends with it)."""
        if self._file is not None:
            self._file.seek(self._record_start)
            self._file.truncate()
            self.write(record)

    def sync(self) -> None:
        """Make what is written durable, so a checkpoint never gets ahead of its trace."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _cut_trace(path: Path, resume_step: int) -> tuple[int, int]:
    """Truncate a trace before its first record of step >= ``resume_step`` (or first torn
    line); returns (records kept, lines cut off)."""
    if not path.is_file():
        return 0, 0
    kept = 0
    with open(path, "r+b") as f:
        lines = f.read().splitlines(keepends=True)
        offset = 0
        for line in lines:
            try:
                step = json.loads(line)["step"] if line.endswith(b"\n") else None
            except (ValueError, TypeError, KeyError):
                step = None
            if not isinstance(step, int) or step >= resume_step:
                break
            offset += len(line)
            kept += 1
        f.truncate(offset)
    return kept, len(lines) - kept


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped at a step boundary on SIGINT or SIGTERM, after its checkpoint.

    Attributes:
        signum: the signal that asked for the stop.
        step: the steps done (and checkpointed, unless ``checkpoint`` is None).
        checkpoint: the file written, or None if writing it failed.
    """

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        super().__init__(f"stopped after step {step} on {signal.Signals(signum).name}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


class _StopAtStepBoundary:
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

    def __enter__(self) -> _StopAtStepBoundary:
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


def total_steps(config: TrainConfig, train_size: int) -> int:
    steps_per_epoch = max(1, train_size // config.batch)
    if config.steps is not None:
        return config.steps
    if config.epochs is not None:
        return max(1, math.ceil(config.epochs * steps_per_epoch))
    return 300


def _resume_point(
    config: TrainConfig,
    checkpoints: CheckpointDir,
    fingerprint: dict,
    steps: int,
    train_size: int,
    log: TextIO,
) -> tuple[TrainingState, Path] | None:
    """The checkpoint to continue from, or None to start at step 0.

    Raises:
        CheckpointError: the folder holds a run this one would overwrite (no ``resume``), or
            the checkpoint cannot be continued by this configuration (the message names why).
    """
    if not config.resume:
        existing = checkpoints.files()
        if existing:
            raise CheckpointError(
                f"{checkpoints.path} already holds checkpoints (newest at step "
                f"{existing[0][0]}); pass --resume to continue that run, or choose an empty "
                "--checkpoint-dir"
            )
        return None
    found = checkpoints.load_latest(report=lambda message: print(message, file=log))
    if found is None:
        print(f"no checkpoint in {checkpoints.path}: starting from scratch", file=log)
        return None
    state, path = found
    differences = fingerprint_differences(state.fingerprint, fingerprint)
    if differences:
        raise CheckpointError(
            f"cannot resume from {path}: it was written by a different run "
            f"({'; '.join(differences)})"
        )
    if state.step > steps:
        raise CheckpointError(
            f"cannot resume from {path}: it is at step {state.step}, past this run's {steps} steps"
        )
    steps_per_epoch = train_size // config.batch
    if (state.steps_per_epoch, state.epoch, state.position) != (
        steps_per_epoch,
        *divmod(state.step, steps_per_epoch),
    ):
        raise CheckpointError(
            f"cannot resume from {path}: epoch {state.epoch} batch {state.position} of "
            f"{state.steps_per_epoch} does not match step {state.step}"
        )
    if order_digest(epoch_order(train_size, config.seed, state.epoch)) != state.order_sha256:
        raise CheckpointError(
            f"cannot resume from {path}: the data order of epoch {state.epoch} is not the one it "
            "recorded (NumPy permutes differently?), so the run could not continue identically"
        )
    return state, path


def train(
    config: TrainConfig,
    executor: ConvExecutor | None = None,
    log: TextIO | None = None,
) -> TrainResult:
    """Train ``config.preset`` and evaluate it on held-out data.

    With ``config.checkpoint_dir`` the state is checkpointed every ``checkpoint_interval``
    steps and after the last one (see :mod:`hetconv.master.checkpoint`); with
    ``config.resume`` the run continues from the latest checkpoint there, and with the same
    executor computes exactly what the uninterrupted run would have: the same losses and
    weights, bit for bit, on one machine with a fixed BLAS thread count.

    Args:
        config: the run.
        executor: where convolutions run (default: the cpu backend in this process).
        log: where progress and the summary go (default: standard error).
    """
    log = log if log is not None else sys.stderr
    spec = load_spec(config.preset)
    train_set, test_set = load_datasets(config)
    if len(train_set) < config.batch:
        raise ValueError(f"batch {config.batch} is larger than the training set ({len(train_set)})")
    executor = executor if executor is not None else LocalConv()
    model = Model(spec, seed=config.seed, executor=executor)
    if config.load:
        model.load(config.load)
    steps = total_steps(config, len(train_set))
    steps_per_epoch = len(train_set) // config.batch

    checkpoints = resumed = None
    fingerprint: dict = {}
    environment = compute_environment()
    if config.checkpoint_dir:
        checkpoints = CheckpointDir(config.checkpoint_dir, keep=config.checkpoint_keep)
        fingerprint = run_fingerprint(
            preset=config.preset,
            spec=spec,
            dataset=config.dataset,
            train_set=train_set,
            batch=config.batch,
            seed=config.seed,
            sgd=config.sgd,
            initial_weights=model.parameters(),
        )
        resumed = _resume_point(config, checkpoints, fingerprint, steps, len(train_set), log)
        checkpoints.remove_temporaries()

    executor.prepare(model.conv_specs(), config.batch, log)
    optimizer = SGD(model.parameters(), config.sgd)
    start_step = 0
    losses: list[float] = []
    recent_hits: list[float] = []
    conv_total = 0.0
    breakdown = np.zeros(3)  # comm, conv, comp summed over steps after the first
    earlier_seconds = 0.0  # training time before the checkpoint resumed from
    if resumed is not None:
        state, _ = resumed
        model.load_state(state.model)
        optimizer.load_state(state.momentum)
        start_step = state.step
        losses = state.losses.tolist()
        recent_hits = state.recent_hits.tolist()
        conv_total = state.conv_seconds
        breakdown = state.breakdown.copy()
        earlier_seconds = state.train_seconds

    print(
        f"training {config.preset} on {config.dataset} ({len(train_set)} images, "
        f"{len(test_set)} held out): {steps} steps of batch {config.batch}",
        file=log,
    )
    if resumed is not None:
        print(f"resumed from step {start_step} (checkpoint {resumed[1]})", file=log)
        changed = [
            f"{key} {resumed[0].environment.get(key)} there, {value} here"
            for key, value in environment.items()
            if resumed[0].environment.get(key) != value
        ]
        if changed:
            print(
                f"note: {'; '.join(changed)}: the result can differ from an uninterrupted "
                "run by float32 round-off",
                file=log,
            )
    trace = Trace(config.trace, resume_step=start_step if resumed is not None else None)
    if trace.dropped:
        print(
            f"trace {config.trace}: kept {trace.kept} records, cut {trace.dropped} written "
            "after the checkpoint",
            file=log,
        )
    last_message = -math.inf
    start = time.perf_counter()
    bar = tqdm(
        total=steps,
        initial=start_step,
        disable=not config.progress,
        file=log,
        unit="step",
        leave=True,
    )
    # With checkpoints, Ctrl-C or SIGTERM (a laptop shutting down) finishes the step first and
    # checkpoints it, so nothing computed is lost.
    stop_request = _StopAtStepBoundary(log) if checkpoints is not None else None
    try:
        if stop_request is not None:
            stop_request.__enter__()
        order = np.empty(0, np.int64)
        for step in range(start_step, steps):
            epoch, position = divmod(step, steps_per_epoch)
            if position == 0 or step == start_step:
                order = epoch_order(len(train_set), config.seed, epoch)
            indices = order[position * config.batch : (position + 1) * config.batch]
            executor.begin_step(step)
            step_start = time.perf_counter()
            x, labels = train_set.batch(indices)
            loss, grad, hits = softmax_cross_entropy(model.forward(x), labels)
            if not math.isfinite(loss):
                raise FloatingPointError(
                    f"loss became {loss} at step {step}; lower the learning rate "
                    f"(now {config.sgd.lr})"
                )
            model.backward(grad)
            optimizer.step(model.gradients())
            seconds = time.perf_counter() - step_start
            cluster = executor.end_step()
            comm, conv = cluster.pop("comm_seconds"), cluster.pop("conv_seconds")
            # The paper's terms: communication + convolution (slowest node) + the rest.
            comp = max(seconds - comm - conv, 0.0)
            conv_total += conv
            if step > 0 or steps == 1:
                breakdown += (comm, conv, comp)
            losses.append(loss)
            recent_hits = (recent_hits + [float(hits.mean())])[-min(50, steps_per_epoch) :]
            record = {
                "step": step,
                "epoch": epoch,
                "loss": loss,
                "accuracy": float(hits.mean()),
                "batch": int(len(indices)),
                "seconds": seconds,
                "comm_seconds": comm,
                "conv_seconds": conv,
                "comp_seconds": comp,
                **cluster,
            }
            done = step + 1
            stopping = stop_request is not None and stop_request.signum is not None
            due = checkpoints is not None and (
                done % config.checkpoint_interval == 0 or done == steps or stopping
            )
            target = None
            if not due:
                trace.write(record)
            else:
                # The trace record goes first: a crash before the checkpoint commits leaves
                # records past the latest checkpoint, which a resume cuts off; never a gap.
                target = checkpoints.file_for(done)
                record.update(event="checkpoint", checkpoint=os.fspath(target))
                trace.write(record)
                trace.sync()
                next_epoch, next_position = divmod(done, steps_per_epoch)
                next_order = (
                    order
                    if next_epoch == epoch
                    else epoch_order(len(train_set), config.seed, next_epoch)
                )
                state = TrainingState(
                    step=done,
                    epoch=next_epoch,
                    position=next_position,
                    seed=config.seed,
                    steps_per_epoch=steps_per_epoch,
                    order_sha256=order_digest(next_order),
                    model=model.parameters(),
                    momentum=optimizer.state(),
                    losses=np.asarray(losses, np.float64),
                    recent_hits=np.asarray(recent_hits, np.float64),
                    breakdown=breakdown,
                    conv_seconds=conv_total,
                    train_seconds=earlier_seconds + time.perf_counter() - start,
                    fingerprint=fingerprint,
                    environment=environment,
                )
                try:
                    checkpoints.write(state)
                except OSError as e:
                    # A full disk must not end the run: the previous checkpoint stays latest.
                    record.update(event="checkpoint_failed", checkpoint_error=str(e))
                    trace.replace_last(record)
                    tqdm.write(f"checkpoint at step {done} failed: {e}", file=log)
                    target = None
                else:
                    now = time.monotonic()
                    if (
                        done == steps
                        or stopping
                        or now - last_message >= _CHECKPOINT_MESSAGE_SECONDS
                    ):
                        tqdm.write(f"checkpoint written: {target}", file=log)
                        last_message = now
            bar.update(1)
            bar.set_postfix(
                loss=f"{loss:.3f}",
                acc=f"{np.mean(recent_hits):.2f}",
                img_s=f"{len(indices) / seconds:.0f}",
                refresh=False,
            )
            if stopping and done < steps:  # at the last step the run is simply done
                raise TrainingInterrupted(stop_request.signum, done, target)
    finally:
        if stop_request is not None:
            stop_request.__exit__(None, None, None)
        bar.close()
        trace.close()
    seconds = earlier_seconds + time.perf_counter() - start

    eval_loss = eval_accuracy = None
    if len(test_set):
        eval_loss, eval_accuracy = evaluate(model, test_set, config.eval_batch)
    if config.save:
        Path(config.save).parent.mkdir(parents=True, exist_ok=True)
        model.save(config.save)
    result = TrainResult(
        steps=steps,
        losses=losses,
        train_accuracy=float(np.mean(recent_hits)) if recent_hits else 0.0,
        eval_accuracy=eval_accuracy,
        eval_loss=eval_loss,
        seconds=seconds,
        conv_seconds=conv_total,
        images_per_second=steps * config.batch / seconds,
    )
    summary = (
        f"done: {steps} steps in {seconds:.1f} s ({result.images_per_second:.0f} images/s, "
        f"convolutions {100 * conv_total / seconds:.0f}% of the time); "
        f"final loss {losses[-1]:.3f}"
    )
    if eval_accuracy is not None:
        summary += (
            f"; held-out accuracy {100 * eval_accuracy:.1f}% on {len(test_set)} images "
            f"(chance {100 / train_set.num_classes:.0f}%)"
        )
    print(summary, file=log)
    timed = max(steps - 1, 1)
    comm, conv, comp = 1e3 * breakdown / timed
    print(
        f"per step (mean of {timed}): communication {comm:.1f} ms, convolution "
        f"(slowest node) {conv:.1f} ms, other computation {comp:.1f} ms",
        file=log,
    )
    if config.save:
        print(f"weights saved to {os.fspath(config.save)}", file=log)
    return result
