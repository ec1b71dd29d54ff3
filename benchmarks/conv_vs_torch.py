"""Our cpu engine against PyTorch's, layer by layer and step by step, in one process.

For each network, batch and thread count: every distinct layer at its real shape (from the
network's spec, :func:`hetconv.spec.walk_spec`) -- a convolution as three rows (forward, input
gradient, kernel and bias gradient), every other layer as forward + backward -- ours (the
model's own layer objects, the cpu backend) against torch's faster formulation of the same
layer (the data-parallel peer's twin, ``benchmarks/ddp_rank.py``: LRN as shifted slice-adds),
interleaved so both see the same machine load, median (or ``--statistic min``) of
``--repeats``. Then one whole
training step (forward, backward, SGD with momentum and weight decay: ``hetconv train
--local``'s model against the torch twin), layer "step". Each row carries the network, layer,
kind, batch, threads, cap, the CPU's name, the BLAS kernel (threadpoolctl's architecture),
the engine (``--engine``: the ``cpu`` backend, im2col + BLAS, or ``onednn``, oneDNN's
convolutions), ours_s, torch_s and ratio = ours_s / torch_s (< 1: ours is faster). With more
than one engine a last table puts each row's ratios side by side.

    python benchmarks/conv_vs_torch.py [--network N ...] [--batch B ...] [--threads T ...]
        [--cap none|FRACTION ...] [--repeats R] [--statistic median|min] [--kinds K ...]
        [--engine cpu|onednn ...] [--quick] [--json PATH]

Layers repeated at the same shape (a ResNet's blocks) are timed once. ``--cap 0.6`` runs the
measurements again in a child process capped at 0.6 of a core by a cgroup v1 ``cpu`` group, as
the testbed caps its processes (``hetconv.simulations.cpucap``: root, the controller mounted
if missing); its rows carry cap 0.6, the uncapped ones "none".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
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
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - benchmark needs the reference
    sys.exit("this benchmark compares against PyTorch: pip install -e '.[dev]'")
from threadpoolctl import threadpool_info, threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_rank import torch_model  # noqa: E402 - benchmarks/ddp_rank.py: the torch twin

from hetconv.backends import BackendUnavailable, CpuBackend, get_backend  # noqa: E402
from hetconv.conv import LocalConv  # noqa: E402
from hetconv.layers import softmax_cross_entropy  # noqa: E402
from hetconv.model import PRESETS, Model, load_spec, walk_spec  # noqa: E402
from hetconv.optim import SGD, SGDConfig  # noqa: E402

NETWORKS = ["paper-500-1500", "resnet20", "vgg11"]
KINDS = {
    "relu": "relu", "lrn": "lrn", "maxpool": "maxpool", "avgpool": "avgpool",
    "batchnorm": "batchnorm fwd+bwd", "fc": "fc", "add": "add", "gap": "gap",
    "concat": "concat", "dropout": "dropout",
}  # fmt: skip
CONV_KINDS = ("conv forward", "conv input gradient", "conv kernel gradient")
ENGINES = ["cpu", "onednn"]


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_kernel() -> str:
    """The BLAS libraries' kernels, as threadpoolctl reports them (``openblas Haswell``)."""
    found = {
        f"{i['internal_api']} {i.get('architecture') or '?'}"
        for i in threadpool_info()
        if i["user_api"] == "blas"
    }
    return "; ".join(sorted(found)) or "none"


#: How the repeats' times are summarised (``--statistic``): the minimum is the least disturbed
#: by other processes on a shared machine.
STATISTIC = {"median": statistics.median, "min": min}
statistic = statistics.median


#: Torch's thread count for :func:`interleaved` (the one item), set by :func:`torch_threads`.
TORCH_THREADS = [1]


def torch_threads(threads: int) -> None:
    """Torch runs on ``threads`` threads, set again before each of its timed runs."""
    TORCH_THREADS[0] = threads
    torch.set_num_threads(threads)


def interleaved(ours, theirs, repeats: int) -> tuple[float, float]:
    """Seconds (:data:`statistic` of the runs) of ``ours()`` and ``theirs()``, alternated
    after one warm-up each. Torch's thread count is set again before each of its runs: the
    onednn engine sets the calling thread's OpenMP threads to 1 for its primitives, and where
    torch shares that OpenMP runtime its next call then ran on one thread while
    ``torch.get_num_threads()`` said 1 (vgg11's 64 -> 128 kernel gradient, batch 64: 24.2 ms
    against 12.5): :func:`torch_threads` sets the count."""
    threads = TORCH_THREADS[0]
    ours()
    torch.set_num_threads(threads)
    theirs()
    times_ours, times_theirs = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        ours()
        times_ours.append(time.perf_counter() - start)
        torch.set_num_threads(threads)
        start = time.perf_counter()
        theirs()
        times_theirs.append(time.perf_counter() - start)
    return statistic(times_ours), statistic(times_theirs)


