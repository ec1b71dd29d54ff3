"""Batch normalisation: the layer and the per-channel batch statistics it trains by.

Both compute in the array module of the array they are given (numpy, or cupy on a GPU:
:func:`~hetconv.backends.arrays.array_module`); a layer run on device arrays needs its
parameters and running statistics there too (:func:`hetconv.stages.stage_forward` puts them).
"""

from __future__ import annotations

import numpy as np

from .backends.arrays import array_module
from .graph import Layer

#: Planes up to this many values are summed as one float32 dot product; larger ones row by row,
#: so no float32 partial sum spans more than a few thousand values.
PLANE_VALUES = 4096
#: Planes of fewer values are summed across the images first: a dot product per plane of a
#: few values costs more in calls than in sums.
SMALL_PLANE = 32


def plane_sums(a, b=None):
    """Per channel of float32 NCHW ``a``: the float64 (C,) sum over (N, H, W) of ``a`` (or of
    ``a * b``, ``b`` of ``a``'s shape).

    Each image's plane of a channel (each row of it where the plane is larger than
    :data:`PLANE_VALUES`) is one float32 dot product (a ``matmul`` of a row by a column:
    BLAS's ``sdot`` on the CPU), which reads the values once and writes no temporary; those
    partial sums are added in float64. Planes smaller than :data:`SMALL_PLANE` are added
    image after image in float64 (one pass, elementwise), then each channel's plane summed.

    .. note:: Channel by channel the result depends only on that channel's values (each
        partial sum is its own dot product, or elementwise): a slice of the channels has the
        sums of those channels of the whole, bit for bit.
    """
    n, c, h, w = a.shape
    xp = array_module(a)
    if h * w < SMALL_PLANE:
        values = a if b is None else a * b
        planes = values.reshape(n, c * h * w).sum(axis=0, dtype=np.float64)
        ones = xp.ones((h * w, 1), np.float64)
        return xp.matmul(planes.reshape(c, 1, h * w), ones).reshape(c)
    rows, length = (1, h * w) if h * w <= PLANE_VALUES else (h, w)
    left = a.reshape(n, c, rows, 1, length)
    if b is None:
        right = xp.ones((length, 1), np.float32)
    else:
        right = b.reshape(n, c, rows, length, 1)
    return xp.matmul(left, right).sum(axis=(0, 2, 3, 4), dtype=np.float64)


def channel_planes(v, shape: tuple[int, ...]):
    """float32 (1, C, H, W): each channel's plane filled with its value of ``v`` (C,).

    An elementwise operation of an NCHW array with it runs at the speed of one between arrays
    of the same shape (broadcast along N only); numpy broadcasts a (1, C, 1, 1) operand two to
    three times slower.
    """
    xp = array_module(v)
    planes = xp.empty((1, *shape[1:]), np.float32)
    xp.copyto(planes, v.reshape(1, -1, 1, 1))
    return planes


def batch_statistics(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-channel batch statistics of float32 NCHW ``x``, as :class:`BatchNorm2d` trains.

    Returns:
        float64 (C,) mean and biased variance over (N, H, W), and the float32 centred ``x``
        (``x`` less its mean cast to float32), the variance's source.

    .. note:: Summed by :func:`plane_sums`: float32 per image plane, float64 across them.
        Channel by channel the result depends only on that channel's values: a slice of the
        channels has the statistics of those channels of the whole.
    """
    count = x.shape[0] * x.shape[2] * x.shape[3]
    mean = plane_sums(x) / count
    centred = x - channel_planes(mean.astype(np.float32), x.shape)
    var = plane_sums(centred, centred) / count
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
            y = x * channel_planes(scale, x.shape)
            y += channel_planes(shift, x.shape)
            return y
        count = x.shape[0] * x.shape[2] * x.shape[3]
        mean, var, x_hat = batch_statistics(x)
        inv_std = (1.0 / xp.sqrt(var + self.eps)).astype(np.float32)
        x_hat *= channel_planes(inv_std, x.shape)  # the centred values, normalised in place
        self.track(mean, var, count)
        self.buffers["num_batches_tracked"] += 1
        self.batch_stats = (mean, var)  # what a fused stage answers for the master's track()
        self._x_hat, self._inv_std = x_hat, inv_std
        y = x_hat * channel_planes(gamma, x.shape)
        y += channel_planes(beta, x.shape)
        return y

    def backward(self, dy):
        gamma = self.params["weight"]
        if self._x_hat is None:  # evaluation mode: an affine map per channel
            zeros = array_module(dy).zeros_like(gamma)
            self.grads = {"weight": zeros, "bias": dy.sum(axis=(0, 2, 3))}
            return dy * channel_planes(self._eval_scale, dy.shape)
        x_hat, inv_std = self._x_hat, self._inv_std
        count = dy.shape[0] * dy.shape[2] * dy.shape[3]
        d_beta = plane_sums(dy)
        d_gamma = plane_sums(dy, x_hat)
        self.grads = {"weight": d_gamma.astype(np.float32), "bias": d_beta.astype(np.float32)}
        # dx = gamma * inv_std * (dy - mean(dy) - x_hat * mean(dy * x_hat)), in this order
        # (the round-off of hetconv.imagesplit's batch norm, which sums across nodes)
        dx = dy - channel_planes((d_beta / count).astype(np.float32), dy.shape)
        dx -= x_hat * channel_planes((d_gamma / count).astype(np.float32), dy.shape)
        dx *= channel_planes((gamma * inv_std).astype(np.float32), dy.shape)
        return dx
