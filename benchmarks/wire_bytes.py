"""Bytes on the master's link per training step, from the real wire format, per way of running.

For each reference network, batch size and mode, the bytes every worker call of one step moves
(requests and answers, headers included) are counted with :func:`hetconv.workload.call_bytes`,
which equals what a real run's trace records (``tests/test_simulator.py`` and
``tests/test_wire_formats.py`` check). Kernels are split evenly over the master and the
workers, as equal probes would split them (:func:`hetconv.balance.kernel_shares`); the bytes
hardly depend on the split, as every worker gets the whole input either way.

A *mode* is one entry of :data:`MODES`: a name and a function from (layer, shares) to the
bytes of one step of that layer. The kernel split in each wire format, and fused worker stages
(``fused``: every layer with channel-local layers after it runs them on the workers and moves
pooled maps, :func:`hetconv.workload.stage_call_bytes`), and fused stages with resident kernels
(``fused_resident``: the workers keep their slices and update them, so a call sends the halo
kernels and gets the edge kernels back instead of the slice and its gradients; the syncs that
bound the master's replay log, every 20 steps, are counted amortised:
:func:`hetconv.costmodel.resident_layer_bytes`) are there, and each of the fused modes with a
replicated first block (``..._replica``: every node computes conv1's block from the images, so
conv1 has no calls and conv2's calls carry the images and conv1's kernels out and conv1's
kernel gradient parts back instead of conv2's input and input-gradient parts,
:mod:`hetconv.replica`).

``--halo`` prints, instead, what LRN's channel halo costs a fused stage each way it can be
had, per layer: computed redundantly (what :mod:`hetconv.stages` does: each worker computes
``size - 1`` extra kernels on each side, and gets those kernels and the pooled-gradient halo
over the master's link) or exchanged between neighbouring workers (each worker sends and
receives ``size - 1`` full-size channels forward, the LRN input, and as many backward, the
LRN's ``dy * y / scale``, over worker-to-worker links, one extra round trip per phase in the
middle of the stage).

    python benchmarks/wire_bytes.py [--networks paper-50-500 ...] [--batch 16 64]
                                    [--workers 4] [--halo] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hetconv import costmodel
from hetconv.balance import kernel_shares, offsets
from hetconv.formats import BFLOAT16, FLOAT16, FLOAT32, TensorFormat
from hetconv.workload import PHASES, ConvLayer, call_bytes, network_layers

NETWORKS = ("paper-50-500", "paper-150-800", "paper-300-1000", "paper-500-1500")
#: The mode the others are compared with.
BASELINE = "kernel_split"


@dataclass(frozen=True)
class Mode:
    """One way of running a step: ``layer_bytes(layer, shares, replica)`` is what one layer's
    forward and backward move on the master's link, for ``shares`` kernels per node (master
    first), ``replica`` the replicated block whose output is its input (or None);
    ``replicate``: the first layer's block is replicated (it then moves nothing)."""

    name: str
    description: str
    layer_bytes: Callable[[ConvLayer, Sequence[int], ConvLayer | None], int]
    replicate: bool = False


def _kernel_split(fmt: TensorFormat):
    def layer_bytes(layer: ConvLayer, shares: Sequence[int], replica=None) -> int:
        total, offset = 0, shares[0]
        for share in shares[1:]:
            if share:
                total += sum(call_bytes(layer, p, share, offset, fmt=fmt).total for p in PHASES)
            offset += share
        return total

    return layer_bytes


def _fused(fmt: TensorFormat):
    def layer_bytes(layer: ConvLayer, shares: Sequence[int], replica=None) -> int:
        fused = layer.stage is not None
        return costmodel.layer_bytes(layer, shares, fused, fmt, replica=replica)

    return layer_bytes


def _fused_resident(fmt: TensorFormat, head: bool = False, split: bool = False):
    def layer_bytes(layer: ConvLayer, shares: Sequence[int], replica=None) -> int:
        if layer.stage is None:  # only fused layers keep their kernels
            return costmodel.layer_bytes(layer, shares, False, fmt)
        classes = layer.head if head else 0
        return round(
            costmodel.resident_layer_bytes(
                layer, shares, fmt, replica=replica, head=classes, split=split
            )
        )

    return layer_bytes


MODES: tuple[Mode, ...] = (
    Mode(BASELINE, "kernel split (the paper's), float32 wire", _kernel_split(FLOAT32)),
    Mode(
        "kernel_split_bfloat16",
        "kernel split, activations as bfloat16 (--wire-format bfloat16)",
        _kernel_split(BFLOAT16),
    ),
    Mode(
        "kernel_split_float16",
        "kernel split, activations as float16 (--wire-format float16)",
        _kernel_split(FLOAT16),
    ),
    Mode(
        "fused",
        "fused worker stages (--stages fused): conv + ReLU, LRN (halo), max-pool per worker",
        _fused(FLOAT32),
    ),
    Mode(
        "fused_bfloat16",
        "fused worker stages, activations as bfloat16 (--stages fused --wire-format bfloat16)",
        _fused(BFLOAT16),
    ),
    Mode(
        "fused_resident",
        "fused stages, resident kernels (--stages fused --kernels resident): halo kernels out, "
        "edge kernels back, every slice synced every 20 steps",
        _fused_resident(FLOAT32),
    ),
    Mode(
        "fused_resident_bfloat16",
        "fused stages, resident kernels, activations as bfloat16",
        _fused_resident(BFLOAT16),
    ),
    Mode(
        "fused_replica",
        "fused stages, first block replicated (--stages fused --replicate first)",
        _fused(FLOAT32),
        replicate=True,
    ),
    Mode(
        "fused_resident_replica",
        "fused stages, resident kernels, first block replicated (--stages fused --kernels "
        "resident --replicate first)",
        _fused_resident(FLOAT32),
        replicate=True,
    ),
    Mode(
        "fused_resident_replica_bfloat16",
        "fused stages, resident kernels, first block replicated, activations as bfloat16",
        _fused_resident(BFLOAT16),
        replicate=True,
    ),
    Mode(
        "fused_resident_replica_head",
        "fused stages, resident kernels, first block replicated, split head (--head split: "
        "the last stage's workers keep the fc's columns and answer logits, not pooled maps): "
        "every exact mode",
        _fused_resident(FLOAT32, head=True),
        replicate=True,
    ),
    Mode(
        "fused_resident_split_head",
        "every exact mode, the first block split by images among the workers (--replicate "
        "split: each worker is sent its own images only; the workers exchange the block's "
        "parts on their own links)",
        _fused_resident(FLOAT32, head=True, split=True),
        replicate=True,
    ),
)


