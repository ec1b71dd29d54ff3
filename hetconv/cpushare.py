"""The share of a core this process gets, sustained: under a CPU quota (a cgroup's, a
container's ``--cpus``) or on a busy machine, a short call may run at the whole core's speed
while a training step runs as the share allows, so timings of short calls are scaled by it:
the master's other work by :func:`cpu_share` (a busy loop's, :meth:`hetconv.model.Model.
other_seconds`), a convolution's probe by :func:`quota_share` (the quota itself, read from the
process's cgroup: :meth:`hetconv.backends.Backend.time_step`)."""

from __future__ import annotations

import functools
import time
from pathlib import Path

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


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v1_share(group: Path, mount: Path) -> float | None:
    """The least share a cgroup v1 ``cpu`` group and those above it (to ``mount``) allow."""
    shares = []
    while True:
        quota, period = _read(group / "cpu.cfs_quota_us"), _read(group / "cpu.cfs_period_us")
        if quota and period and int(quota) > 0 and int(period) > 0:
            shares.append(int(quota) / int(period))
        if group == mount or mount not in group.parents:
            break
        group = group.parent
    return min(shares, default=None)


def _v2_share(group: Path, root: Path) -> float | None:
    """The least share a cgroup v2 group and those above it (to ``root``) allow (``cpu.max``)."""
    shares = []
    while True:
        limit = (_read(group / "cpu.max") or "max").split()
        if len(limit) == 2 and limit[0] != "max" and int(limit[1]) > 0:
            shares.append(int(limit[0]) / int(limit[1]))
        if group == root or root not in group.parents:
            break
        group = group.parent
    return min(shares, default=None)


def quota_share(proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")):
    """The share of a core this process's CPU quota allows, sustained: the least of its cgroup's
    and those above it (v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``, v2 ``cpu.max``);
    None where none caps it under one core (no quota, or no cgroup files to read)."""
    shares = []
    for line in (_read(proc) or "").splitlines():
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if not controllers:  # v2, at the root or under "unified" beside v1's
            for base in (root, root / "unified"):
                if (base / "cgroup.controllers").exists():
                    shares.append(_v2_share(base / relative, base))
        elif "cpu" in controllers.split(","):
            for mount in (root / "cpu", root / "cpu,cpuacct", root / controllers):
                if (mount / "cpu.cfs_period_us").exists():
                    shares.append(_v1_share(mount / relative, mount))
                    break
    least = min((s for s in shares if s is not None), default=None)
    return least if least is not None and least < 1.0 else None


@functools.cache
def process_quota_share() -> float | None:
    """:func:`quota_share`, read once per process (a quota is set before a process starts)."""
    return quota_share()


__all__ = ["SHARE_FLOOR", "cpu_share", "process_quota_share", "quota_share"]
