"""The share of a core this process gets, sustained (:func:`cpu_share`): under a CPU quota
(a cgroup's, a container's ``--cpus``) or on a busy machine, a short call may run at the whole
core's speed while a training step runs as the share allows, so timings of short calls are
scaled by it (:meth:`hetconv.model.Model.other_seconds`)."""

from __future__ import annotations

import time

#: A sustained share of a core under this scales the timed figures
#: (:meth:`hetconv.model.Model.other_seconds`).
SHARE_FLOOR = 0.9


def cpu_share(seconds: float = 0.1) -> float:
    """The share of a core this thread gets over ``seconds`` of a busy loop: its CPU time over
    the wall time (at most 1). Under a CPU quota, the quota's share once the loop spans a few of
    its periods (10-100 ms); on a busy machine, what the others leave."""
    wall, cpu = time.perf_counter(), time.thread_time()
    while time.perf_counter() - wall < seconds:
        pass
    return min(1.0, (time.thread_time() - cpu) / max(time.perf_counter() - wall, 1e-9))


__all__ = ["SHARE_FLOOR", "cpu_share"]
