"""How far an honest worker's gradient is from the master's recomputation of it, when the two
compute on different engines: the margin a spot check of a split by images needs.

A spot check of the ring (``hetconv train --split images --exchange ring``) compares a drawn
worker's sketches of its own gradient with the master's recomputation of the worker's range,
within 1 % of their scale (``IMAGES_RTOL``); a worker beyond it is lost as a liar. On an H200,
one honest cuda worker of resnet20 at batch 64 was lost so at its first drawn step (1.74 % of
the scale). This script measures the gap directly: the same model, weights and batch, the
whole batch's gradient on ``--engine`` (cuda: the model placed on the GPU, as a cuda worker
runs its range; cpu: numpy's backend on the host) and on the master's engine (onednn where it
loads, else cpu), for ``--steps`` steps of plain SGD on the master's gradient. A row: network,
batch, step, engines, grad_rel (the 2-norm of the difference over the master's), sketch_rel
(as the check measures it: the 2-norm of the sketches' difference over their scale), loss_rel.

    python benchmarks/gpu_gradients.py --network resnet20 paper-500-1500 --batch 64
    python benchmarks/gpu_gradients.py --engine cpu --network resnet20 --batch 16   # no GPU
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from hetconv.argtypes import positive
from hetconv.backends import get_backend
from hetconv.conv import LocalConv
from hetconv.devicelocal import DeviceLocalConv
from hetconv.imagesplit import images_gradients
from hetconv.model import PRESETS, Model, load_spec
from hetconv.ring import flat
from hetconv.ringcheck import sketch_answer, sketch_comparison

LR = np.float32(0.05)


def _master_engine() -> str:
    try:
        get_backend("onednn")
        return "onednn"
    except Exception:  # noqa: BLE001 - any reason it does not load: the numpy engine
        return "cpu"


def _gradients(model, x, labels, step: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    grads, losses, _ = images_gradients(model, x, labels, 0, len(x), step)
    names = list(model.parameters())
    return flat([grads[n] for n in names]), losses, names


def _device_gradients(executor, model, x, labels, step: int):
    """The whole batch's gradient on the device twin of ``model``, as a cuda worker computes
    its range (:class:`DeviceLocalConv`'s twin, its parameters uploaded)."""
    twin, backend = executor._twin_of(model), executor.backend
    with backend.scope():
        for target, value in zip(twin.parameters().values(), model.parameters().values(),
                                 strict=True):  # fmt: skip
            target[...] = backend.to_device(value)
        for target, value in zip(twin.buffers().values(), model.buffers().values(), strict=True):
            target[...] = backend.to_device(value)
        grads, losses, _ = images_gradients(
            twin, backend.to_device(x), backend.to_device(labels), 0, len(x), step, copy=False
        )
        names = list(model.parameters())
        vector = backend.to_host(backend.xp.concatenate([grads[n].ravel() for n in names]))
        return np.asarray(vector, np.float32), np.asarray(backend.to_host(losses))


def rows(network: str, batch: int, steps: int, engine: str, seed: int = 0) -> list[dict]:
    master = _master_engine()
    spec = load_spec(network)
    model = Model(spec, seed=seed, executor=LocalConv(master))
    other = Model(spec, seed=seed, executor=LocalConv(engine)) if engine != "cuda" else None
    device = DeviceLocalConv("cuda") if engine == "cuda" else None
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        # 8-bit pixels, normalised, as a dataset's images are
        x = (rng.integers(0, 256, (batch, *model.input_shape)) / 255.0 - 0.5).astype(np.float32)
        labels = rng.integers(0, 10, batch)
        before = {k: np.array(v) for k, v in model.buffers().items()}
        want, want_losses, names = _gradients(model, x, labels, step)
        if device is not None:
            got, got_losses = _device_gradients(device, model, x, labels, step)
        else:
            other.load_state({**model.parameters(), **before})
            got, got_losses, _ = _gradients(other, x, labels, step)
        answer = sketch_answer(got, got)
        sketched, mine, scale = sketch_comparison(answer, want)
        row = {
            "network": network, "batch": batch, "step": step, "engine": engine,
            "master_engine": master,
            "grad_rel": float(np.linalg.norm(got - want) / np.linalg.norm(want)),
            "sketch_rel": float(np.linalg.norm(sketched - mine) / scale),
            "loss_rel": float(np.max(np.abs(got_losses - want_losses)) / np.abs(want_losses).max()),
        }  # fmt: skip
        print(
            f"{network:<15} {batch:>5} {step:>4} {engine:>6}/{master:<6} {row['grad_rel']:10.2e} "
            f"{row['sketch_rel']:10.2e} {row['loss_rel']:10.2e}",
            flush=True,
        )
        out.append(row)
        offset = 0
        for value in model.parameters().values():  # plain SGD on the master's gradient
            value -= LR * want[offset : offset + value.size].reshape(value.shape)
            offset += value.size
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--network", nargs="+", default=["resnet20", "paper-500-1500"],
                   choices=sorted(PRESETS))  # fmt: skip
    p.add_argument("--batch", type=positive(int), default=64)
    p.add_argument("--steps", type=positive(int), default=6)
    p.add_argument(
        "--engine",
        choices=["cuda", "cpu", "onednn"],
        default="cuda",
        help="the worker's engine (cuda: the GPU; cpu: numpy's, on the host)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = p.parse_args(argv)
    if args.engine == "cuda":
        from hetconv.backends.cuda import CudaBackend

        usable, why = CudaBackend.is_available()
        if not usable:
            print(f"no usable CUDA GPU here: {why}", file=sys.stderr)
            return 2
    print(f"{'network':<15} {'batch':>5} {'step':>4} {'engines':>13} {'grad_rel':>10} "
          f"{'sketch_rel':>10} {'loss_rel':>10}")  # fmt: skip
    out = [r for n in args.network for r in rows(n, args.batch, args.steps, args.engine)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
