"""The request mix of ``benchmarks/soak.py`` (see its docstring): a tiny conv layer's bundled
Forward and Backward, a streamed Forward of a bigger layer and an Echo, from one
:class:`WorkerClient`, with its results checked against the cpu backend; and a worker's RSS."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hetconv.backends import Padding, get_backend
from hetconv.master.client import WorkerClient
from hetconv.model import Model, load_spec

BATCH = 8
BIG_X = (8, 16, 48, 48)  # 1.18 MB of float32: a streamed call
BIG_K = 16
ECHO_FLOATS = 1024  # 4 KiB
#: Requests of one round of the mix, by kind, in order (see the module docstring).
ROUND = ["forward-bundle", "backward-bundle"] * 4 + ["forward-stream", "echo"]


def rss_mib(pid: int) -> float | None:
    """Resident memory of process ``pid`` in MiB (Linux ``/proc``); None elsewhere."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # the figure is in kB
    return None


@dataclass
class KindStats:
    """Calls of one kind: how many, their summed wall time, and how many failed."""

    count: int = 0
    seconds: float = 0.0
    errors: int = 0
    first_error: str = ""


@dataclass
class Mix:
    """The requests of the soak, with the state they carry (session, step)."""

    client: WorkerClient
    session: int = field(default_factory=lambda: random.getrandbits(64))
    step: int = 0

    def __post_init__(self) -> None:
        model = Model(load_spec("tiny"), seed=0)
        conv2 = next(layer for layer in model.layers if layer.name == "conv2")
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((BATCH, *conv2.input_shape), dtype=np.float32)
        self.w = conv2.params["weight"]
        self.b = conv2.params["bias"]
        pad = Padding.resolve(conv2.padding, conv2.kernel_size)
        self.padding = (pad.top, pad.bottom, pad.left, pad.right)
        ho = self.x.shape[2] + pad.top + pad.bottom - self.w.shape[2] + 1
        wo = self.x.shape[3] + pad.left + pad.right - self.w.shape[3] + 1
        self.dy = rng.standard_normal((BATCH, self.w.shape[0], ho, wo), dtype=np.float32)
        self.backward_bytes = 4 * (self.w.size + self.b.size + self.x.size)
        self.big_x = rng.standard_normal(BIG_X, dtype=np.float32)
        self.big_w = rng.standard_normal((BIG_K, BIG_X[1], 3, 3), dtype=np.float32)
        self.big_b = np.zeros(BIG_K, np.float32)
        self.echo_array = rng.standard_normal(ECHO_FLOATS, dtype=np.float32)
        self.calls: dict[str, Callable[[], object]] = {
            "forward-bundle": self.forward,
            "backward-bundle": self.backward,
            "forward-stream": self.forward_big,
            "echo": self.echo,
        }

    def forward(self):
        self.step += 1
        y, stats = self.client.forward(
            self.session, self.step, "conv2", self.x, self.w, self.b, self.padding
        )
        assert stats.bundled
        return y

    def backward(self):
        dx, dw, db, stats = self.client.backward(
            self.session, self.step, "conv2", self.dy, True, answer_bytes=self.backward_bytes
        )
        assert stats.bundled
        return dx, dw, db

    def forward_big(self):
        y, stats = self.client.forward(
            self.session, self.step, "big", self.big_x, self.big_w, self.big_b, (1, 1, 1, 1)
        )
        assert not stats.bundled
        return y

    def echo(self):
        (back,), _ = self.client.echo([("link", self.echo_array)])
        return back

    def check(self) -> None:
        """The tiny layer's forward and backward equal the cpu backend's here."""
        cpu = get_backend("cpu")
        y = self.forward()
        dx, dw, db = self.backward()
        expected_dw, expected_db = cpu.conv_grad_kernels(self.x, self.dy, (5, 5), self.padding)
        for name, got, expected in (
            ("y", y, cpu.conv_forward(self.x, self.w, self.b, self.padding)),
            ("dx", dx, cpu.conv_grad_input(self.dy, self.w, self.x.shape[2:], self.padding)),
            ("dw", dw, expected_dw),
            ("db", db, expected_db),
        ):
            if not np.allclose(got, expected, rtol=1e-4, atol=1e-4):
                raise RuntimeError(f"the worker's {name} differs from the cpu backend's")


def format_mib(value: float | None, sign: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.1f}" if sign else f"{value:.1f}"
