"""The run's data and held-out evaluation: the configured training and held-out sets, the
check that the network's outputs fit the classes, and the held-out loss and accuracy."""

from __future__ import annotations

import dataclasses

import numpy as np

from hetconv.data import ImageDataset, LoadedData, load_dataset, synthetic_cifar
from hetconv.layers import softmax_cross_entropy
from hetconv.model import Model, walk_spec

from .config import TrainConfig

# Synthetic held-out data is drawn with a seed far from any training seed.
_SYNTHETIC_EVAL_SEED_OFFSET = 1_000_003
SYNTHETIC_HELD_OUT = 2_000  # images in the synthetic held-out set (more with --eval-size)


def load_datasets(config: TrainConfig) -> LoadedData:
    """The training and held-out sets of the configured dataset (its kind resolved when
    ``auto``; the held-out set cut to ``eval_size``)."""
    if config.dataset == "synthetic":
        train = synthetic_cifar(config.train_size, seed=config.seed)
        held = synthetic_cifar(
            max(config.eval_size or SYNTHETIC_HELD_OUT, 1),
            seed=config.seed + _SYNTHETIC_EVAL_SEED_OFFSET,
        )
        data = LoadedData("synthetic", train, held, "synthetic images of another seed")
    else:
        data = load_dataset(
            config.dataset, config.data_dir, holdout_fraction=config.holdout_fraction
        )
    if config.eval_size is not None and config.eval_size < len(data.held_out):
        data = dataclasses.replace(data, held_out=data.held_out.split(config.eval_size)[0])
    return data


def check_classes(spec: list[dict], data: ImageDataset, preset: str) -> None:
    """Refuse a network whose outputs do not match the dataset's classes, naming both."""
    try:
        layers = list(walk_spec(spec, data.image_shape))
    except ValueError as e:
        shape = "x".join(map(str, data.image_shape))
        raise ValueError(
            f"network {preset} cannot take the dataset's {shape} images: {e}"
        ) from None
    outputs = layers[-1].output_shape if layers else data.image_shape
    if outputs != (data.num_classes,):
        last = f"its last layer ({layers[-1].name})" if layers else "it"
        fix = (
            f"export it from PyTorch with a last layer of {data.num_classes} outputs"
            if str(preset).lower().endswith(".onnx")
            else f'give a .json spec whose last fc has "out": {data.num_classes}'
        )
        raise ValueError(
            f"network {preset} gives {', '.join(map(str, outputs))} outputs from {last}, but the "
            f"dataset has {data.num_classes} classes: {fix}"
        )


def evaluate(model: Model, data: ImageDataset, batch: int = 200) -> tuple[float, float]:
    """(mean loss, accuracy) of ``model`` on ``data``."""
    total_loss, correct = 0.0, 0
    for start in range(0, len(data), batch):
        indices = np.arange(start, min(start + batch, len(data)))
        x, y = data.batch(indices)
        with model.evaluating():
            logits = model.forward(x)
        loss, _, hits = softmax_cross_entropy(logits, y)
        total_loss += loss * len(indices)
        correct += int(hits.sum())
    return total_loss / max(len(data), 1), correct / max(len(data), 1)