def _normal(rng, shape) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32)


def conv_pairs(layer, module, x: np.ndarray, dy: np.ndarray, backend):
    """(kind, ours, theirs) of a convolution's forward, input and kernel gradient."""
    # as the engine runs it: a strided layer as its phases (stride 1), but a 3x3 one strided
    # on a backend that takes strides (Conv2d.runs_strided)
    xe, we, padding = layer.executed(x)
    xs, ws, ps, stride = xe, we, padding, (1, 1)
    if backend.native_stride and layer.runs_strided(x):
        xs, ws, ps, stride = x, layer.params["weight"], layer.padding, layer.stride
    b = layer.bias
    ye = backend.conv_forward(xs, ws, b, ps, stride)
    dye = np.ascontiguousarray(dy.reshape(ye.shape)) if dy.shape == ye.shape else ye.copy()
    xt, wt = torch.from_numpy(x), module.weight.detach()
    bt = None if module.bias is None else module.bias.detach()
    padded = xt if module.symmetric else F.pad(xt, module.padding)
    pad = module.padding if module.symmetric else (0, 0)
    dyt = torch.from_numpy(dy)
    conv_backward = torch.ops.aten.convolution_backward

    def theirs_backward(mask):
        return lambda: conv_backward(
            dyt, padded, wt, None if bt is None else [wt.shape[0]], module.stride, pad,
            (1, 1), False, (0, 0), 1, mask,
        )  # fmt: skip

    pairs = [
        (
            "conv forward",
            lambda: backend.conv_forward(xs, ws, b, ps, stride),
            lambda: F.conv2d(padded, wt, bt, module.stride, pad),
        )
    ]
    if layer.need_input_grad:
        pairs.append(
            (
                "conv input gradient",
                lambda: backend.conv_grad_input(dye, ws, xs.shape[2:], ps, stride),
                theirs_backward([True, False, False]),
            )
        )
    pairs.append(
        (
            "conv kernel gradient",
            lambda: backend.conv_grad_kernels(xs, dye, ws.shape[2:], ps, stride),
            theirs_backward([False, True, bt is not None]),
        )
    )
    return pairs


def layer_pair(layer, module, xs: list[np.ndarray], dy: np.ndarray, to_torch=torch.from_numpy):
    """(ours, theirs): forward then backward of a non-convolutional layer (``to_torch``: an
    array of ours as torch's tensor, on torch's device)."""
    xts = [to_torch(x).requires_grad_() for x in xs]
    dyt = to_torch(dy)

    def ours():
        layer.forward(*xs)
        layer.backward(dy)

    def theirs():
        for xt in xts:
            xt.grad = None
        y = module(*xts)
        y.backward(dyt.reshape(y.shape))

    return ours, theirs


def layer_rows(network: str, batch: int, repeats: int, kinds, backend):
    """Yields (layer name, kind, ours_s, torch_s) for each distinct layer of the network."""
    spec = load_spec(network)
    model = Model(spec, seed=0)
    twin = torch_model(spec)
    rng = np.random.default_rng(0)
    seen = set()
    for item, layer in zip(walk_spec(spec), model.layers, strict=True):
        module = getattr(twin, item.name)
        key = (item.kind, item.input_shapes, item.output_shape, repr(sorted(item.options.items())))
        if key in seen:
            continue
        seen.add(key)
        xs = [_normal(rng, (batch, *shape)) for shape in item.input_shapes]
        dy = _normal(rng, (batch, *item.output_shape))
        if item.kind == "conv":
            for kind, ours, theirs in conv_pairs(layer, module, xs[0], dy, backend):
                if kind in kinds:
                    yield item.name, kind, *interleaved(ours, theirs, repeats)
            continue
        kind = KINDS.get(item.kind, item.kind)
        if kind in kinds:
            layer.training = module.training = True
            yield item.name, kind, *interleaved(*layer_pair(layer, module, xs, dy), repeats)


def bench_step(network: str, batch: int, repeats: int, backend) -> tuple[float, float]:
    """Seconds of one training step of ours (convolutions on ``backend``) and of the torch
    twin, interleaved."""
    return interleaved(*step_pair(network, batch, backend), repeats)


