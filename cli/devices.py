"""``hetconv devices``: the devices this machine can compute on, each probed."""

from __future__ import annotations

import argparse

from .common import HelpFormatter


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "devices",
        help="list the devices this machine can compute on",
        description=(
            "List every backend (cpu, opencl, cuda, onednn), whether it can run here and why not, "
            "its devices with the numbers `hetconv worker --backend B --device N` takes, "
            "and a probe figure for each (the paper-50-500 C2 convolution at batch 8, "
            "forward + backward, best of 2, with this process's threads): the probe `hetconv "
            "worker` prints at start, and the GFLOPS `hetconv plan --master` and `--worker` "
            "take. Run it on an otherwise idle machine: other work lowers the figure."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--no-probe", action="store_true", help="list only, do not time")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hetconv.backends import (
        AUTO_PROBE,
        KNOWN_BACKENDS,
        BackendUnavailable,
        backend_class,
        get_backend,
    )

    flops = 3 * AUTO_PROBE.flops_forward
    if not args.no_probe:
        print(_probe_note())
    for name in KNOWN_BACKENDS:
        try:
            cls = backend_class(name)
        except BackendUnavailable as e:
            print(f"{name}: not available: {e}")
            continue
        devices = cls.devices()
        print(f"{name}: {len(devices)} device{'s' if len(devices) != 1 else ''}")
        for number, info in enumerate(devices):
            line = (
                f"  {number}: {info.name} ({info.kind}, {info.cores} cores, "
                f"{info.memory_bytes / 2**30:.1f} GiB)"
            )
            if not args.no_probe:
                try:
                    backend = get_backend(name) if name == "cpu" else get_backend(name, number)
                    seconds = backend.time_step(AUTO_PROBE, repeats=2)
                    line += f"  probe {1e3 * seconds:.1f} ms ({flops / seconds / 1e9:.1f} GFLOPS)"
                except Exception as e:  # a device that cannot run the probe is still listed
                    line += f"  probe failed: {e}"
            print(line, flush=True)
    return 0


def _probe_note() -> str:
    """What the probe figures are, and a warning when the machine is busy (they read low)."""
    import os

    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    busy = (
        f"; this machine is busy now (load {load:.1f} on {cores} cores), so they read low: "
        "run it again when idle"
        if load >= 0.5 * cores
        else ""
    )
    return (
        "probe: forward + backward of paper-50-500's C2 at batch 8, best of 2, with this "
        "process's threads; its GFLOPS is what `hetconv plan --master/--worker` takes and what "
        f"`hetconv worker` prints at start{busy}"
    )
