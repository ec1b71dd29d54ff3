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
        c = self.config
        lr, momentum, wd = np.float32(c.lr), np.float32(c.momentum), np.float32(c.weight_decay)
        for name, p in self.params.items():
            g = grads[name]
            if wd:
                g = g + wd * p
            if momentum:
                buf = self.momentum_buffers.get(name)
                if buf is None:
                    buf = self.momentum_buffers[name] = np.array(g, np.float32)
                else:
                    buf *= momentum
                    buf += g
                g = buf
            p -= lr * g

    def state(self) -> dict[str, np.ndarray]:
        """Momentum buffers by parameter name (for checkpoints)."""
        return dict(self.momentum_buffers)

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        for name, buf in state.items():
            if name not in self.params or buf.shape != self.params[name].shape:
                raise ValueError(f"momentum buffer {name} does not match the model")
        self.momentum_buffers = {k: np.array(v, np.float32) for k, v in state.items()}