def step_pair(network: str, batch: int, backend=None):
    """(ours, theirs): one training step of the model (convolutions on ``backend``; None:
    the cpu backend) and of its torch twin."""
    spec = load_spec(network)
    model = Model(spec, seed=0, executor=LocalConv(backend) if backend else None)
    optimizer = SGD(model.parameters(), SGDConfig())
    net = torch_model(spec)
    net.load_state_dict(
        {k: torch.from_numpy(v.copy()) for k, v in model.parameters().items()}, strict=False
    )
    torch_optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    rng = np.random.default_rng(0)
    x = _normal(rng, (batch, 3, 32, 32))
    labels = rng.integers(0, 10, batch)
    xt, lt = torch.from_numpy(x), torch.from_numpy(labels)

    def ours():
        _, grad, _ = softmax_cross_entropy(model.forward(x), labels)
        model.backward(grad)
        optimizer.step(model.gradients())

    def theirs():
        torch_optimizer.zero_grad()
        F.cross_entropy(net(xt), lt).backward()
        torch_optimizer.step()

    return ours, theirs


def timed(network: str, batch: int, args: argparse.Namespace, backend):
    """The network's layer rows, then its step row (as ``--kinds`` selects)."""
    yield from layer_rows(network, batch, args.repeats, set(args.kinds), backend)
    if "step" in args.kinds:
        yield "step", "step", *bench_step(network, batch, args.repeats, backend)


def cap_value(text: str) -> str:
    """A ``--cap`` value: "none", or a fraction of a core in (0, 64], as a string."""
    if text == "none":
        return text
    try:
        fraction = float(text)
    except ValueError:
        fraction = 0.0
    if not 0 < fraction <= 64:
        raise argparse.ArgumentTypeError(f"'none' or a fraction of a core in (0, 64], got {text!r}")
    return f"{fraction:g}"


#: --quick's choices, where the option itself is not given.
QUICK = {"network": ["resnet20", "paper-500-1500"], "batch": [16], "threads": [1, 2],
         "repeats": 3}  # fmt: skip
DEFAULTS = {"network": NETWORKS, "batch": [16, 64], "threads": [1, 2], "repeats": 5}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--network", nargs="+", choices=list(PRESETS),
                   help=f"presets (default: {' '.join(NETWORKS)})")  # fmt: skip
    p.add_argument("--batch", nargs="+", type=int, help="default: 16 64")
    p.add_argument("--threads", nargs="+", type=int, help="default: 1 2")
    p.add_argument("--cap", nargs="+", type=cap_value, default=["none"], metavar="CAP",
                   help="'none' (uncapped, in this process) or a fraction of a core: a child "
                   "process in a cgroup v1 cpu group with that quota, as the testbed caps its "
                   "processes (needs root); default: none")  # fmt: skip
    p.add_argument("--repeats", type=int, help="timed runs per side (default 5)")
    p.add_argument("--statistic", choices=list(STATISTIC), default="median",
                   help="what of the repeats' times a row reports (default: median; min: the "
                   "least disturbed by other processes)")  # fmt: skip
    p.add_argument("--engine", nargs="+", choices=[*ENGINES, "auto"], default=["auto"],
                   metavar="ENGINE",
                   help="our convolution engines, each its own rows: cpu (the cpu backend, "
                   "im2col + BLAS), onednn (the onednn backend, oneDNN's convolutions, "
                   "installed with hetconv on Linux x86-64) or auto (hetconv train's default: "
                   "onednn where its library loads, else cpu); default: auto")  # fmt: skip
    all_kinds = [*CONV_KINDS, *KINDS.values(), "step"]
    p.add_argument("--kinds", nargs="+", default=all_kinds, choices=all_kinds, metavar="KIND",
                   help="only these row kinds (default: all; 'step': the whole step)")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help="resnet20 and paper-500-1500, batch 16, threads 1 and 2, 3 repeats "
                   "(each where not given)")  # fmt: skip
    p.add_argument("--numpy-layers", action="store_true",
                   help="ReLU and max pooling by numpy everywhere (before they ran on oneDNN "
                   "where its library loads): the before of a before/after")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the rows as a JSON list")
    p.add_argument("--capped-at", help=argparse.SUPPRESS)  # set in the capped child
    p.add_argument("--col2im", action="store_true",
                   help="every input gradient by col2im (the engine before few-channel layers "
                   "ran theirs as a full correlation): the before of a before/after")  # fmt: skip
    return p


def measure(args: argparse.Namespace, cap: str) -> list[dict]:
    """This process's rows (it runs under ``cap``, as a label), printed as they come."""
    cpu, blas = cpu_name(), blas_kernel()
    print(f"CPU: {cpu}; BLAS: {blas}; torch {torch.__version__}; cap: {cap}")
    print(f"{'network':<16}{'layer':<12}{'kind':<22}{'batch':>6}{'thr':>4}{'cap':>6}"
          f"{'engine':>8}{'ours s':>10}{'torch s':>10}{'ratio':>7}")  # fmt: skip
    rows = []
    backends = {engine: engine_backend(engine) for engine in args.engine}
    common = {"cap": cap if cap == "none" else float(cap), "cpu": cpu, "blas": blas}
    for threads in args.threads:
        torch_threads(threads)
        with threadpool_limits(limits=threads, user_api="blas"):
            for network in args.network:
                for batch in args.batch:
                    for engine, backend in backends.items():
                        for layer, kind, ours_s, torch_s in timed(network, batch, args, backend):
                            row = {"network": network, "layer": layer, "kind": kind,
                                   "batch": batch, "threads": threads, **common,
                                   "engine": engine, "ours_s": ours_s, "torch_s": torch_s,
                                   "ratio": ours_s / torch_s}  # fmt: skip
                            rows.append(row)
                            print(f"{network:<16}{layer:<12}{kind:<22}{batch:>6}{threads:>4}"
                                  f"{cap:>6}{engine:>8}{ours_s:>10.5f}{torch_s:>10.5f}"
                                  f"{row['ratio']:>7.2f}", flush=True)  # fmt: skip
    return rows


