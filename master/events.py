"""What happened to the cluster, in order: membership events and share changes.

Every event is kept (``EventLog.events``), handed to the step's trace record once
(:meth:`EventLog.take_step_events`) and, when the cluster has a console, printed as one line
that survives a progress bar (``tqdm.write``).
"""

from __future__ import annotations

import threading
import time
from typing import TextIO

from tqdm import tqdm

#: The longest reason an event line keeps (its first line, cut at a word with an ellipsis).
REASON_CHARS = 300


def short_reason(text: str, limit: int = REASON_CHARS) -> str:
    """The first line of ``text``, whole if it fits in ``limit`` characters, else cut at the
    last word boundary before it with "…" (never mid-word: ``UNKNOW``)."""
    lines = str(text).strip().splitlines()
    line = lines[0].rstrip() if lines else ""
    if len(line) <= limit:
        return line
    cut = line[: limit - 1]
    space = cut.rfind(" ")
    if space > limit // 2:  # a word boundary not too far back; else cut inside a long token
        cut = cut[:space]
    return cut.rstrip(" ,;:([") + "…"


def shares_text(shares: dict[str, dict[str, int]]) -> str:
    """``kernels conv1 3/3/2, conv2 5/6/5 (master/127.0.0.1:5001/...)`` for the console."""
    layers = ", ".join(
        f"{layer} {'/'.join(map(str, by_node.values()))}" for layer, by_node in shares.items()
    )
    nodes = next(iter(shares.values()), {})
    return f"kernels {layers} ({'/'.join(nodes)})"


class EventLog:
    """The cluster's events: kept in order, handed to each step's trace record, printed.

    Args:
        console: where to print one line per event (None: nowhere).

    Thread-safe: the monitor thread and the training thread both emit.
    """

    def __init__(self, console: TextIO | None = None):
        self.console = console
        self.step = 0  # the training step events are stamped with (set at each step start)
        self.events: list[dict] = []
        self._since_step: list[dict] = []
        self._lock = threading.Lock()

    def emit(self, kind: str, worker: str | None = None, **details) -> None:
        """Record event ``kind`` (``worker_lost``, ``shares_changed``, ...) with ``details``."""
        record = {"event": kind, "step": self.step, "time": time.time(), **details}
        if worker is not None:
            record["worker"] = worker
        with self._lock:
            self.events.append(record)
            self._since_step.append(record)
        if self.console is not None:
            text = ", ".join(
                shares_text(v) if k == "shares" else f"{k} {v}" for k, v in details.items()
            )
            who = f" {worker}" if worker else ""
            tqdm.write(
                f"[step {self.step}] {kind.replace('_', ' ')}{who}: {text}", file=self.console
            )

    def take_step_events(self) -> list[dict]:
        """The events since the last call (for the step's trace record)."""
        with self._lock:
            events, self._since_step = self._since_step, []
        return events
