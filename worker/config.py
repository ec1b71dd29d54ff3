"""How a worker serves: its limits and defaults (``hetconv worker`` flags)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker serves.

    Args:
        max_request_bytes: the largest request (all tensors together) it accepts; bigger ones are
            refused with RESOURCE_EXHAUSTED instead of swapping the machine to death.
        sessions: masters whose forward inputs it keeps at once (least recently used goes;
            ``hetconv worker --sessions N``); each may keep ``memory_bytes / sessions``.
        probe_repeats: timed runs per probe when the master does not say (best is reported).
        memory_bytes: what calls in flight and saved forward states may hold together
            (``--memory-mib``); a call that does not fit is refused with RESOURCE_EXHAUSTED
            before anything is allocated.
        max_calls: calls (convolutions and probes) in flight at once; one more is refused with
            RESOURCE_EXHAUSTED at once (``--max-calls``). Calls that only wait for another
            worker's part (FetchPart) take no slot: as many may wait besides.
        idle_timeout: seconds a call may wait on its client, for a message or for it to take
            an answer chunk, before it is ended (``--idle-timeout``); None: never.
        streams_per_connection: concurrent calls one client connection may have (HTTP/2
            ``SETTINGS_MAX_CONCURRENT_STREAMS``; more wait in the client).
    """

    max_request_bytes: int = 2 << 30
    sessions: int = 4
    probe_repeats: int = 2
    memory_bytes: int = 4 << 30
    max_calls: int = 16
    idle_timeout: float | None = 10.0
    streams_per_connection: int = 8

    def __post_init__(self):
        if self.sessions < 1:
            raise ValueError(f"sessions must be at least 1, got {self.sessions}")
        for name in ("memory_bytes", "max_calls", "streams_per_connection"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.idle_timeout is not None and self.idle_timeout <= 0:
            raise ValueError(f"idle_timeout must be positive or None, got {self.idle_timeout}")
        if self.max_request_bytes > self.memory_bytes:
            raise ValueError(
                f"a request may hold {self.max_request_bytes >> 20} MiB (--max-request-mib), "
                f"more than the whole memory budget of {self.memory_bytes >> 20} MiB "
                "(--memory-mib)"
            )

    @property
    def threads(self) -> int:
        """gRPC handler threads: one per call in flight, one per call that only waits (as
        many), and :data:`SPARE_THREADS` more."""
        return 2 * self.max_calls + SPARE_THREADS


#: Handler threads beyond the calls in flight and those waiting: health checks, Describe and
#: refusals of calls over the limit are served by these while every call slot is taken.
SPARE_THREADS = 8


__all__ = ["SPARE_THREADS", "WorkerConfig"]
