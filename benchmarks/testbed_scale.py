"""How ``benchmarks/testbed.py`` scales this machine to laptops: the caps, a laptop core's
speed and links, and this machine's core measured on a network's convolutions."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from hetconv.simulations.testbed import SHARED_LINK, SWITCHED_LINK, with_blas_threads

#: Sum of the caps of all processes, at most: leaves this 2-core machine a little for the
#: kernel, tc and the benchmark itself.
MAX_TOTAL_CAP = 1.8
#: What ``hetconv`` compute on one laptop core reaches, GFLOPS (see ``testbed.py``'s docstring).
LAPTOP_GFLOPS = 60.0
#: The real links the testbed's are scaled from, Mbit/s.
LAPTOP_LINK_MBIT = {SWITCHED_LINK: 1000.0, SHARED_LINK: 100.0}


@dataclass(frozen=True)
class Scale:
    """How the testbed maps to laptops: compute and links scaled by the same factor."""

    cap: float  # of a core, per process
    core_gflops: float  # this machine's core on the network's convolutions
    laptop_gflops: float
    laptop_link_mbit: float  # the real link: gigabit, or Wi-Fi's 100 Mbit/s

    @property
    def factor(self) -> float:
        """The testbed's compute (and link) over a laptop's."""
        return self.cap * self.core_gflops / self.laptop_gflops

    @property
    def rate_mbit(self) -> float:
        return self.factor * self.laptop_link_mbit


def measure_core_gflops(network: str, batch: int, repeats: int = 3) -> float:
    """GFLOPS of one core of this machine on ``network``'s convolutions at ``batch``: forward,
    kernel gradient and (where the layer needs it) input gradient of every conv layer with the
    cpu backend on one BLAS thread, best of ``repeats``, total FLOPs over total seconds. Runs in
    a process of its own, uncapped, and counts the process's CPU seconds, not wall seconds: a
    capped process gets CPU seconds, so that is the speed its cap is a fraction of, and other
    load on the machine does not enter (short of what it does to the caches)."""
    code = (
        "import time\n"
        "import numpy as np\n"
        "from hetconv.backends import get_backend\n"
        "from hetconv.workload import network_layers\n"
        "backend = get_backend('cpu')\n"
        "rng = np.random.default_rng(0)\n"
        "flops = seconds = 0.0\n"
        f"for layer in network_layers({network!r}, {batch}):\n"
        "    s = layer.shape\n"
        "    x = rng.standard_normal((s.n, s.c, s.h, s.w), dtype=np.float32)\n"
        "    w = rng.standard_normal((s.k, s.c, s.kh, s.kw), dtype=np.float32)\n"
        "    b = np.zeros(s.k, np.float32)\n"
        "    dy = rng.standard_normal((s.n, s.k, *s.out_hw), dtype=np.float32)\n"
        "    pad = s.padding.sides\n"
        "    best = float('inf')\n"
        f"    for _ in range({repeats}):\n"
        "        start = time.process_time()\n"
        "        backend.conv_forward(x, w, b, pad)\n"
        "        backend.conv_grad_kernels(x, dy, (s.kh, s.kw), pad)\n"
        "        if layer.need_input_grad:\n"
        "            backend.conv_grad_input(dy, w, (s.h, s.w), pad)\n"
        "        best = min(best, time.process_time() - start)\n"
        "    seconds += best\n"
        "    flops += s.flops_forward * layer.step_passes\n"
        "print(flops / seconds / 1e9)\n"
    )
    env = with_blas_threads(os.environ, 1)
    done = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"measuring this core failed:\n{done.stderr.strip()}")
    return float(done.stdout.split()[-1])
