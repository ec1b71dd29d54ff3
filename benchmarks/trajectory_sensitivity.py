"""How far float32 round-off alone moves a training run: the same local training twice, the
second from initial weights perturbed by ``--perturbation`` (relative, Gaussian), side by side.

A kernel split reorders sums (each node's GEMM has other sizes), which moves values by about
float32's round-off; where this benchmark shows two local runs drifting apart by as much as the
cluster's run drifts from local training, the drift is the network's sensitivity, not the
split. (resnet20 at batch 4: the two runs end 20 steps apart by up to 0.7 in a weight; the
tests therefore compare the cluster step by step on its own weights:
``tests/test_residual_cluster.py``.)

    python benchmarks/trajectory_sensitivity.py [--model resnet20] [--batch 4 8] [--steps 20]
                                                [--perturbation 1e-7] [--json PATH]
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from pathlib import Path

import numpy as np

from hetconv.conv import LocalConv
from hetconv.model import Model, load_spec
from hetconv.training import TrainConfig, train


def _run(model: str, batch: int, steps: int, init: Path, out: Path) -> tuple[np.ndarray, dict]:
    config = TrainConfig(
        preset=model, steps=steps, batch=batch, train_size=max(64, batch * 4), eval_size=0,
        progress=False, load=str(init), save=str(out),
    )  # fmt: skip
    result = train(config, LocalConv(), log=io.StringIO())
    return np.asarray(result.losses), dict(np.load(out))


def measure(model: str, batch: int, steps: int, perturbation: float, seed: int = 1) -> dict:
    """Two local runs of ``steps`` steps from the seed-0 weights and from them perturbed."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        net = Model(load_spec(model), seed=0)
        net.save(tmp / "init.npz")
        rng = np.random.default_rng(seed)
        for value in net.parameters().values():
            value *= (1 + perturbation * rng.standard_normal(value.shape)).astype(np.float32)
        net.save(tmp / "perturbed.npz")
        a = _run(model, batch, steps, tmp / "init.npz", tmp / "a.npz")
        b = _run(model, batch, steps, tmp / "perturbed.npz", tmp / "b.npz")
    loss = np.abs(a[0] - b[0]) / np.abs(a[0])
    above = np.flatnonzero(loss > 1e-5)
    return {
        "model": model,
        "batch": batch,
        "steps": steps,
        "perturbation": perturbation,
        "loss_rel_max": float(loss.max()),
        "first_step_over_1e-5": int(above[0]) if above.size else None,
        "weight_abs_max": max(float(np.abs(a[1][k] - b[1][k]).max()) for k in a[1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet20", help="a preset or .json spec")
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--perturbation", type=float, default=1e-7)
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = parser.parse_args()
    rows = []
    print(f"{'model':<12} {'batch':>5} {'steps':>5} {'loss rel max':>13} {'from step':>9} "
          f"{'weight max':>11}")  # fmt: skip
    for batch in args.batch:
        row = measure(args.model, batch, args.steps, args.perturbation)
        rows.append(row)
        print(
            f"{row['model']:<12} {batch:>5} {row['steps']:>5} {row['loss_rel_max']:>13.2e} "
            f"{str(row['first_step_over_1e-5']):>9} {row['weight_abs_max']:>11.3g}",
            flush=True,
        )
    print(f"two local runs, the second from weights perturbed by {args.perturbation:g} relative")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