def engine_backend(engine: str):
    """The backend of ``--engine`` ``engine``; exits saying why when it cannot run here."""
    if engine == "cpu":
        return CpuBackend()
    try:
        return get_backend(engine)
    except BackendUnavailable as e:
        sys.exit(f"--engine {engine}: {e}")


def side_by_side(rows: list[dict], engines: list[str]) -> None:
    """Each row's ratio (ours / torch) for every engine, one line per layer and kind."""
    table: dict[tuple, dict[str, float]] = {}
    for r in rows:
        key = (r["network"], r["layer"], r["kind"], r["batch"], r["threads"], r["cap"])
        table.setdefault(key, {})[r["engine"]] = r["ratio"]
    print("ratio ours/torch by engine:")
    print(f"{'network':<16}{'layer':<12}{'kind':<22}{'batch':>6}{'thr':>4}{'cap':>6}"
          + "".join(f"{e:>9}" for e in engines))  # fmt: skip
    for (network, layer, kind, batch, threads, cap), ratios in table.items():
        print(f"{network:<16}{layer:<12}{kind:<22}{batch:>6}{threads:>4}{cap!s:>6}"
              + "".join(f"{ratios.get(e, float('nan')):>9.2f}" for e in engines))  # fmt: skip


def capped(args: argparse.Namespace, cap: str) -> list[dict]:
    """The rows of this script run again in a child process capped at ``cap`` of a core by a
    cgroup v1 ``cpu`` group (the testbed's :class:`~hetconv.simulations.cpucap.CpuCap`)."""
    from hetconv.simulations.cpucap import CpuCap, ensure_cpu_controller

    try:
        ensure_cpu_controller()
        group = CpuCap(f"conv_vs_torch_{os.getpid()}_{cap}", float(cap))
        group.create()
    except (OSError, RuntimeError) as e:
        sys.exit(f"--cap {cap}: cannot make a cgroup cpu group (root and the cgroup v1 cpu "
                 f"controller are needed): {e}")  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        command = [sys.executable, __file__, "--network", *args.network,
                   "--batch", *map(str, args.batch), "--threads", *map(str, args.threads),
                   "--repeats", str(args.repeats), "--kinds", *args.kinds,
                   "--statistic", args.statistic, "--engine", *args.engine,
                   "--capped-at", cap, "--json", str(out)]  # fmt: skip
        try:
            flags = ["--col2im"] * args.col2im + ["--numpy-layers"] * args.numpy_layers
            done = subprocess.run(group.prefix() + command + flags)
        finally:
            group.remove()
        if done.returncode != 0:
            sys.exit(f"the run capped at {cap} failed ({done.returncode})")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK[name] if args.quick else default)
    for name in ("batch", "threads"):
        if min(getattr(args, name)) < 1:
            sys.exit(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.repeats < 1:
        sys.exit(f"--repeats must be >= 1, got {args.repeats}")
    from hetconv.backends import resolve_engine  # auto named here: the rows say what ran

    args.engine = list(dict.fromkeys(resolve_engine(e)[0] for e in args.engine))
    if args.col2im:
        CpuBackend._grad_input = CpuBackend._grad_input_col2im
    if args.numpy_layers:
        from hetconv.backends import onednn_layers

        onednn_layers.set_enabled(False)
    global statistic
    statistic = STATISTIC[args.statistic]
    if args.capped_at:  # the child of capped(): measure, write the rows, no summary
        rows = measure(args, args.capped_at)
        Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")
        return 0
    rows = []
    for cap in dict.fromkeys(args.cap):
        rows += measure(args, cap) if cap == "none" else capped(args, cap)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    if len(args.engine) > 1:
        side_by_side(rows, args.engine)
    worst = sorted(rows, key=lambda r: -r["ratio"])[:8]
    print("worst:", "; ".join(f"{r['network']} {r['layer']} {r['kind']} b{r['batch']} "
                              f"t{r['threads']} cap {r['cap']} {r['engine']} {r['ratio']:.2f}"
                              for r in worst))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
