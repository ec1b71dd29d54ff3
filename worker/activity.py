"""What a worker served: requests, bytes in and out, masters seen; counted since the last look.

The worker prints one line of it every ``--report-every`` seconds, so a worker serving
thousands of requests says so instead of staying silent.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class ActivitySummary:
    """What happened between two looks (:meth:`Activity.take`)."""

    seconds: float
    requests: int
    bytes_in: int
    bytes_out: int
    sessions: int  # distinct master sessions that sent a request

    def describe(self) -> str:
        """``served 120 requests in 30 s: 45.2 MB in, 38.1 MB out, 2 masters``."""
        masters = f"{self.sessions} master{'' if self.sessions == 1 else 's'}"
        return (
            f"served {self.requests} requests in {self.seconds:.0f} s: "
            f"{_amount(self.bytes_in)} in, {_amount(self.bytes_out)} out, {masters}"
        )


def _amount(nbytes: int) -> str:
    """``45.2 MB``, or ``12.3 kB`` under a megabyte (a few small calls would read ``0.0 MB``)."""
    if nbytes < 1e6:
        return f"{nbytes / 1e3:.1f} kB"
    return f"{nbytes / 1e6:.1f} MB"


class Activity:
    """Thread-safe counters of a worker's calls (every gRPC handler thread notes into it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests = self._bytes_in = self._bytes_out = 0
        self._sessions: set[int] = set()

    def received(self, session: int, nbytes: int) -> None:
        """A request's tensors arrived (``nbytes`` of them) from master session ``session``."""
        with self._lock:
            self._bytes_in += nbytes
            self._sessions.add(session)

    def answered(self, nbytes: int) -> None:
        """A request was answered with ``nbytes`` of tensors."""
        with self._lock:
            self._requests += 1
            self._bytes_out += nbytes

    def take(self, seconds: float) -> ActivitySummary:
        """What was counted since the last call (which covered ``seconds``), and reset."""
        with self._lock:
            summary = ActivitySummary(
                seconds, self._requests, self._bytes_in, self._bytes_out, len(self._sessions)
            )
            self._requests = self._bytes_in = self._bytes_out = 0
            self._sessions = set()
        return summary
