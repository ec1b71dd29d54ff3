"""CPU caps: a cgroup v1 ``cpu`` group per node of a
:class:`~hetconv.simulations.clustertestbed.ClusterTestbed`, capping its processes at a fraction
of one core, and the CPU time a process has used."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hetconv.simulations.netns import _run

#: Where the cgroup v1 ``cpu`` controller is (mounted there when missing, see
#: :func:`ensure_cpu_controller`).
CPU_CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
#: The CFS period of every cap: the quota is a fraction of it. Short, so that a capped process
#: runs in slices of a few milliseconds, as a slower core would, not in lumps of tens of
#: milliseconds with pauses in between that would delay every answer it must read or send.
DEFAULT_CFS_PERIOD_US = 10_000
#: The period caps are made with (the testbed's ``--cfs-period-ms`` sets it).
CFS_PERIOD_US = DEFAULT_CFS_PERIOD_US


def add_period_flag(p: argparse.ArgumentParser) -> None:
    """``--cfs-period-ms`` (the testbed's benchmarks): the CFS period of every cap."""
    from hetconv.argtypes import positive

    p.add_argument(
        "--cfs-period-ms", type=positive(float), default=DEFAULT_CFS_PERIOD_US / 1000,
        help="the CFS period of every CPU cap, ms: a capped process runs its quota (the cap "
        f"times this) in each period and waits out the rest (default "
        f"{DEFAULT_CFS_PERIOD_US / 1000:g}; the kernel's least quota is 1 ms, so a cap of 0.36 "
        "needs at least 2.8). A shorter one is nearer a slower core that runs without pauses",
    )  # fmt: skip


def apply_period(args) -> None:
    """Every cap made from now on has ``--cfs-period-ms``'s period."""
    global CFS_PERIOD_US
    CFS_PERIOD_US = round(args.cfs_period_ms * 1000)


def ensure_cpu_controller(root: Path = CPU_CGROUP_ROOT) -> str | None:
    """Make sure the cgroup v1 ``cpu`` controller is mounted at ``root``: mounts it there when
    it is not (``mount -t cgroup -o cpu cpu ROOT``). Returns a line saying it was mounted, or
    None when it already was.

    Raises:
        RuntimeError: it is missing and cannot be mounted (no v1 controller in this kernel, or
            it is bound to a v2 hierarchy); the message says why.
    """
    if (root / "cpu.cfs_quota_us").exists():
        return None
    root.mkdir(parents=True, exist_ok=True)
    done = _run("mount", "-t", "cgroup", "-o", "cpu", "cpu", str(root), check=False)
    if done.returncode != 0 or not (root / "cpu.cfs_quota_us").exists():
        raise RuntimeError(
            f"no cgroup v1 cpu controller at {root}, and `mount -t cgroup -o cpu cpu {root}` "
            f"failed: {(done.stderr or done.stdout).strip() or 'no cpu.cfs_quota_us after it'}"
        )
    return f"mounted the cgroup v1 cpu controller at {root}"


class CpuCap:
    """A cgroup v1 ``cpu`` group that caps the processes in it, together, at ``fraction`` of one
    core (CFS bandwidth: ``cpu.cfs_quota_us`` = fraction x ``cpu.cfs_period_us``).

    A cap is a ceiling, not a reservation: on a machine that others load too, a capped process
    can get less.
    """

    def __init__(self, name: str, fraction: float, root: Path = CPU_CGROUP_ROOT):
        if not 0 < fraction <= 64:
            raise ValueError(f"CPU cap must be a positive fraction of a core, got {fraction}")
        if fraction * CFS_PERIOD_US < 1000:
            raise ValueError(
                f"CPU cap {fraction:g} is below the kernel's least quota, 1 ms of every "
                f"{CFS_PERIOD_US / 1000:g} ms period: at least {1000 / CFS_PERIOD_US:g}"
            )
        self.name, self.fraction, self.path = name, fraction, root / name
        self.created = False

    def create(self) -> None:
        self.path.mkdir()
        self.created = True
        (self.path / "cpu.cfs_period_us").write_text(f"{CFS_PERIOD_US}\n")
        quota = round(self.fraction * CFS_PERIOD_US)
        (self.path / "cpu.cfs_quota_us").write_text(f"{quota}\n")

    def prefix(self) -> list[str]:
        """A command prefix that moves the process into this group, then execs the command
        (so it is capped from its first instruction, and so is everything it starts)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs")]

    def quota(self) -> tuple[int, int]:
        """(quota, period) in microseconds, as the kernel holds them."""
        quota, period = (
            int((self.path / name).read_text().split()[0])
            for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        )
        return quota, period

    def stat(self) -> dict[str, int]:
        """The group's ``cpu.stat``: ``nr_periods``, ``nr_throttled``, ``throttled_time`` (ns)."""
        text = (self.path / "cpu.stat").read_text()
        return {key: int(value) for key, value in (line.split() for line in text.splitlines())}

    def remove(self) -> None:
        """Delete the group; a process still in it goes back to the root group first."""
        if not self.created:
            return
        procs = self.path / "cgroup.procs"
        try:
            for pid in procs.read_text().split():
                try:
                    (self.path.parent / "cgroup.procs").write_text(f"{pid}\n")
                except OSError:
                    pass  # (it exited meanwhile)
            self.path.rmdir()
        except OSError:
            pass
        self.created = self.path.exists()


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
