"""The mode flags, declared once for ``hetconv train``, ``simulate`` and ``plan``: what is split
(``--split``: kernels or images; ``--exchange``: how a split by images sums its gradients), how
each layer runs (``--stages``, ``--kernels``,
``--replicate``, ``--master-block``, ``--overlap``, ``--head``, ``--start-ahead``), what travels
(``--wire-format``), how kernels are shared (``--shares``) and what the network is
(``--network``); and ``--model``, the CNN every command that names one takes alike
(:func:`add_model_flag`).

A command adds the flags it takes with :func:`add_mode_flags`, giving its defaults (train's,
``auto``, what runs fastest, for train, simulate and plan alike; ``hetconv simulate
--paper-modes`` asks for the paper's) and, where it offers fewer, its own choices. Each flag's
help is its meaning, said here once, and the command's default.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModeFlag:
    """One mode flag: its name, every choice (in the order train lists them) and what each
    means."""

    flag: str
    choices: tuple[str, ...]
    meaning: str  # what the flag and its choices mean, the default left out
    #: choice -> the clause that says what it means, where a command may not offer it
    #: (appended to ``meaning`` where it does).
    optional: Mapping[str, str] = field(default_factory=dict)

    def help(self, offered: Sequence[str]) -> str:
        return self.meaning + "".join(
            f"; {text}" for choice, text in self.optional.items() if choice in offered
        )

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


FLAGS = {
    flag.dest: flag
    for flag in (
        ModeFlag(
            "--split",
            ("auto", "kernels", "images"),  # hetconv.imagesplit.SPLIT_MODES
            "what is split across the nodes: kernels = each convolution's kernels, every other "
            "layer on the master (the layer modes say how each layer runs); images = the whole "
            "network, the loss included, runs on every node, each on its share of the batch's "
            "images (by its measured speed and link, so that every node finishes together; "
            "equal with --deterministic), the gradients summed on the master in node order: "
            "heterogeneous data parallelism (exact to float32 round-off; a network with batch "
            "norm only with --exchange ring, which sums its statistics among the workers; the "
            "layer modes do not apply); auto = with workers named or discovered, whichever the "
            "cost model predicts faster for the links and speeds measured at start (images only "
            "when predicted 10 %% faster; `hetconv plan` ranks both), else kernels (the embedded "
            "default, --deterministic, or a kernel-split flag given; it may also cut the "
            "network as LAYER=images does); LAYER=images = the network cut after LAYER's block "
            "(a convolution with the batch norm, ReLU, LRN and pooling after it; between "
            "residual blocks, a block's sum): the layers up to it split by images among the "
            "workers, their gradient summed by the ring, the rest of the network on the "
            "master, on the whole batch (a network whose first layers hold little of its "
            "weights: vgg11 with conv4=images; `hetconv plan` names the fastest cut)",
        ),
        ModeFlag(
            "--exchange",
            ("auto", "master", "ring"),  # hetconv.ring.EXCHANGES
            "with --split images, how the gradients are summed: master = every worker gets "
            "the parameters and sends its gradient back each step (2 x parameter bytes per "
            "worker on the master's link); ring = the workers keep the weights and momentum "
            "and sum their gradients by a ring all-reduce among themselves (worker to worker "
            "over plain gRPC: not with --tls-ca; spot-checked by sketches of each worker's own "
            "gradient), "
            "each applying the same update (2 x parameter bytes on the master's link, whatever "
            "the workers); auto = whichever the cost model predicts faster for the measured "
            "links (master where TLS is on)",
        ),
        ModeFlag(
            "--alone-check",
            ("on", "off"),
            "with --split auto: on = a few steps in (after 6), the master times one step "
            "trained alone as --local trains it, and where the cluster's median step is over "
            "5 %% slower, the workers are released and the master trains on alone (resident "
            "kernels and their momentum fetched first: exact); where the other split is "
            "predicted within 25 %%, it is run and timed next and the faster kept (a split "
            "trial); never where a worker computes on the master's own cores; off: the split "
            "chosen at start stays",
        ),
        ModeFlag(
            "--shares",
            ("compute", "link"),
            "how kernels are split: link = minimise each layer's predicted time from every "
            "node's probe and every worker's link as measured at connect (a worker whose link "
            "makes it a net loss gets none); compute = the paper's rule, in proportion to 1 / "
            "each node's probe time, links ignored",
        ),
        ModeFlag(
            "--network",
            ("auto", "switched", "wifi"),
            "what the network is: switched = Ethernet, a full-duplex port per machine (a port "
            "per node); wifi = one shared half-duplex medium that every transfer, both ways, "
            "shares",
            {
                "auto": "auto = measured at connect (whether a request and an answer in flight "
                "at once slow each other, as on one Wi-Fi channel, and what all workers at once "
                "can carry)"
            },
        ),
        ModeFlag(
            "--wire-format",
            ("float32", "float16", "bfloat16"),  # hetconv.formats.FORMAT_LABELS (a test)
            "how activations and their gradients travel to and from workers: float32 (exact), "
            "or 16-bit, half their bytes but rounded: bfloat16 (float32's range, 8 significant "
            "bits) or float16 (11 bits, overflows beyond 65504); kernels and their gradients "
            "always travel as float32",
        ),
        ModeFlag(
            "--stages",
            ("auto", "fused", "unfused"),  # hetconv.stages.STAGE_MODES
            "how layers with ReLU, LRN and max-pool after them run: fused: the node that owns a "
            "kernel slice also runs the ReLU, LRN and max-pool after the convolution on it and "
            "returns pooled maps (exact; several times fewer bytes back and out); unfused: only "
            "convolutions are distributed, as in the paper; auto: per layer, whichever the cost "
            "model counts fewer bytes for",
        ),
        ModeFlag(
            "--kernels",
            ("auto", "resident", "sent"),  # hetconv.resident.KERNEL_MODES
            "resident: a worker keeps its kernel slice of a fused layer and the slice's momentum "
            "between steps and updates it itself, so kernels and their gradients do not cross "
            "the link each step (exact; a lost worker's updates are replayed by the master from "
            "the last sync); sent: every step sends them, as the paper; auto: per fused layer, "
            "whichever the cost model counts fewer bytes for. Needs --stages fused or auto to "
            "matter",
        ),
        ModeFlag(
            "--replicate",
            ("auto", "first", "split", "split_all", "off"),  # hetconv.replica.REPLICATE_MODES
            "first: every node computes the first convolution and the ReLU, LRN and pooling "
            "after it from the images itself, so the second layer's input is never sent and its "
            "input gradient never comes back (exact: each worker back-propagates its part to a "
            "part of the first layer's kernel gradient, which the master sums; needs the second "
            "layer fused: --stages fused or auto); split: as first, but each worker computes the "
            "block only on its share of the images and the workers exchange the outputs and "
            "gradients node to node, each on its own link (switched networks: the workers must "
            "reach each other, over plain gRPC); split_all: as split, with the master one of the "
            "nodes that split the images (it computes the block on its share only, and exchanges "
            "outputs and gradients with the workers on its port); off: never",
            {
                "auto": "auto: first where the cost model predicts the step faster (it says what "
                "a split would save, but does not split; with split, a worker that cannot reach "
                "the others is left out of the exchange, named, and computes the block whole)"
            },
        ),
        ModeFlag(
            "--overlap",
            ("auto", "on", "off"),  # hetconv.overlap.OVERLAP_MODES
            "on: a worker runs a fused stage on groups of images and sends each group's output "
            "while it computes the next, and starts each group's backward as soon as its "
            "gradient has arrived, so transfers and compute overlap (exact; not for stages with "
            "batch norm; an overlapped call always streams); off: whole batches; auto: on where "
            "a worker's answer is over one message (1 MiB). Needs --stages fused or auto",
        ),
        ModeFlag(
            "--start-ahead",
            ("on", "off"),
            "on: where a replicated first block feeds a layer with resident kernels, that "
            "layer's stage forward starts on the workers with the block, so they go on from the "
            "block to the stage while the master still computes its own copy and the layers "
            "after it (exact: a worker needs nothing more of the master for it); off: the stage "
            "calls go out when the master reaches the layer",
        ),
        ModeFlag(
            "--master-block",
            ("share", "none"),  # hetconv.replica.MASTER_BLOCKS
            "with --replicate split_all: share: the master computes the block on its share of "
            "the images (by its speed), as a worker does; none: on none of them: it fetches "
            "every worker's output and sends them its input-gradient rows, so its link carries "
            "the block's output in and its gradient out but it computes none of the block",
        ),
        ModeFlag(
            "--head",
            ("auto", "split", "master"),  # hetconv.head.HEAD_MODES
            "split: where the last convolution's fused stage feeds the final fully connected "
            "layer directly and its kernels are resident, each worker also keeps that layer's "
            "weight columns of its channels and answers its part of the logits (N x classes "
            "values) instead of its pooled maps, and takes the logits' gradient back (exact to "
            "float32 round-off: the master adds the parts; that layer then runs whole batches); "
            "master: the fully connected layer runs on the master; auto: split wherever it can be",
        ),
    )
}


def add_mode_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    defaults: Mapping[str, str | None],
    *,
    choices: Mapping[str, Sequence[str]] | None = None,
    notes: Mapping[str, str] | None = None,
) -> None:
    """Add the mode flags named in ``defaults`` (dest -> this command's default; None: the
    command decides later, and its note says how), in :data:`FLAGS`' order.

    Args:
        choices: dest -> the choices this command offers, where fewer than all (in its order).
        notes: dest -> what this command adds to the flag's meaning (its default in words, what
            it replaces).
    """
    choices, notes = choices or {}, notes or {}
    unknown = set(defaults) - set(FLAGS)
    if unknown:
        raise ValueError(f"no mode flag {', '.join(sorted(unknown))}")
    for dest, flag in FLAGS.items():
        if dest not in defaults:
            continue
        default = defaults[dest]
        offered = tuple(choices.get(dest, flag.choices))
        if dest == "split" and dest not in choices:  # train's: LAYER=images too
            offered = _WithCut((*offered, "LAYER=images"))
        note = notes.get(dest, "")  # the help formatter shows a default that is not None
        parser.add_argument(
            flag.flag,
            choices=offered,
            default=default,
            help=flag.help(offered) + (f". {note[0].upper()}{note[1:]}" if note else ""),
        )


class _WithCut(tuple):
    """``--split``'s choices, and LAYER=images (:func:`hetconv.cutsplit.cut_layer`; the layer
    is checked against the network later)."""

    def __contains__(self, value) -> bool:
        if tuple.__contains__(self, value):
            return True
        from hetconv.cutsplit import cut_layer

        try:
            return isinstance(value, str) and cut_layer(value) is not None
        except ValueError:
            return False


#: train's defaults: what runs fastest, chosen per layer.
TRAIN_DEFAULTS = {
    "split": "auto",
    "exchange": "auto",
    "alone_check": "on",
    "stages": "auto",
    "kernels": "auto",
    "replicate": "auto",
    "overlap": "auto",
    "start_ahead": "on",
    "master_block": "share",
    "head": "auto",
    "wire_format": "float32",
    "shares": None,
    "network": "auto",
}
__all__ = ["FLAGS", "TRAIN_DEFAULTS", "ModeFlag", "add_mode_flags"]


def model_help() -> str:
    """What ``--model`` takes, said once for every command that names a network."""
    from hetconv.model import PRESETS

    return (
        f"the network: a preset ({', '.join(PRESETS)}), a .json spec, or an .onnx graph "
        "exported from PyTorch (torch.onnx.export; its weights are the initial ones); "
        "--preset is its other name"
    )


def add_model_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    default: str | None = None,
    *,
    dest: str = "preset",
    help: str | None = None,
    **kwargs,
) -> argparse.Action:
    """``--model NETWORK`` (``--preset`` its other name, the same ``dest``, so config files,
    resumes and command lines that say ``--preset`` keep working)."""
    return parser.add_argument(
        "--model",
        "--preset",
        dest=dest,
        default=default,
        metavar="NETWORK",
        help=help or model_help(),
        **kwargs,
    )
