"""Batch normalisation: the layer and the per-channel batch statistics it trains by.

Both compute in the array module of the array they are given (numpy, or cupy on a GPU:
:func:`~hetconv.backends.arrays.array_module`); a layer run on device arrays needs its
parameters and running statistics there too (:func:`hetconv.stages.stage_forward` puts them).
"""

from __future__ import annotations

import numpy as np

from .backends.arrays import array_module
from .graph import Layer


def batch_statistics(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-channel batch statistics of float32 NCHW ``x``, as :class:`BatchNorm2d` trains.

    Returns:
        float64 (C,) mean and biased variance over (N, H, W), and the float32 centred ``x``
        (``x`` less its mean cast to float32), the variance's source.

    .. note:: Summed in float64. Channel by channel the result depends only on that channel's
        values: a slice of the channels has the statistics of those channels of the whole.
    """
    mean = x.mean(axis=(0, 2, 3), dtype=np.float64)
    centred = x - mean.astype(np.float32).reshape(1, -1, 1, 1)
    var = array_module(x).square(centred, dtype=np.float64).mean(axis=(0, 2, 3))
    return mean, var, centred


class BatchNorm2d(Layer):
    """Batch normalisation per channel, ``torch.nn.BatchNorm2d(C, eps, momentum)`` semantics.

    Parameters: ``weight`` float32 (C,) (ones at start), ``bias`` float32 (C,) (zeros).
    Buffers: ``running_mean`` (zeros), ``running_var`` (ones), ``num_batches_tracked`` int64.
    Training normalises by the batch's mean and biased variance over (N, H, W) and moves the
    running statistics by ``momentum`` towards the batch's mean and *unbiased* variance;
    evaluation normalises by the running statistics.

    .. note:: The batch statistics are summed in float64, then used in float32.
    """

    def __init__(self, name: str, channels: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__(name)
        if not eps > 0:
            raise ValueError(f"{name}: batchnorm eps must be > 0, got {eps}")
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"{name}: batchnorm momentum must be in [0, 1], got {momentum}")
        self.channels, self.eps, self.momentum = channels, float(eps), float(momentum)
        self.params = {
            "weight": np.ones(channels, np.float32),
            "bias": np.zeros(channels, np.float32),
        }
        self.buffers = {
            "running_mean": np.zeros(channels, np.float32),
            "running_var": np.ones(channels, np.float32),
            "num_batches_tracked": np.zeros((), np.int64),
        }

    def reset_parameters(self) -> None:
        """PyTorch's start: weight 1, bias 0, running mean 0, running variance 1, count 0."""
        self.params["weight"][...] = 1
        self.params["bias"][...] = 0
        self.buffers["running_mean"][...] = 0
        self.buffers["running_var"][...] = 1
        self.buffers["num_batches_tracked"][...] = 0

    @staticmethod
    def _per_channel(v: np.ndarray) -> np.ndarray:
        return v.reshape(1, -1, 1, 1)

    def track(
        self, mean: np.ndarray, var: np.ndarray, count: int, channels: slice = slice(None)
    ) -> None:
        """Move the running statistics of ``channels`` by ``momentum`` towards a batch's.

        The training forward calls it for every channel; a master whose workers ran the
        forward of channel slices (fused stages, :mod:`hetconv.stages`) calls it once per
        slice with the statistics they answered, with the same result bit for bit (the update
        is elementwise). ``num_batches_tracked`` is not counted here: once per batch, by the
        caller.

        Args:
            mean, var: float64 (c,): the batch's per-channel mean and *biased* variance, as
                :func:`batch_statistics` returns them.
            count: the values per channel the statistics were taken over (N * H * W).
            channels: which of the layer's channels they are.
        """
        m = self.momentum
        unbiased = var * count / max(count - 1, 1)
        running_mean = self.buffers["running_mean"][channels]
        running_var = self.buffers["running_var"][channels]
        if mean.shape != running_mean.shape or var.shape != running_var.shape:
            raise ValueError(
                f"{self.name}: batch statistics of shapes {mean.shape} and {var.shape} for "
                f"{running_mean.shape[0]} channels"
            )
        running_mean[...] = (1 - m) * running_mean + m * mean
        running_var[...] = (1 - m) * running_var + m * unbiased

    def forward(self, x):
        gamma, beta = self.params["weight"], self.params["bias"]
        xp = array_module(x)
        if not self.training:
            inv_std = 1.0 / xp.sqrt(self.buffers["running_var"] + np.float32(self.eps))
            scale = (gamma * inv_std).astype(np.float32)
            shift = (beta - self.buffers["running_mean"] * scale).astype(np.float32)
            self._eval_scale = scale
            self._x_hat = None
            return x * self._per_channel(scale) + self._per_channel(shift)
        count = x.shape[0] * x.shape[2] * x.shape[3]
        mean, var, centred = batch_statistics(x)
        inv_std = (1.0 / xp.sqrt(var + self.eps)).astype(np.float32)
        x_hat = centred * self._per_channel(inv_std)
        self.track(mean, var, count)
        self.buffers["num_batches_tracked"] += 1
        self.batch_stats = (mean, var)  # what a fused stage answers for the master's track()
        self._x_hat, self._inv_std = x_hat, inv_std
        return x_hat * self._per_channel(gamma) + self._per_channel(beta)

    def backward(self, dy):
        gamma = self.params["weight"]
        if self._x_hat is None:  # evaluation mode: an affine map per channel
            zeros = array_module(dy).zeros_like(gamma)
            self.grads = {"weight": zeros, "bias": dy.sum(axis=(0, 2, 3))}
            return dy * self._per_channel(self._eval_scale)
        x_hat, inv_std = self._x_hat, self._inv_std
        count = dy.shape[0] * dy.shape[2] * dy.shape[3]
        d_beta = dy.sum(axis=(0, 2, 3), dtype=np.float64)
        d_gamma = (dy * x_hat).sum(axis=(0, 2, 3), dtype=np.float64)
        self.grads = {"weight": d_gamma.astype(np.float32), "bias": d_beta.astype(np.float32)}
        # dx = gamma * inv_std * (dy - mean(dy) - x_hat * mean(dy * x_hat))
        dx = dy - self._per_channel((d_beta / count).astype(np.float32))
        dx -= x_hat * self._per_channel((d_gamma / count).astype(np.float32))
        dx *= self._per_channel((gamma * inv_std).astype(np.float32))
        return dx
