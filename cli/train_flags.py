"""``hetconv train``'s flags, by group: the network and the data, training, where convolutions
run, how kernels are shared, how each layer runs (the mode flags, declared in :mod:`.modes`),
spot checks, security, checkpoints and the run folder; and which of them ``--help`` shows
(:data:`FIRST_TIER`; ``--help-all`` shows every one)."""

from __future__ import annotations

import argparse
import os

from hetconv.argtypes import non_negative_int, number_at_least, positive_float, positive_int

from .modes import TRAIN_DEFAULTS, add_mode_flags, add_model_flag

#: What train adds to the mode flags' meaning.
_MODE_NOTES = {
    "shares": "default: link with named or discovered workers; compute for the embedded "
    "default's loopback workers and with --deterministic (which splits equally)",
    "network": "what --shares link assumes of it",
}
_SHARING_MODES = ("shares", "network")
_LAYER_MODES = (
    "wire_format", "stages", "kernels", "replicate", "overlap", "start_ahead", "master_block",
    "head",
)  # fmt: skip

#: The options ``hetconv train --help`` shows; ``--help-all`` shows every one.
FIRST_TIER = (
    "preset", "data_dir", "steps", "epochs", "batch", "lr", "local", "worker",
    "workers_file", "discover", "name", "resume", "save", "load", "config",
)  # fmt: skip
#: What ``--help`` leaves to ``--help-all``, in words.
MORE_OPTIONS = "the modes, balancing, tuning, spot checks, security, checkpoints, outputs"


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of ``hetconv train``, in groups (``--help-all`` shows them so)."""
    data = p.add_argument_group("the network and the data")
    run = p.add_argument_group("training")
    where = p.add_argument_group("where convolutions run")
    sharing = p.add_argument_group("how kernels are shared between the nodes")
    modes = p.add_argument_group(
        "how each layer runs (the modes)",
        "Each mode's auto picks, per layer, what the cost model predicts faster; every mode "
        "computes the same function as one process.",
    )
    checks = p.add_argument_group("spot checks of workers' answers")
    add_model_flag(data, "tiny")
    _add_data(data)
    _add_train_run(run)
    _add_where(where)
    add_mode_flags(where, {k: TRAIN_DEFAULTS[k] for k in ("split", "exchange", "alone_check")})
    add_mode_flags(sharing, {k: TRAIN_DEFAULTS[k] for k in _SHARING_MODES}, notes=_MODE_NOTES)
    _add_balance(sharing)
    add_mode_flags(modes, {k: TRAIN_DEFAULTS[k] for k in _LAYER_MODES})
    _add_exactness(sharing, modes, checks)
    _add_train_security(p)
    _add_train_checkpoints(p)
    _add_train_outputs(p)


def _add_where(where: argparse._ArgumentGroup) -> None:
    """Where convolutions run: local, named workers, a workers file, the embedded default."""
    where.add_argument(
        "--local", action="store_true", help="run every convolution in this process, no workers"
    )
    where.add_argument(
        "--engine",
        choices=["auto", "cpu", "onednn", "cuda"],
        default="auto",
        help="the convolution engine of this process (--local, the master's own share) and of "
        "the local workers it starts: onednn (oneDNN's convolutions; its library comes with "
        "hetconv on Linux x86-64), cpu (im2col + BLAS, numpy), or auto: onednn where its "
        "library loads, else cpu, the console saying which and why (default: auto); with "
        "--local only, cuda: each step's whole model on this machine's GPU (CuPy); named "
        "workers take theirs from `hetconv worker --backend`, whose auto takes the fastest "
        "GPU first",
    )
    where.add_argument(
        "--worker",
        action="append",
        metavar="HOST:PORT",
        default=[],
        help="a running `hetconv worker` (repeat for more)",
    )
    where.add_argument(
        "--workers-file",
        metavar="PATH",
        help="a file naming workers, one HOST:PORT per line (# starts a comment); re-read "
        "every second while training: a line added joins its worker, a line removed lets it go",
    )
    where.add_argument(
        "--discover",
        action="store_true",
        help="use every `hetconv worker` advertised on the LAN (DNS-SD/mDNS) and keep looking "
        "while training: workers that appear join, workers that stop leave (combines with "
        "--worker and --workers-file)",
    )
    where.add_argument(
        "--discover-wait",
        type=number_at_least(float, 0),
        default=3.0,
        metavar="S",
        help="with --discover: seconds to wait for the first answers before training starts",
    )
    where.add_argument(
        "--local-workers",
        type=positive_int,
        default=2,
        metavar="N",
        help="worker processes the embedded default starts on loopback",
    )
    where.add_argument(
        "--connect-timeout",
        type=positive_float,
        default=20.0,
        metavar="SECONDS",
        help="how long to wait for each worker to answer at start",
    )
    where.add_argument(
        "--master-compute",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the master computes a share of every layer too",
    )


def _add_balance(sharing: argparse._ArgumentGroup) -> None:
    """How the kernels' split follows the nodes' measured speed."""
    sharing.add_argument(
        "--rebalance-every",
        type=non_negative_int,
        metavar="STEPS",
        help="every STEPS steps (default 20), re-split the kernels of nodes whose measured speed "
        "drifted 30%% or more from the figure their share was planned with (a laptop that got "
        "busy, or freed up); 0 keeps the split fixed, as in the paper, until workers come or go",
    )
    sharing.add_argument(
        "--settle-steps",
        type=non_negative_int,
        metavar="STEPS",
        default=0,
        help="after STEPS steps on the planned split (and two before them that warm up), move "
        "kernels between the nodes, the master too, once by their measured finish times where "
        "they differ beyond the steps' own scatter (the probes of identical machines can differ "
        "by a few per cent, and the plan does not see all of the master's own work); 0 keeps "
        "the planned split (4 gives the guard a usable scatter)",
    )
    sharing.add_argument(
        "--probe-nodes",
        choices=("together", "one-at-a-time"),
        default="together",
        help="together: every node probes each layer at the same time, as they "
        "compute it in training (nodes sharing a machine are measured as they will run); "
        "one-at-a-time: each node with the machine to itself, as in the paper",
    )


def _add_exactness(
    sharing: argparse._ArgumentGroup,
    modes: argparse._ArgumentGroup,
    checks: argparse._ArgumentGroup,
) -> None:
    """Resident slices' syncs, bitwise repeatable runs and the spot checks of workers' answers."""
    modes.add_argument(
        "--resident-sync-every",
        type=non_negative_int,
        default=20,
        metavar="STEPS",
        help="with resident kernels, fetch every slice every STEPS steps (default 20): the "
        "master's replay log, which keeps what a lost worker's updates need, spans this many "
        "steps; 0: only when the log grows past 512 MB per layer",
    )
    sharing.add_argument(
        "--deterministic",
        action="store_true",
        help="make two runs with the same flags over the same workers bitwise identical: "
        "every layer's kernels are split equally over the computing nodes in order (no "
        "timing decides a share; the probe sets deadlines only) and never rebalanced "
        "(implies --rebalance-every 0). A worker lost or joining mid-run still changes the "
        "split. Not with --shares link",
    )
    checks.add_argument(
        "--spot-check-every",
        type=non_negative_int,
        metavar="STEPS",
        help="on one step in STEPS, drawn at random (default 4; 1: every step), the master "
        "recomputes a few values of every worker answer (resident kernels: at their next "
        "sync) and drops a worker whose values are wrong (finite but "
        "wrong: a broken driver, a bad overclock) for the rest of the run, computing its "
        "share itself; 0: never",
    )
    checks.add_argument(
        "--spot-check-sample",
        type=positive_int,
        metavar="N",
        help="kernels of a worker's slice, images of the batch and input channels each check "
        "recomputes (default 2); with --split images, the workers whose whole range a checked "
        "step recomputes (one unless given)",
    )


def _add_train_security(p: argparse.ArgumentParser) -> None:
    security = p.add_argument_group("security")
    security.add_argument(
        "--token",
        metavar="TOKEN",
        help="shared secret sent with every call, as the workers were started with "
        "(default: $HETCONV_TOKEN; the flag wins; the variable stays out of `ps`)",
    )
    security.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="talk TLS to the workers, trusting certificates signed by this CA "
        "(or this self-signed certificate)",
    )


def _add_data(data: argparse._ArgumentGroup) -> None:
    """What the data is: its kind, where it is, what is held out of it."""
    data.add_argument(
        "--dataset",
        choices=["synthetic", "cifar10", "cifar100", "folder", "npz", "auto"],
        help="what --data-dir holds (default: inferred from it; synthetic without it, an "
        "offline CIFAR-shaped set): cifar10/cifar100 = the official python-version tarball "
        "or the folder it extracts to; folder = <class>/<image> (torchvision's ImageFolder), "
        "or train/<class>/<image> with val/ or test/ or neither; "
        "npz = arrays x_train, y_train, x_test, y_test (or x, y)",
    )
    data.add_argument(
        "--data-dir",
        metavar="PATH",
        help="the dataset: a CIFAR tarball (cifar-10-python.tar.gz from "
        "https://www.cs.toronto.edu/~kriz/cifar.html) or its folder, an image folder, or an "
        ".npz file; input shape and class count come from it",
    )
    data.add_argument(
        "--holdout-fraction",
        type=positive_float,
        metavar="F",
        help="hold out this fraction of the training data for evaluation, for data without "
        "a held-out part of its own (an .npz of x and y, an image folder without val/ or "
        "test/): 0.1 by default",
    )


def _add_train_run(run: argparse._ArgumentGroup) -> None:
    """The length of training, the optimizer, evaluation, the weights in and out."""
    length = run.add_mutually_exclusive_group()
    length.add_argument(
        "--steps",
        type=positive_int,
        help="SGD steps (default 300 unless --epochs is given)",
    )
    length.add_argument("--epochs", type=positive_float, help="passes over the training set")
    run.add_argument("--batch", type=positive_int, default=32, help="images per step")
    run.add_argument("--seed", type=int, default=0, help="seed for weights, data and order")
    run.add_argument("--lr", type=positive_float, default=0.01, help="learning rate")
    run.add_argument("--momentum", type=float, default=0.9, help="SGD momentum, in [0, 1)")
    run.add_argument("--weight-decay", type=float, default=5e-4, help="L2 weight decay")
    run.add_argument(
        "--train-size",
        type=positive_int,
        metavar="N",
        help="images in the synthetic training set (default 10000; not with --data-dir, whose "
        "whole training set is used)",
    )
    run.add_argument(
        "--eval-size",
        type=non_negative_int,
        metavar="N",
        help="evaluate on the first N held-out images (default: all of them; 0: no "
        "evaluation); the synthetic held-out set has 2000 unless N asks for more",
    )
    run.add_argument(
        "--eval-every",
        type=positive_int,
        metavar="STEPS",
        help="also evaluate every STEPS steps (always: after every epoch and at the end); "
        "each is traced, about ten a run printed",
    )
    run.add_argument(
        "--save",
        metavar="NPZ",
        help="write the trained weights (PyTorch names) here instead of the run folder's "
        "model.npz (also when Ctrl-C stops the run)",
    )
    run.add_argument(
        "--load",
        metavar="PATH",
        help="start from these weights: a model .npz, a checkpoint file or folder, or a run "
        "folder (its model.npz, else its latest checkpoint)",
    )
    run.add_argument(
        "--trace",
        metavar="JSONL",
        help="write the trace (one JSON object per step) here instead of the run folder's "
        "trace.jsonl",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_train_checkpoints(p: argparse.ArgumentParser) -> None:
    saving = p.add_argument_group("checkpoints")
    saving.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="write checkpoints (weights, optimizer, data position) here instead of the run "
        "folder's checkpoints/; the last 3 are kept. Ctrl-C or SIGTERM finishes the current "
        "step and checkpoints it before stopping (a second Ctrl-C stops at once)",
    )
    saving.add_argument(
        "--checkpoint-every",
        type=positive_int,
        metavar="N",
        help="steps between checkpoints (default 100); one is always written at the end",
    )
    saving.add_argument(
        "--resume",
        action="store_true",
        help="continue the run --name (or the one in --checkpoint-dir) from its latest "
        "checkpoint (from scratch if none)",
    )


#: --run-dir's default: $HETCONV_RUN_DIR, else runs/ in the current folder.
RUN_DIR_VARIABLE = "HETCONV_RUN_DIR"


def _add_train_outputs(p: argparse.ArgumentParser) -> None:
    outputs = p.add_argument_group(
        "the run folder",
        "Every run writes RUN-DIR/NAME/: config.toml (its resolved flags), metrics.csv, "
        "trace.jsonl, checkpoints/, model.npz and, with --tensorboard, tensorboard/. "
        "`hetconv report RUN-DIR/NAME` draws its figures.",
    )
    outputs.add_argument(
        "--run-dir",
        metavar="DIR",
        default=os.environ.get(RUN_DIR_VARIABLE) or "runs",
        help=f"the folder that holds runs; ${RUN_DIR_VARIABLE}, when set, is its default",
    )
    outputs.add_argument(
        "--name",
        metavar="NAME",
        help="the run's folder name (default: the local time, YYYYMMDD-HHMMSS); an existing "
        "run is refused unless --resume continues it",
    )
    outputs.add_argument(
        "--no-run-dir",
        action="store_true",
        help="write no run folder: only what --trace, --save and --checkpoint-dir ask for",
    )
    outputs.add_argument(
        "--config",
        metavar="TOML",
        help="take the flags from this file (a run's config.toml reruns it); flags given "
        "here override it",
    )
    outputs.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write TensorBoard event files to the run folder's tensorboard/ "
        "(pip install 'hetconv[tensorboard]')",
    )