def step_bytes(mode: Mode, network: str, batch: int, workers: int) -> int:
    """Bytes on the master's link in one step of ``network`` at ``batch`` with ``workers``
    workers and the master sharing every layer's kernels evenly."""
    total, replica = 0, None
    for i, layer in enumerate(network_layers(network, batch)):
        if mode.replicate and i == 0:
            replica = layer  # every node computes it: no calls
            continue
        shares = kernel_shares(layer.kernels, [1.0] * (workers + 1))
        total += mode.layer_bytes(layer, shares, replica)
        replica = None
    return total


def rows(networks: Sequence[str], batches: Sequence[int], workers: int) -> list[dict]:
    out = []
    by_name = {m.name: m for m in MODES}
    for network in networks:
        for batch in batches:
            base = step_bytes(by_name[BASELINE], network, batch, workers)
            for mode in MODES:
                nbytes = step_bytes(mode, network, batch, workers)
                out.append(
                    {
                        "network": network,
                        "batch": batch,
                        "workers": workers,
                        "mode": mode.name,
                        "master_mb": nbytes / 1e6,
                        "ratio_to_kernel_split": nbytes / base,
                    }
                )
    return out


def halo_rows(networks: Sequence[str], batches: Sequence[int], workers: int) -> list[dict]:
    """Per layer with a stage that reads neighbouring channels: the redundant halo's extra
    convolution work and master-link bytes, and an exchange's worker-to-worker bytes (per
    worker, both phases; kernels split evenly, as :func:`step_bytes` does)."""
    out = []
    for network in networks:
        for batch in batches:
            for layer in network_layers(network, batch):
                stage = layer.stage
                if stage is None or not stage.halo:
                    continue
                s = layer.shape
                shares = kernel_shares(layer.kernels, [1.0] * (workers + 1))
                starts = offsets(shares)
                owned = computed = master_bytes = 0
                ho, wo = s.out_hw
                pooled = 4 * s.n * stage.output_hw((ho, wo))[0] * stage.output_hw((ho, wo))[1]
                kernel = 4 * (s.c * s.kh * s.kw + 1)
                for start, share in zip(starts[1:], shares[1:], strict=True):
                    own = slice(start, start + share)
                    wide, grad = stage.widened(own, s.k), stage.grad_range(own, s.k)
                    owned += share
                    computed += wide.stop - wide.start
                    master_bytes += (wide.stop - wide.start - share) * kernel
                    master_bytes += (grad.stop - grad.start - share) * pooled
                reach = sum(sum(op.reach) for op in stage.ops)  # channels read, both sides
                exchange = 2 * 2 * reach * 4 * s.n * ho * wo  # forward + backward, in + out
                out.append(
                    {
                        "network": network,
                        "batch": batch,
                        "workers": workers,
                        "layer": layer.name,
                        "redundant_extra_conv": computed / owned - 1,
                        "redundant_master_kb_per_worker": master_bytes / workers / 1e3,
                        "exchange_worker_kb_per_worker": exchange / 1e3,
                        "exchange_extra_round_trips": 2,
                    }
                )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--networks", nargs="+", default=list(NETWORKS))
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    parser.add_argument("--halo", action="store_true", help="the LRN halo's cost, two ways")
    args = parser.parse_args()

    if args.halo:
        table = halo_rows(args.networks, args.batch, args.workers)
        print(
            f"{'network':<16} {'batch':>5} {'layer':<6} {'extra conv':>10} "
            f"{'master kB/w':>11} {'exchange kB/w':>13}"
        )
        for r in table:
            print(
                f"{r['network']:<16} {r['batch']:>5} {r['layer']:<6} "
                f"{r['redundant_extra_conv']:>10.1%} {r['redundant_master_kb_per_worker']:>11.1f} "
                f"{r['exchange_worker_kb_per_worker']:>13.1f}"
            )
        print(
            "redundant (built): extra conv = kernels computed beyond those owned, all workers; "
            "master kB/w = halo kernels and pooled-gradient halo on the master's link per "
            "worker and step. exchange: kB/w = sent + received between neighbouring workers "
            "per worker and step, plus 2 round trips in the middle of each step's stage"
        )
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
        return

    table = rows(args.networks, args.batch, args.workers)
    print(
        f"{'network':<16} {'batch':>5} {'workers':>7} {'mode':<32} {'master MB':>10} {'ratio':>6}"
    )
    for r in table:
        print(
            f"{r['network']:<16} {r['batch']:>5} {r['workers']:>7} {r['mode']:<32} "
            f"{r['master_mb']:>10.2f} {r['ratio_to_kernel_split']:>6.3f}"
        )
    print(
        "master MB = bytes per step on the master's link (MB = 1e6), both ways, all workers; "
        f"ratio = over the {BASELINE} mode's"
    )
    for mode in MODES:
        print(f"  {mode.name}: {mode.description}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
