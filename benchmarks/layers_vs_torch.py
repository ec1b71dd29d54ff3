"""Our non-convolutional layers against PyTorch's, and as they were at a git revision alongside.

For each network, batch and thread count: every distinct batch norm, ReLU, residual add, max
and average pool, global average pool and fc layer at its real shape (from the network's
spec), forward + backward, ours (the model's own layer objects) against torch's (the
data-parallel peer's twin, ``benchmarks/ddp_rank.py``), then one whole training step (layer
"step": forward, backward, SGD with momentum and weight decay). With ``--before REV`` the
same layers run a third time with the methods of those layer classes as they were at git
revision ``REV`` (``hetconv/batchnorm.py``, ``hetconv/layers.py``, ``hetconv/graph.py`` read
with ``git show``; everything else today's): a before/after measured side by side, in one
process, under the same machine load. The runs are interleaved and each side's time is the
*minimum* over ``--repeats`` (a shared machine's noise only ever adds).

Each row carries the fields of ``benchmarks/conv_vs_torch.py``'s rows: network, layer, kind,
batch, threads, cap ("none": this script runs uncapped), cpu, blas, ours_s, torch_s, ratio =
ours_s / torch_s; with ``--before``, also before_s and before_ratio = before_s / torch_s.

    python benchmarks/layers_vs_torch.py [--network N ...] [--batch B ...] [--threads T ...]
        [--repeats R] [--kinds K ...] [--before REV] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Torch and the onednn engine share one OpenMP runtime here: its threads, spinning for
# milliseconds after each of torch's parallel calls, took the next core from our parts at two
# threads (resnet20's 3x3 32-kernel forward, batch 64: 3.17 ms against 1.73 with it passive).
# Read once, as the runtime loads (with torch): set before.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    import torch
except ImportError:  # pragma: no cover - benchmark needs the reference
    sys.exit("this benchmark compares against PyTorch: pip install -e '.[dev]'")
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conv_vs_torch import (  # noqa: E402
    TORCH_THREADS,
    blas_kernel,
    cpu_name,
    layer_pair,
    step_pair,
    torch_threads,
)
from ddp_rank import torch_model  # noqa: E402 - the torch twin

from hetconv import batchnorm, graph, layers  # noqa: E402
from hetconv.model import PRESETS, Model, load_spec, walk_spec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
#: Spec layer type -> row kind, for the layers this script times.
KINDS = {
    "batchnorm": "batchnorm", "relu": "relu", "add": "add", "maxpool": "maxpool",
    "avgpool": "avgpool", "gap": "gap", "fc": "fc",
}  # fmt: skip
#: (module, class name) whose methods ``--before`` swaps for the revision's.
SWAPPED = [
    (batchnorm, "BatchNorm2d"), (layers, "ReLU"), (layers, "Pool2d"),
    (layers, "GlobalAvgPool2d"), (layers, "Linear"), (graph, "Add"),
]  # fmt: skip


def module_at(revision: str, module) -> object:
    """``module``'s source at git ``revision``, loaded as a sibling module of the package (its
    relative imports get today's modules)."""
    relative = Path(module.__file__).resolve().relative_to(ROOT)
    try:
        source = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{revision}:{relative.as_posix()}"],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
    except subprocess.CalledProcessError as e:
        sys.exit(f"--before {revision}: git show {relative} failed: {e.stderr.strip()}")
    name = f"hetconv._before_{module.__name__.rsplit('.', 1)[1]}"
    loaded = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    loaded.__package__ = "hetconv"
    sys.modules[name] = loaded  # dataclasses look their module up while it loads
    exec(compile(source, f"{revision}:{relative}", "exec"), loaded.__dict__)  # noqa: S102
    return loaded


class Before:
    """A context in which the :data:`SWAPPED` classes run their methods of git ``revision``."""

    def __init__(self, revision: str):
        old = {m: module_at(revision, m) for m in dict.fromkeys(m for m, _ in SWAPPED)}
        self.swaps = []
        for module, name in SWAPPED:
            today, then = getattr(module, name), getattr(old[module], name)
            for attr, fn in vars(then).items():
                if callable(fn) and not attr.startswith("__"):
                    self.swaps.append((today, attr, fn, vars(today).get(attr)))

    @contextlib.contextmanager
    def active(self):
        for cls, attr, fn, _ in self.swaps:
            setattr(cls, attr, fn)
        try:
            yield
        finally:
            for cls, attr, _, fn in self.swaps:
                if fn is None:
                    delattr(cls, attr)
                else:
                    setattr(cls, attr, fn)


