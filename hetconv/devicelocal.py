"""``hetconv train --local --engine cuda``: each training step's whole model on this machine's
GPU (:class:`DeviceLocalConv`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .backends import Backend
from .conv import LocalConv
from .imagesplit import images_gradients
from .model import Model
from .ring import flat, unflat


class DeviceLocalConv(LocalConv):
    """:class:`LocalConv` on a device backend (cuda) that runs each training step's whole
    model there (``hetconv train --local --engine cuda``): forward, the softmax cross-entropy
    and backward on a twin of the model kept on the device
    (:meth:`~hetconv.model.Model.place`), computed as
    :func:`~hetconv.imagesplit.images_gradients` computes a batch's one range (the loss and
    its gradient by :func:`~hetconv.layers.softmax_cross_entropy`'s operations).

    Each step the model's parameters and buffers go up in one copy, the images and labels in
    one each (and each dropout layer's mask), and every gradient, each image's loss and hit
    and the buffers (batch norm's running statistics, moved by the batch) come down in one;
    the optimizer's update and evaluation stay the model's own, on the host (evaluation's
    convolutions on the device). On a host backend the training loop runs the passes.
    """

    def __init__(self, backend: Backend | str = "cuda"):
        super().__init__(backend)
        self._twin: tuple[int, Any] | None = None  # (id of the model, its twin there)

    def _twin_of(self, model):
        if self._twin is None or self._twin[0] != id(model):
            twin = Model(model.spec, model.input_shape, model.seed, self)  # its convolutions
            with self.backend.scope():
                self._twin = (id(model), twin.place(self.backend.to_device))
        return self._twin[1]

    def train_batch(self, model, x: np.ndarray, labels: np.ndarray, step: int):
        if not self.backend.on_device:
            return None
        backend, twin = self.backend, self._twin_of(model)
        names = list(model.parameters())
        with backend.scope():
            values = [*model.parameters().values(), *model.buffers().values()]
            uploaded = unflat(backend.to_device(flat(values)), [v.shape for v in values])
            there = [*twin.parameters().values(), *twin.buffers().values()]
            for target, value in zip(there, uploaded, strict=True):
                target[...] = value
            twin.train()
            grads, losses, hits = images_gradients(
                twin, backend.to_device(x), backend.to_device(labels), 0, len(x), step, copy=False
            )
            parts = [*map(grads.get, names), losses, hits.astype(np.float32),
                     *twin.buffers().values()]  # fmt: skip
            joined = backend.xp.concatenate([p.astype(np.float32, copy=False).ravel()
                                             for p in parts])  # fmt: skip
            down = unflat(backend.to_host(joined), [p.shape for p in parts])
        by_name = dict(zip(names, down, strict=False))
        for layer in model.layers:
            layer.grads = {key: by_name[f"{layer.name}.{key}"] for key in layer.params}
        for target, value in zip(model.buffers().values(), down[len(names) + 2 :], strict=True):
            target[...] = value
        losses, hits = down[len(names)], down[len(names) + 1]
        return float(losses.mean()), hits > 0.5


__all__ = ["DeviceLocalConv"]
