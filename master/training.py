"""The training loop: data order, SGD steps, progress, held-out evaluation and the trace.

The loop does not know where convolutions run: it trains a :class:`~hetconv.model.Model`
whose executor is local today and the master's cluster when workers are named.
"""

from __future__ import annotations

import json
import math
import os
import sys
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

# Synthetic held-out data is drawn with a seed far from any training seed.
_SYNTHETIC_EVAL_SEED_OFFSET = 1_000_003


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
    """One JSON object per line per step; the simulator calibrates from these files."""

    def __init__(self, path: str | None):
        self._file: TextIO | None = open(path, "w", encoding="utf-8") if path else None

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def total_steps(config: TrainConfig, train_size: int) -> int:
    steps_per_epoch = max(1, train_size // config.batch)
    if config.steps is not None:
        return config.steps
    if config.epochs is not None:
        return max(1, math.ceil(config.epochs * steps_per_epoch))
    return 300


def train(
    config: TrainConfig,
    executor: ConvExecutor | None = None,
    log: TextIO | None = None,
) -> TrainResult:
    """Train ``config.preset`` and evaluate it on held-out data.

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
    executor.prepare(model.conv_layers(), config.batch, log)
    optimizer = SGD(model.parameters(), config.sgd)
    steps = total_steps(config, len(train_set))
    steps_per_epoch = len(train_set) // config.batch

    print(
        f"training {config.preset} on {config.dataset} ({len(train_set)} images, "
        f"{len(test_set)} held out): {steps} steps of batch {config.batch}",
        file=log,
    )
    trace = Trace(config.trace)
    losses: list[float] = []
    recent_hits: list[float] = []
    conv_total = 0.0
    breakdown = np.zeros(3)  # comm, conv, comp summed over steps after the first
    start = time.perf_counter()
    bar = tqdm(total=steps, disable=not config.progress, file=log, unit="step", leave=True)
    try:
        order = np.empty(0, np.int64)
        for step in range(steps):
            epoch, position = divmod(step, steps_per_epoch)
            if position == 0:
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
            model.conv_seconds()  # reset the layers' own clocks
            cluster = executor.end_step()
            comm, conv = cluster.pop("comm_seconds"), cluster.pop("conv_seconds")
            # The paper's terms: communication + convolution (slowest node) + the rest.
            comp = max(seconds - comm - conv, 0.0)
            conv_total += conv
            if step > 0 or steps == 1:
                breakdown += (comm, conv, comp)
            losses.append(loss)
            recent_hits = (recent_hits + [float(hits.mean())])[-min(50, steps_per_epoch) :]
            trace.write(
                {
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
            )
            bar.update(1)
            bar.set_postfix(
                loss=f"{loss:.3f}",
                acc=f"{np.mean(recent_hits):.2f}",
                img_s=f"{len(indices) / seconds:.0f}",
                refresh=False,
            )
    finally:
        bar.close()
        trace.close()
    seconds = time.perf_counter() - start

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