def fastest(runs: dict, repeats: int) -> dict:
    """Minimum seconds of each of ``runs`` (name -> (callable, context)), run in turn
    ``repeats`` times after one warm-up each."""
    best = dict.fromkeys(runs, float("inf"))
    for attempt in range(repeats + 1):
        for name, (run, context) in runs.items():
            torch_threads(TORCH_THREADS[0])  # (oneDNN's calls set OpenMP's threads to 1)
            with context():
                start = time.perf_counter()
                run()
                seconds = time.perf_counter() - start
            if attempt:
                best[name] = min(best[name], seconds)
    return best


def layer_runs(network: str, batch: int, kinds: set[str]):
    """Yields (layer name, kind, ours, theirs) for each distinct timed layer of the network."""
    spec = load_spec(network)
    model = Model(spec, seed=0)
    twin = torch_model(spec)
    rng = np.random.default_rng(0)
    seen = set()
    for item, layer in zip(walk_spec(spec), model.layers, strict=True):
        kind = KINDS.get(item.kind)
        key = (item.kind, item.input_shapes, item.output_shape, repr(sorted(item.options.items())))
        if kind not in kinds or key in seen:
            continue
        seen.add(key)
        xs = [rng.standard_normal((batch, *s), dtype=np.float32) for s in item.input_shapes]
        dy = rng.standard_normal((batch, *item.output_shape), dtype=np.float32)
        layer.training = True
        module = getattr(twin, item.name)
        module.training = True
        yield item.name, kind, *layer_pair(layer, module, xs, dy)


def rows_of(network: str, batch: int, args: argparse.Namespace, before: Before | None):
    """Yields (layer, kind, {side: seconds}) of the network's layers, then of its step."""
    runs = list(layer_runs(network, batch, set(args.kinds)))
    if "step" in args.kinds:
        runs.append(("step", "step", *step_pair(network, batch)))
    for layer, kind, ours, theirs in runs:
        sides = {"ours": (ours, contextlib.nullcontext), "torch": (theirs, contextlib.nullcontext)}
        if before is not None:
            sides["before"] = (ours, before.active)
        yield layer, kind, fastest(sides, args.repeats)


def timings(seconds: dict) -> dict:
    """A row's timing fields from :func:`fastest`'s seconds by side."""
    out = {"ours_s": seconds["ours"], "torch_s": seconds["torch"]}
    out["ratio"] = seconds["ours"] / seconds["torch"]
    if "before" in seconds:
        out["before_s"] = seconds["before"]
        out["before_ratio"] = seconds["before"] / seconds["torch"]
    return out


def line_of(row: dict) -> str:
    """The printed line of a row."""
    line = f"{row['network']:<12}{row['layer']:<12}{row['kind']:<10}{row['batch']:>6}"
    line += f"{row['threads']:>4}{row['ours_s']:>10.5f}{row['torch_s']:>10.5f}{row['ratio']:>7.2f}"
    if "before_s" in row:
        line += f"{row['before_s']:>10.5f}{row['before_ratio']:>8.2f}"
    return line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--network", nargs="+", default=["resnet20"], choices=list(PRESETS),
                   help="presets (default: resnet20)")  # fmt: skip
    p.add_argument("--batch", nargs="+", type=int, default=[16, 64], help="default: 16 64")
    p.add_argument("--threads", nargs="+", type=int, default=[1], help="default: 1")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per side (minimum; 5)")
    all_kinds = [*KINDS.values(), "step"]
    p.add_argument("--kinds", nargs="+", default=all_kinds, choices=all_kinds, metavar="KIND",
                   help=f"only these row kinds: {' '.join(all_kinds)} (default: all; 'step': "
                   "the whole training step)")  # fmt: skip
    p.add_argument("--before", metavar="REV",
                   help="also time the layers' methods as they were at this git revision "
                   "(before_s, before_ratio)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the rows as a JSON list")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("batch", "threads"):
        if min(getattr(args, name)) < 1:
            sys.exit(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.repeats < 1:
        sys.exit(f"--repeats must be >= 1, got {args.repeats}")
    before = Before(args.before) if args.before else None
    cpu, blas = cpu_name(), blas_kernel()
    print(f"CPU: {cpu}; BLAS: {blas}; torch {torch.__version__}; minimum of {args.repeats}")
    header = f"{'network':<12}{'layer':<12}{'kind':<10}{'batch':>6}{'thr':>4}{'ours s':>10}"
    header += f"{'torch s':>10}{'ratio':>7}"
    print(header + (f"{'before s':>10}{'b.ratio':>8}" if before else ""))
    rows = []
    for threads in args.threads:
        torch_threads(threads)
        with threadpool_limits(limits=threads, user_api="blas"):
            for network in args.network:
                for batch in args.batch:
                    for layer, kind, s in rows_of(network, batch, args, before):
                        row = {"network": network, "layer": layer, "kind": kind}
                        row |= {"batch": batch, "threads": threads, "cap": "none"}
                        rows.append(row | {"cpu": cpu, "blas": blas} | timings(s))
                        print(line_of(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
