"""SGD with momentum and weight decay, ``torch.optim.SGD`` semantics."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SGDConfig:
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 5e-4

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"learning rate must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"weight decay must be >= 0, got {self.weight_decay}")


def sgd_update(
    p: np.ndarray, grad: np.ndarray, buf: np.ndarray | None, config: SGDConfig
) -> np.ndarray | None:
    """One SGD step on ``p`` in place (torch semantics); returns the momentum buffer (``buf``
    updated in place, a new one when ``buf`` is None: the first step), or None without momentum.

    Elementwise: applied to a slice of a tensor (with the slice of its gradient and buffer) it
    gives bitwise the numbers the whole tensor's update gives there, which is what lets a worker
    update a resident kernel slice itself (:mod:`hetconv.master.resident`).
    """
    lr, momentum, wd = (
        np.float32(config.lr),
        np.float32(config.momentum),
        np.float32(config.weight_decay),
    )
    g = grad
    if wd:
        g = g + wd * p
    if momentum:
        if buf is None:
            buf = g.astype(np.float32)  # a copy; on a device array too (a worker's GPU)
        else:
            buf *= momentum
            buf += g
        g = buf
    p -= lr * g
    return buf if momentum else None


class SGD:
    """``g = grad + wd * p; buf = momentum * buf + g (buf = g on the first step); p -= lr * buf``.

    Args:
        params: name -> live parameter array (updated in place).
        config: learning rate, momentum, weight decay.
    """

    def __init__(self, params: dict[str, np.ndarray], config: SGDConfig = SGDConfig()):
        self.params = params
        self.config = config
        self.momentum_buffers: dict[str, np.ndarray] = {}

    def step(self, grads: dict[str, np.ndarray]) -> None:
        for name, p in self.params.items():
            buf = sgd_update(p, grads[name], self.momentum_buffers.get(name), self.config)
            if buf is not None:
                self.momentum_buffers[name] = buf

    def state(self) -> dict[str, np.ndarray]:
        """Momentum buffers by parameter name (for checkpoints)."""
        return dict(self.momentum_buffers)

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        for name, buf in state.items():
            if name not in self.params or buf.shape != self.params[name].shape:
                raise ValueError(f"momentum buffer {name} does not match the model")
        self.momentum_buffers = {k: np.array(v, np.float32) for k, v in state.items()}
