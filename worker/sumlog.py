"""Where a ring's batch norm sums wait: each sum's timings, written where ``HETCONV_SUM_LOG``
names a folder (unset: nothing is written, and nothing costs more than a check).

Each worker process appends to ``<folder>/<pid>.txt`` a line per sum it takes (``S session
step offset rank began ended``, wall-clock seconds) and one per part another rank filed here
(``F session step round when``). A testbed's processes run on one host, on one clock, so
``benchmarks/sum_waits.py`` can put the lines of every rank side by side: each sum's wait split
into waiting for the last rank to begin it, the last rank's own sum, and a part's way from
the moment its sender began the sum to its filing here.
"""

from __future__ import annotations

import os
import threading

ENV = "HETCONV_SUM_LOG"

_folder = os.environ.get(ENV) or None
_lock = threading.Lock()
_file = None


def enabled() -> bool:
    return _folder is not None


def _write(line: str) -> None:
    global _file
    with _lock:
        if _file is None:
            os.makedirs(_folder, exist_ok=True)
            _file = open(os.path.join(_folder, f"{os.getpid()}.txt"), "a", buffering=1)  # noqa: SIM115
        _file.write(line)


def summed(session: int, step: int, offset: int, rank: int, began: float, ended: float) -> None:
    """A sum this rank took (``time.time()`` at its start and end)."""
    if _folder is not None:
        _write(f"S {session} {step} {offset} {rank} {began:.6f} {ended:.6f}\n")


def filed(session: int, step: int, round_: int, when: float) -> None:
    """A part another rank put here, filed at ``when``."""
    if _folder is not None:
        _write(f"F {session} {step} {round_} {when:.6f}\n")
