"""The ``hetconv`` command line."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from . import __version__
from .argtypes import (
    non_negative_int,
    number_at_least,
    parse_address,
    positive_float,
    positive_int,
)
from .model import PRESETS


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the empty ones that would only say 'None', 'False' or '[]'."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser. Its usage errors read ``hetconv COMMAND: error: ...`` (exit 2),
    as :func:`main` reports bad input. ``intermixed=True``: positionals may sit on both sides
    of options (``hetconv simulate a --nodes 1..4 b``), as ``parse_intermixed_args`` parses."""

    def __init__(self, *args, intermixed: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.intermixed = intermixed
        self._mixing = False

    def parse_known_args(self, args=None, namespace=None):
        if not self.intermixed or self._mixing:
            return super().parse_known_args(args, namespace)
        self._mixing = True  # the intermixed parse calls back here for its two passes
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._mixing = False


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a network",
        description=(
            "Train a CNN preset on the synthetic set (offline, the default) or your data "
            "(--data-dir: CIFAR-10/100, an image folder, an .npz). "
            "The master (this process) trains every non-convolutional layer; each "
            "convolution's kernels are split across the workers named with --worker or "
            "--workers-file, and the master itself, in proportion to a probe of each one's "
            "speed on the layer's real shape. With no worker named and no --local, two local "
            "worker processes are started on loopback (the embedded default)."
        ),
        formatter_class=_HelpFormatter,
    )
    add_train_arguments(p)
    p.set_defaults(func=_run_train)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of ``hetconv train``."""
    _add_train_cluster(p)
    _add_train_security(p)
    _add_train_run(p)
    _add_train_checkpoints(p)
    _add_train_outputs(p)


def _add_train_cluster(p: argparse.ArgumentParser) -> None:
    """Where convolutions run: local, named workers, a workers file, the embedded default."""
    where = p.add_argument_group("where convolutions run")
    where.add_argument(
        "--local", action="store_true", help="run every convolution in this process, no workers"
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
    where.add_argument(
        "--shares",
        choices=("compute", "link"),
        default=None,
        help="how kernels are split: link (the default) = minimise each layer's predicted "
        "time from every node's probe and every worker's link as measured at connect (a "
        "worker whose link makes it a net loss gets none); compute = the paper's rule, in "
        "proportion to 1 / each node's probe time, links ignored (the default with "
        "--deterministic, which splits equally, and for the embedded default's loopback "
        "workers)",
    )
    where.add_argument(
        "--network",
        choices=("auto", "switched", "wifi"),
        default="auto",
        help="what --shares link assumes of the network: auto (the default) measures it at "
        "connect (whether a request and an answer in flight at once slow each other, as on "
        "one Wi-Fi channel, and what all workers at once can carry); switched = Ethernet, a "
        "full-duplex port per machine; wifi = one medium that every transfer, both ways, "
        "shares",
    )
    where.add_argument(
        "--wire-format",
        choices=("float32", "float16", "bfloat16"),  # hetconv.formats.FORMAT_LABELS (a test)
        default="float32",
        help="how activations and their gradients travel to and from workers: float32 "
        "(exact), or 16-bit, half their bytes but rounded: bfloat16 (float32's range, 8 "
        "significant bits) or float16 (11 bits, overflows beyond 65504); kernels and their "
        "gradients always travel as float32",
    )
    where.add_argument(
        "--rebalance-every",
        type=non_negative_int,
        metavar="STEPS",
        help="every STEPS steps (default 20), re-split the kernels of nodes whose measured speed "
        "drifted 30%% or more from the figure their share was planned with (a laptop that got "
        "busy, or freed up); 0 keeps the split fixed, as in the paper, until workers come or go",
    )
    where.add_argument(
        "--settle-steps",
        type=non_negative_int,
        metavar="STEPS",
        default=0,
        help="after STEPS steps on the planned split (and two before them that warm up), move "
        "kernels between the nodes, the master too, once by their measured finish times where "
        "they differ beyond the steps' own scatter (the probes of identical machines can differ "
        "by a few per cent, and the plan does not see all of the master's own work); 0, the "
        "default, keeps the planned split (4 gives the guard a usable scatter)",
    )
    where.add_argument(
        "--probe-nodes",
        choices=("together", "one-at-a-time"),
        default="together",
        help="together, the default: every node probes each layer at the same time, as they "
        "compute it in training (nodes sharing a machine are measured as they will run); "
        "one-at-a-time: each node with the machine to itself, as in the paper",
    )
    where.add_argument(
        "--stages",
        choices=("auto", "fused", "unfused"),  # hetconv.stages.STAGE_MODES
        default="auto",
        help="fused: the node that owns a kernel slice also runs the ReLU, LRN and max-pool "
        "after the convolution on it and returns pooled maps (exact; several times fewer bytes "
        "back and out); unfused: only convolutions are distributed, as in the paper; auto "
        "(default): per layer, whichever the cost model counts fewer bytes for",
    )
    where.add_argument(
        "--kernels",
        choices=("auto", "resident", "sent"),  # hetconv.resident.KERNEL_MODES
        default="auto",
        help="resident: a worker keeps its kernel slice of a fused layer and the slice's "
        "momentum between steps and updates it itself, so kernels and their gradients do not "
        "cross the link each step (exact; a lost worker's updates are replayed by the master "
        "from the last sync); sent: every step sends them, as the paper; auto (default): per "
        "fused layer, whichever the cost model counts fewer bytes for",
    )
    where.add_argument(
        "--replicate",
        choices=("auto", "first", "split", "split_all", "off"),  # hetconv.replica.REPLICATE_MODES
        default="auto",
        help="first: every node computes the first convolution and the ReLU, LRN and pooling "
        "after it from the images itself, so the second layer's input is never sent and its "
        "input gradient never comes back (exact: each worker back-propagates its part to a "
        "part of the first layer's kernel gradient, which the master sums; needs the second "
        "layer fused); split: as first, but each worker computes the block only on its share "
        "of the images and the workers exchange the outputs and gradients node to node "
        "(switched networks: the workers must reach each other, over plain gRPC); split_all: "
        "as split, with the master one of the nodes that split the images (it computes the "
        "block on its share only, and exchanges outputs and gradients with the workers); off: "
        "never; "
        "auto (default): where the cost model predicts the step faster",
    )
    where.add_argument(
        "--overlap",
        choices=("auto", "on", "off"),  # hetconv.overlap.OVERLAP_MODES
        default="auto",
        help="on: a worker runs a fused stage on groups of images and sends each group's "
        "output while it computes the next, and starts each group's backward as soon as its "
        "gradient has arrived, so transfers and compute overlap (exact; not for stages with "
        "batch norm; an overlapped call always streams); off: whole batches; auto (default): "
        "on where a worker's answer is over one message (1 MiB)",
    )
    where.add_argument(
        "--start-ahead",
        choices=("on", "off"),
        default="on",
        help="on (default): where a replicated first block feeds a layer with resident "
        "kernels, that layer's stage forward starts on the workers with the block, so they go "
        "on from the block to the stage while the master still computes its own copy and the "
        "layers after it (exact: a worker needs nothing more of the master for it); off: the "
        "stage calls go out when the master reaches the layer",
    )
    where.add_argument(
        "--master-block",
        choices=("share", "none"),  # hetconv.replica.MASTER_BLOCKS
        default="share",
        help="with --replicate split_all: share (default): the master computes the block on "
        "its share of the images (by its speed), as a worker does; none: on none of them: it "
        "fetches every worker's output and sends them its input-gradient rows, so its link "
        "carries the block's output in and its gradient out but it computes none of the block",
    )
    where.add_argument(
        "--head",
        choices=("auto", "split", "master"),  # hetconv.head.HEAD_MODES
        default="auto",
        help="split: where the last convolution's fused stage feeds the final fully connected "
        "layer directly and its kernels are resident, each worker also keeps that layer's "
        "weight columns of its channels and answers its part of the logits (N x classes "
        "values) instead of its pooled maps, and takes the logits' gradient back (exact to "
        "float32 round-off: the master adds the parts; that layer then runs whole batches); "
        "master: the fully connected layer runs on the master; auto (default): split wherever "
        "it can be",
    )
    where.add_argument(
        "--resident-sync-every",
        type=non_negative_int,
        default=20,
        metavar="STEPS",
        help="with resident kernels, fetch every slice every STEPS steps (default 20): the "
        "master's replay log, which keeps what a lost worker's updates need, spans this many "
        "steps; 0: only when the log grows past 512 MB per layer",
    )
    where.add_argument(
        "--deterministic",
        action="store_true",
        help="make two runs with the same flags over the same workers bitwise identical: "
        "every layer's kernels are split equally over the computing nodes in order (no "
        "timing decides a share; the probe sets deadlines only) and never rebalanced "
        "(implies --rebalance-every 0). A worker lost or joining mid-run still changes the "
        "split. Not with --shares link",
    )
    where.add_argument(
        "--spot-check-every",
        type=non_negative_int,
        metavar="STEPS",
        help="every STEPS steps (default 4; 1: every step), the master recomputes a few values "
        "of every worker answer and drops a worker whose values are wrong (finite but "
        "wrong: a broken driver, a bad overclock) for the rest of the run, computing its "
        "share itself; 0: never",
    )
    where.add_argument(
        "--spot-check-sample",
        type=positive_int,
        metavar="N",
        help="kernels of a worker's slice, images of the batch and input channels each check "
        "recomputes (default 2)",
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
    p.add_argument(
        "--preset",
        default="tiny",
        help=f"network: one of {', '.join(PRESETS)}, or a .json spec file",
    )
    p.add_argument(
        "--dataset",
        choices=["synthetic", "cifar10", "cifar100", "folder", "npz", "auto"],
        help="what --data-dir holds (default: inferred from it; synthetic without it, an "
        "offline CIFAR-shaped set): cifar10/cifar100 = the official python-version tarball "
        "or the folder it extracts to; folder = train/<class>/<image> and val/ (or test/); "
        "npz = arrays x_train, y_train, x_test, y_test (or x, y)",
    )
    p.add_argument(
        "--data-dir",
        metavar="PATH",
        help="the dataset: a CIFAR tarball (cifar-10-python.tar.gz from "
        "https://www.cs.toronto.edu/~kriz/cifar.html) or its folder, an image folder, or an "
        ".npz file; input shape and class count come from it",
    )
    p.add_argument(
        "--holdout-fraction",
        type=positive_float,
        metavar="F",
        help="hold out this fraction of the training data for evaluation, for data without "
        "a held-out part of its own (an .npz of x and y: 0.1 by default; a folder with only "
        "train/)",
    )


def _add_train_run(p: argparse.ArgumentParser) -> None:
    """The network, the data, the length of training and the optimizer."""
    length = p.add_mutually_exclusive_group()
    length.add_argument(
        "--steps",
        type=positive_int,
        help="SGD steps (300 when neither --steps nor --epochs is given)",
    )
    length.add_argument("--epochs", type=positive_float, help="passes over the training set")
    p.add_argument("--batch", type=positive_int, default=32, help="images per step")
    p.add_argument("--seed", type=int, default=0, help="seed for weights, data and order")
    p.add_argument("--lr", type=positive_float, default=0.01, help="learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum, in [0, 1)")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="L2 weight decay")
    p.add_argument(
        "--train-size",
        type=positive_int,
        metavar="N",
        help="images in the synthetic training set (default 10000; not with --data-dir, whose "
        "whole training set is used)",
    )
    p.add_argument(
        "--eval-size",
        type=non_negative_int,
        metavar="N",
        help="evaluate on the first N held-out images (default: all of them; 0: no "
        "evaluation); the synthetic held-out set has 2000 unless N asks for more",
    )
    p.add_argument(
        "--eval-every",
        type=positive_int,
        metavar="STEPS",
        help="also evaluate every STEPS steps (always: after every epoch and at the end); "
        "each evaluation is printed and traced",
    )
    p.add_argument(
        "--save",
        metavar="NPZ",
        help="write the trained weights (PyTorch names) here instead of the run folder's "
        "model.npz (also when Ctrl-C stops the run)",
    )
    p.add_argument(
        "--load",
        metavar="PATH",
        help="start from these weights: a model .npz, a checkpoint file or folder, or a run "
        "folder (its model.npz, else its latest checkpoint)",
    )
    p.add_argument(
        "--trace",
        metavar="JSONL",
        help="write the trace (one JSON object per step) here instead of the run folder's "
        "trace.jsonl",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


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
        help=f"the folder that holds runs (${RUN_DIR_VARIABLE} sets the default)",
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


def _run_train(args: argparse.Namespace) -> int:

    from hetconv.conv import LocalConv
    from hetconv.formats import format_named
    from hetconv.master.cluster import Cluster, ClusterConfig
    from hetconv.master.launch import EmbeddedCluster
    from hetconv.master.membership import read_workers_file
    from hetconv.training.rundir import RunDir
    from hetconv.training import TrainConfig, TrainingInterrupted, train
    from hetconv.security import read_pem, resolve_token

    from .optim import SGDConfig

    if args.train_size is not None and args.data_dir:
        raise ValueError(
            "--train-size sizes the synthetic set; with --data-dir the whole training set is "
            "used (--steps or --epochs say how much of it to see): drop --train-size"
        )
    run = None
    if args.tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboardX") is None:
            raise ValueError("--tensorboard needs tensorboardX: pip install 'hetconv[tensorboard]'")
    if args.no_run_dir:
        for flag, given in (("--name", args.name), ("--tensorboard", args.tensorboard)):
            if given:
                raise ValueError(f"{flag} needs a run folder: drop --no-run-dir")
    elif args.resume and not args.name and not args.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir or --name: the run to continue")
    else:
        # --resume with --checkpoint-dir alone continues those checkpoints in a new run folder.
        run = RunDir.choose(args.run_dir, args.name, resume=args.resume and bool(args.name))
    config = TrainConfig(
        preset=args.preset,
        # --data-dir without --dataset: the kind is inferred from the path, never ignored.
        dataset=args.dataset or ("auto" if args.data_dir else "synthetic"),
        data_dir=args.data_dir,
        holdout_fraction=args.holdout_fraction,
        steps=args.steps,
        epochs=args.epochs,
        batch=args.batch,
        seed=args.seed,
        sgd=SGDConfig(lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay),
        train_size=args.train_size or TrainConfig.train_size,  # the synthetic set's default
        eval_size=args.eval_size,
        eval_every=args.eval_every,
        trace=args.trace or (run and os.fspath(run.trace)),
        run_dir=run and os.fspath(run.path),
        metrics=run and os.fspath(run.metrics),
        tensorboard=run and args.tensorboard and os.fspath(run.tensorboard) or None,
        save=args.save or (run and os.fspath(run.model)),
        load=args.load,
        progress=not args.no_progress,
        checkpoint_dir=args.checkpoint_dir or (run and os.fspath(run.checkpoints)),
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
    )
    addresses = [parse_address(a) for a in args.worker]
    if args.workers_file:
        addresses += read_workers_file(args.workers_file)
    token = resolve_token(args.token)  # --token, else $HETCONV_TOKEN
    if args.tls_ca is not None:
        read_pem(args.tls_ca, "TLS CA certificate (--tls-ca)")  # one line now, not mid-start
        if not addresses and not args.local and not args.discover:
            raise ValueError("--tls-ca needs --worker/--workers-file: local workers serve no TLS")
    if args.local:
        if addresses or args.discover:
            raise ValueError("--local runs no workers; drop --worker/--workers-file/--discover")
        if args.spot_check_every is not None or args.spot_check_sample is not None:
            raise ValueError(
                "--local runs no workers, so nothing to spot-check: drop --spot-check-*"
            )
        if args.wire_format != "float32":
            raise ValueError(
                "--local runs no workers, so nothing goes on the wire: drop --wire-format"
            )
        if args.stages != "auto":
            raise ValueError("--local runs no workers, so nothing is fused: drop --stages")
        if args.kernels != "auto":
            raise ValueError("--local runs no workers, so no kernel is resident: drop --kernels")
        if args.replicate != "auto":
            raise ValueError("--local runs no workers, so nothing is replicated: drop --replicate")
        if args.overlap != "auto":
            raise ValueError("--local runs no workers, so nothing overlaps: drop --overlap")
        if args.head != "auto":
            raise ValueError("--local runs no workers, so the head is not split: drop --head")
    else:
        if args.shares is None:
            # The embedded default demonstrates the split on one machine, where every "link"
            # is loopback: by compute, so its workers take part as the README says.
            embedded = not addresses and not args.discover
            args.shares = "compute" if args.deterministic or embedded else "link"
        if args.deterministic and args.shares == "link":
            raise ValueError(
                "--deterministic splits kernels equally, --shares link by measured links: "
                "drop one of them"
            )
        if args.deterministic and args.rebalance_every:
            raise ValueError(
                "--deterministic never rebalances (shares must not follow measured speed): "
                "drop --rebalance-every"
            )
        if args.deterministic and args.settle_steps:
            raise ValueError(
                "--deterministic never settles (shares must not follow measured speed): "
                "drop --settle-steps"
            )
        if args.rebalance_every is None:
            args.rebalance_every = 0 if args.deterministic else 20
        cluster_config = ClusterConfig(
            master_compute=args.master_compute,
            connect_timeout=args.connect_timeout,
            workers_file=args.workers_file,  # re-read while training: workers come and go
            share_policy=args.shares,
            network=args.network,
            rebalance_every=args.rebalance_every,
            settle_steps=args.settle_steps,
            probe_together=args.probe_nodes == "together",
            deterministic=args.deterministic,
            token=token,  # the embedded default's local workers are started with it too
            tls_ca=args.tls_ca,
            wire_format=format_named(args.wire_format),
            stages=args.stages,
            kernels=args.kernels,
            replicate=args.replicate,
            overlap=args.overlap,
            start_ahead=args.start_ahead == "on",
            master_block=args.master_block,
            head=args.head,
            resident_sync_every=args.resident_sync_every,
            spot_checks=_spot_check_config(args),
        )
    created, previous_config = False, None
    if run is not None:
        created = run.make()
        if run.config.is_file():  # a resume: kept until the run is known to continue
            previous_config = run.config.read_bytes()
        _write_run_config(run.config, args)
    try:
        if args.local:
            result = train(config, LocalConv())
        elif args.discover:
            result = _train_discovered(config, cluster_config, addresses, args.discover_wait)
        elif addresses:
            with Cluster(addresses, config=cluster_config) as cluster:
                result = train(config, cluster)
        else:
            with EmbeddedCluster(args.local_workers, cluster_config) as cluster:
                result = train(config, cluster)
    except TrainingInterrupted as e:
        e.resume_command = _resume_command(args, run)
        raise
    except BaseException as e:
        if created:
            run.discard_if_empty()
        elif previous_config is not None and isinstance(e, (ValueError, OSError)):
            # A resume refused (another run's settings, say) leaves the run's config as it was.
            run.config.write_bytes(previous_config)
        raise
    if run is not None:
        print(
            f"run folder {run.path}: `hetconv report {shlex.quote(os.fspath(run.path))}` "
            "draws its figures",
            file=sys.stderr,
        )
    return _final_checkpoint_status(config.checkpoint_dir, result.steps)


def _train_discovered(config, cluster_config, named: list[str], wait: float):
    """``hetconv train --discover``: browse the LAN for ``wait`` seconds, say what was found,
    train with it and the ``named`` workers, and keep browsing (joiners and leavers)."""
    from hetconv.master.cluster import Cluster
    from hetconv.master.discovery import Discovery
    from hetconv.training import train

    try:
        discovery = Discovery(has_token=cluster_config.token is not None)
    except OSError as e:
        raise OSError(
            f"--discover cannot browse the LAN (multicast DNS): {e}; name workers with --worker"
        ) from None
    try:
        print(f"looking for workers on the LAN (DNS-SD/mDNS) for {wait:g} s ...", flush=True)
        found = _accepting(_not_named(discovery.wait(wait), named, cluster_config), cluster_config)
        for refusal in discovery.take_refusals():
            print(f"found {refusal.address}, not used: {refusal.reason}")
        if found:
            listed = "; ".join(w.describe() for w in found)
            print(f"found {len(found)} worker{'s' if len(found) != 1 else ''}: {listed}")
        else:
            other = "other " if named else ""
            print(
                f"found no {other}worker yet; still looking while training (workers join as "
                "they appear)"
            )
        addresses = named + [w.address for w in found]
        if not addresses and not cluster_config.master_compute:
            raise ValueError(
                f"--discover found no worker in {wait:g} s and --no-master-compute leaves "
                "nothing to compute: start workers first, or give --discover-wait more"
            )
        with Cluster(addresses, config=cluster_config) as cluster:
            cluster.membership.follow(discovery, [w.address for w in found])
            return train(config, cluster)
    finally:
        discovery.close()


def _accepting(found, cluster_config) -> list:
    """The workers ``found`` on the LAN minus those that refuse this master's token or fail
    its TLS check (another user's workers, or a stranger's), each said."""
    from hetconv.master.client import WorkerAuthError, WorkerClient, WorkerError, WorkerTLSError

    kept = []
    for worker in found:
        if not worker.token_required and cluster_config.tls_ca is None:
            kept.append(worker)
            continue
        client = WorkerClient(
            worker.address, 2.0, token=cluster_config.token, tls_ca=cluster_config.tls_ca
        )
        try:
            client.describe()
        except (WorkerAuthError, WorkerTLSError) as e:
            print(f"found {worker.address}, not used: {e}")
            continue
        except WorkerError:  # not reachable now: the cluster reports it and retries
            pass
        finally:
            client.close()
        kept.append(worker)
    return kept


def _not_named(found, named: list[str], cluster_config) -> list:
    """The workers ``found`` on the LAN that are not among the ``named`` ones, by address or
    by worker process (the instance id their advertisement carries and Describe returns: a
    worker named as ``localhost:P`` is found at its LAN address), saying which were left."""
    from hetconv.master.client import WorkerClient, WorkerError

    found = [w for w in found if w.address not in named]
    if not found or not named:
        return found
    named_ids = {}
    for address in named:
        client = WorkerClient(
            address, 2.0, token=cluster_config.token, tls_ca=cluster_config.tls_ca
        )
        try:
            named_ids[f"{client.describe().instance_id:016x}"] = address
        except WorkerError:  # not reachable now: the cluster reports it
            pass
        finally:
            client.close()
    kept = []
    for worker in found:
        twin = named_ids.get(worker.properties.get("instance", ""))
        if twin is None:
            kept.append(worker)
        else:
            print(f"found {worker.address}: the worker named as {twin}; using it")
    return kept


def _spot_check_config(args: argparse.Namespace):
    from hetconv.master.spotcheck import DEFAULT_EVERY, SpotCheckConfig

    every = DEFAULT_EVERY if args.spot_check_every is None else args.spot_check_every
    if every == 0 and args.spot_check_sample is not None:
        raise ValueError("--spot-check-every 0 checks nothing: drop --spot-check-sample")
    sample = args.spot_check_sample
    if sample is None:
        return SpotCheckConfig(every=every, seed=args.seed)
    return SpotCheckConfig(
        every=every, kernels=sample, images=sample, channels=sample, seed=args.seed
    )


# -- config.toml: a run's flags, and --config ------------------------------------------------

#: Flags a config file never holds: where this run's outputs go (a rerun makes its own), the
#: secret, and the file itself.
_NOT_CONFIG = {
    "help": "",
    "config": "a config file cannot name another",
    "name": "each run names its own folder: give --name on the command line",
    "run_dir": "give --run-dir on the command line",
    "no_run_dir": "give --no-run-dir on the command line",
    "resume": "give --resume on the command line",
    "token": "a secret never goes into a file: use $HETCONV_TOKEN or --token",
    "trace": "outputs go to the run folder, or give --trace on the command line",
    "save": "outputs go to the run folder, or give --save on the command line",
    "checkpoint_dir": "outputs go to the run folder, or give --checkpoint-dir on the command line",
    "no_progress": "give --no-progress on the command line",
}
#: The table each flag is written in (flags not named here: [training]).
_CONFIG_TABLES = {
    "model": ("preset",),
    "data": ("dataset", "data_dir", "holdout_fraction", "train_size", "eval_size", "eval_every"),
    "training": ("steps", "epochs", "batch", "seed", "lr", "momentum", "weight_decay", "load"),
    "cluster": (
        "local", "worker", "workers_file", "local_workers", "connect_timeout", "master_compute",
        "shares", "network", "wire_format", "rebalance_every", "settle_steps", "stages",
        "deterministic", "probe_nodes",
        "tls_ca", "spot_check_every", "spot_check_sample", "discover", "discover_wait",
    ),
    "outputs": ("checkpoint_every", "tensorboard"),
}  # fmt: skip
_CONFIG_PATHS = ("data_dir", "workers_file", "tls_ca", "load")


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetconv train", add_help=False)
    add_train_arguments(parser)
    return parser


def _config_key(action: argparse.Action) -> str:
    return next(o for o in action.option_strings if o.startswith("--"))[2:]


def _config_actions() -> dict[str, argparse.Action]:
    """Config key (the flag's name without --) -> the flag, for every flag a config holds."""
    return {
        _config_key(a): a
        for a in _train_parser()._actions
        if a.option_strings and a.dest not in _NOT_CONFIG
    }


def _write_run_config(path: Path, args: argparse.Namespace) -> None:
    """Write the run's resolved flags (defaults filled in, paths made absolute)."""
    from hetconv.data import infer_dataset
    from hetconv.training.rundir import write_config
    from hetconv.model import PRESETS

    values = dict(vars(args))
    if values["data_dir"]:
        values["dataset"] = values["dataset"] or infer_dataset(values["data_dir"])
    else:
        values["dataset"] = "synthetic"
        values["train_size"] = values["train_size"] or 10_000
    if values["steps"] is None and values["epochs"] is None:
        values["steps"] = 300  # hetconv.training.config.total_steps's default
    for key in _CONFIG_PATHS:
        if values[key]:
            values[key] = os.path.abspath(values[key])
    if values["preset"] not in PRESETS:
        values["preset"] = os.path.abspath(values["preset"])
    if values["local"]:  # nothing else of a cluster applies
        values.update({dest: None for dest in _CONFIG_TABLES["cluster"] if dest != "local"})
    tables: dict[str, dict[str, object]] = {name: {} for name in _CONFIG_TABLES}
    for key, action in _config_actions().items():
        table = next((t for t, dests in _CONFIG_TABLES.items() if action.dest in dests), None)
        tables[table or "training"][key] = values.get(action.dest)
    write_config(
        path,
        tables,
        "hetconv train's flags for this run (the token and where outputs go are not kept).\n"
        f"Run it again: hetconv train --config {path}\n"
        "Flags given on the command line override these.",
    )


def _config_value(path: str, key: str, action: argparse.Action, value: object) -> object:
    """A config file's value for ``action``, checked as the flag's own value would be."""

    def refuse(why: str) -> ValueError:
        return ValueError(f"config {path}: {key} = {value!r}: {why}")

    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise refuse("expected true or false")
        return value
    if isinstance(action, argparse._AppendAction):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise refuse("expected a list of strings")
        return list(value)
    wrong = action.type is None and not isinstance(value, str)
    if wrong or isinstance(value, (bool, list, dict)):
        raise refuse("expected " + ("a string" if action.type is None else "a number"))
    if action.type is not None:
        try:
            value = action.type(str(value))
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            raise refuse(str(e) or "not a valid value") from None
    if action.choices is not None and value not in action.choices:
        raise refuse(f"expected one of {', '.join(map(str, action.choices))}")
    return value


def _explicit_train_flags(argv: list[str]) -> set[str]:
    """The dests of the train flags ``argv`` (a ``hetconv train`` command line) gives."""
    parser = _train_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    train_argv = argv[argv.index("train") + 1 :] if "train" in argv else argv
    return set(vars(parser.parse_known_args(train_argv)[0]))


def _apply_config(args: argparse.Namespace, argv: list[str]) -> None:
    """Fill ``args`` from ``args.config``: every flag not given on the command line."""
    from hetconv.training.rundir import read_config

    path = args.config
    values = read_config(path)
    actions = _config_actions()
    explicit = _explicit_train_flags(argv)
    parser = _train_parser()
    # A flag given on the command line also overrides the file's others of its group
    # (--epochs there, --steps here).
    overridden = set(explicit)
    for group in parser._mutually_exclusive_groups:
        dests = {a.dest for a in group._group_actions}
        if dests & explicit:
            overridden |= dests
    for key, value in values.items():
        action = actions.get(key)
        if action is None:
            dest = key.replace("-", "_")
            why = _NOT_CONFIG.get(dest)
            raise ValueError(
                f"config {path}: {key} cannot be set in a config file ({why})"
                if why
                else f"config {path}: unknown key {key!r} (the keys are train's flags without "
                "--, e.g. wire-format)"
            )
        value = _config_value(path, key, action, value)
        if action.dest not in overridden:
            setattr(args, action.dest, value)


def _resume_command(args: argparse.Namespace, run) -> str:
    """The command that continues an interrupted run."""
    if run is None:
        return "the same command with --resume"
    words = ["hetconv", "train", "--config", os.fspath(run.config), "--name", run.name]
    if os.path.abspath(run.root) != os.path.abspath(os.environ.get(RUN_DIR_VARIABLE) or "runs"):
        words += ["--run-dir", os.fspath(run.root)]
    for flag in ("trace", "save", "checkpoint_dir"):
        if getattr(args, flag):
            words += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    if args.no_progress:
        words.append("--no-progress")
    return shlex.join([*words, "--resume"])


def _final_checkpoint_status(checkpoint_dir: str | None, steps: int) -> int:
    """0, or 1 saying so when a run with --checkpoint-dir ended without its final checkpoint
    (the disk filled, the folder vanished: training reported the failure and went on)."""
    if not checkpoint_dir:
        return 0
    from hetconv.training.checkpoint import CheckpointDir

    checkpoints = CheckpointDir(checkpoint_dir)
    final = checkpoints.file_for(steps)
    committed = checkpoints.pointer()
    if committed == final and final.is_file():
        return 0
    latest = (
        f"the latest checkpoint there is {committed}"
        if committed is not None and committed.is_file()
        else "there is no checkpoint there"
    )
    print(
        f"hetconv train: error: the final checkpoint (step {steps}) could not be written in "
        f"{checkpoints.path} (see above); {latest}",
        file=sys.stderr,
    )
    return 1


def _add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="serve convolutions to a master",
        description=(
            "Serve convolutions over gRPC until Ctrl-C or SIGTERM. Prints the device, a probe "
            "figure and the address it serves on. A master uses it with "
            "`hetconv train --worker HOST:PORT`."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--listen",
        default="0.0.0.0:50051",
        metavar="HOST:PORT",
        help="address to serve on; port 0 picks a free one",
    )
    p.add_argument(
        "--backend",
        default="auto",
        help="cpu, opencl, cuda, or auto (the fastest present, by a probe)",
    )
    p.add_argument(
        "--device",
        type=int,
        metavar="N",
        help="device number within the backend (see `hetconv devices`); default: its best",
    )
    p.add_argument(
        "--memory-limit",
        type=positive_int,
        metavar="MIB",
        help="device memory one call may use; larger calls run in chunks of images "
        "(default: what the device reports)",
    )
    p.add_argument(
        "--max-request-mib",
        type=positive_int,
        metavar="MIB",
        help="refuse convolution requests larger than this (default: the smaller of 2048 and "
        "half the memory available at start)",
    )
    p.add_argument(
        "--sessions",
        type=positive_int,
        default=4,
        metavar="N",
        help="masters it serves at once: it keeps the forward inputs of N sessions "
        "for their backward passes; with more masters they evict each other's and every "
        "backward pass fails (FAILED_PRECONDITION, naming eviction)",
    )
    p.add_argument(
        "--memory-mib",
        type=positive_int,
        metavar="MIB",
        help="memory budget for everything calls hold: requests in flight and their answers, "
        "saved forward states (each session keeps at most MIB / --sessions) and device scratch; "
        "a call that does not fit is refused (RESOURCE_EXHAUSTED) before anything is allocated "
        "(default: half the memory available at start)",
    )
    p.add_argument(
        "--max-calls",
        type=positive_int,
        metavar="N",
        help="convolution calls in flight at once (default 16); one more is refused at once "
        "(RESOURCE_EXHAUSTED); health checks and Describe are answered beside them",
    )
    p.add_argument(
        "--idle-timeout",
        type=number_at_least(float, 0),
        metavar="S",
        help="end a call whose client sends nothing, or reads nothing of its answer, for S "
        "seconds (DEADLINE_EXCEEDED; default 10; 0: never)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        metavar="N",
        help="BLAS/OpenMP threads for the convolutions (default: one per core, which leaves "
        "nothing to a laptop's owner)",
    )
    p.add_argument(
        "--no-advertise",
        action="store_true",
        help="do not advertise on the LAN by DNS-SD/mDNS (it does whenever it listens beyond "
        "loopback, so that `hetconv train --discover` finds it)",
    )
    p.add_argument(
        "--report-every",
        type=number_at_least(float, 0),
        default=30.0,
        metavar="S",
        help="print one line of what was served (requests, MB in and out, masters) every S "
        "seconds in which anything was; 0: never",
    )
    p.add_argument(
        "--no-startup-probe", action="store_true", help="skip the probe printed at start"
    )
    p.add_argument(
        "--exit-on-stdin-close",
        action="store_true",
        help="also stop when standard input closes (end of file): a launcher that pipes it "
        "takes its workers down with it, even when killed (hetconv train's local workers)",
    )
    security = p.add_argument_group(
        "security",
        "Without a token, anyone who can reach --listen may use this worker (it warns unless "
        "it listens on loopback only).",
    )
    security.add_argument(
        "--token",
        metavar="TOKEN",
        help="refuse (UNAUTHENTICATED) every call, health checks included, that lacks this "
        "shared secret (default: $HETCONV_TOKEN; the flag wins; the variable stays out of `ps`)",
    )
    security.add_argument(
        "--tls-cert",
        metavar="PEM",
        help="serve TLS with this certificate (chain); masters then need --tls-ca",
    )
    security.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    p.set_defaults(func=_run_worker)


def _run_worker(args: argparse.Namespace) -> int:
    from hetconv.security import resolve_token
    from hetconv.worker.auth import WorkerSecurity
    from hetconv.worker.main import limit_threads, run_worker
    from hetconv.worker.service import WorkerConfig

    from .backends import get_backend

    parse_address(args.listen, "--listen")
    if args.memory_mib and args.max_request_mib and args.max_request_mib > args.memory_mib:
        raise ValueError(
            f"--max-request-mib {args.max_request_mib} is more than --memory-mib "
            f"{args.memory_mib}: no request that large could ever be served"
        )
    # Before the backend (whose auto choice probes): a bad token or PEM file fails at once.
    security = WorkerSecurity.from_files(resolve_token(args.token), args.tls_cert, args.tls_key)
    # None: run_worker picks the limit from the memory available and says so.
    limit = args.max_request_mib
    config = WorkerConfig(max_request_bytes=limit << 20) if limit else None
    memory = args.memory_limit << 20 if args.memory_limit else None
    print(limit_threads(args.threads), flush=True)  # before the backend: auto probes
    backend = get_backend(args.backend, device=args.device, memory_limit=memory)
    return run_worker(
        args.listen,
        backend,
        config,
        startup_probe=not args.no_startup_probe,
        security=security,
        sessions=args.sessions,
        exit_on_stdin_close=args.exit_on_stdin_close,
        memory_bytes=args.memory_mib << 20 if args.memory_mib else None,
        idle_timeout=args.idle_timeout,
        max_calls=args.max_calls,
        advertise=not args.no_advertise,
        report_every=args.report_every,
    )


def _add_devices(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "devices",
        help="list the devices this machine can compute on",
        description=(
            "List every backend (cpu, opencl, cuda), whether it can run here and why not, "
            "its devices with the numbers `hetconv worker --backend B --device N` takes, "
            "and a probe figure for each (the paper-50-500 C2 convolution at batch 8, "
            "forward + backward)."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--no-probe", action="store_true", help="list only, do not time")
    p.set_defaults(func=_run_devices)


def _run_devices(args: argparse.Namespace) -> int:
    from .backends import AUTO_PROBE, KNOWN_BACKENDS, BackendUnavailable, backend_class, get_backend

    flops = 3 * AUTO_PROBE.flops_forward
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


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from hetconv.simulations.cli import DESCRIPTION, add_arguments, run

    p = sub.add_parser(
        "simulate",
        help="predict a larger cluster's step time and speedup",
        description=DESCRIPTION,
        formatter_class=_HelpFormatter,
        intermixed=True,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from hetconv.simulations.plan import DESCRIPTION, add_arguments, run

    p = sub.add_parser(
        "plan",
        help="which way to train is predicted fastest on a cluster",
        description=DESCRIPTION,
        formatter_class=_HelpFormatter,
        intermixed=True,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def _shape_chw(text: str) -> tuple[int, int, int]:
    """``C,H,W`` as three positive ints."""
    parts = text.replace("x", ",").split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not C,H,W (three positive integers)")
    return shape  # type: ignore[return-value]


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a trained network as an ONNX graph",
        description=(
            "Write the network of a weights file (what `hetconv train --save` wrote) as an "
            "ONNX graph in evaluation mode, checked with onnx.checker: it takes float32 "
            "`input` (N, C, H, W), normalised as in training, and gives `logits` "
            "(N, classes). Needs the onnx package (pip install 'hetconv[onnx]')."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument("weights", metavar="MODEL.npz", help="the weights file")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--spec", metavar="SPEC.json", help="the network's .json spec")
    which.add_argument("--preset", choices=list(PRESETS), help="the network's preset")
    p.add_argument(
        "--input-shape", type=_shape_chw, required=True, metavar="C,H,W",
        help="the images' channels, height and width",
    )  # fmt: skip
    p.add_argument(
        "--classes", type=positive_int, metavar="N",
        help="a preset's class count (its last fc's outputs; default 10)",
    )  # fmt: skip
    p.add_argument("-o", "--output", required=True, metavar="OUT.onnx", help="where to write")
    p.set_defaults(func=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    import numpy as np

    from .model import load_spec
    from .onnx_export import export_onnx

    if args.spec is not None:
        if args.classes is not None:
            raise ValueError("--classes is for a preset; a spec's last fc says its outputs")
        if not args.spec.endswith(".json"):
            raise ValueError(f"--spec {args.spec}: expected a .json file")
        spec = load_spec(args.spec)
    else:
        spec = load_spec(args.preset, classes=args.classes)
    try:
        with np.load(args.weights, allow_pickle=False) as data:
            weights = {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, AttributeError) as e:
        raise ValueError(f"cannot read weights from {args.weights}: {e}") from None
    export_onnx(spec, weights, args.input_shape, args.output)
    print(f"wrote {args.output}")
    return 0


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="held-out loss and accuracy of saved weights",
        description=(
            "Evaluate saved weights on a dataset's held-out images and print the loss and "
            "accuracy. MODEL is a model .npz (hetconv train's model.npz or --save), a "
            "checkpoint file or folder, or a run folder (its model.npz, else its latest "
            "checkpoint). Inside a run folder, the network and data default to the run's "
            "config.toml; flags given here override it."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="weights: .npz, checkpoint, or run folder")
    p.add_argument("--preset", help=f"network: one of {', '.join(PRESETS)}, or a .json spec")
    p.add_argument(
        "--dataset",
        choices=["synthetic", "cifar10", "cifar100", "folder", "npz", "auto"],
        help="what --data-dir holds (default: inferred; synthetic without --data-dir)",
    )
    p.add_argument("--data-dir", metavar="PATH", help="the dataset, as hetconv train takes it")
    p.add_argument(
        "--holdout-fraction",
        type=positive_float,
        metavar="F",
        help="for data without a held-out part of its own: the fraction training held out",
    )
    p.add_argument(
        "--eval-size",
        type=positive_int,
        metavar="N",
        help="evaluate the first N held-out images (default: all)",
    )
    p.add_argument(
        "--seed",
        type=int,
        help="the training run's seed (the synthetic held-out set is drawn from it)",
    )
    p.add_argument("--batch", type=positive_int, default=200, help="images per forward pass")
    p.set_defaults(func=_run_evaluate)


def _run_evaluate(args: argparse.Namespace) -> int:
    from hetconv.conv import LocalConv
    from hetconv.training.checkpoint import read_weights
    from hetconv.training.rundir import CONFIG_NAME, find_run, read_config
    from hetconv.training.config import TrainConfig
    from hetconv.training.datasets import check_classes, evaluate, load_datasets
    from hetconv.model import Model, load_spec

    if not os.path.exists(args.model):
        raise ValueError(f"{args.model} does not exist: give a model .npz, a checkpoint or a run")
    run = find_run(args.model)
    saved = read_config(run / CONFIG_NAME) if run is not None else {}

    def setting(name: str, default=None):
        given = getattr(args, name.replace("-", "_"))
        return given if given is not None else saved.get(name, default)

    data_dir = setting("data-dir")
    dataset = setting("dataset") or ("auto" if data_dir else "synthetic")
    if args.data_dir and not args.dataset:
        dataset = "auto"  # another dataset than the run's: infer its kind
    preset = setting("preset", "tiny")
    config = TrainConfig(
        preset=preset,
        dataset=dataset,
        data_dir=data_dir,
        holdout_fraction=setting("holdout-fraction") if data_dir else None,
        seed=setting("seed", 0),
        train_size=1 if dataset == "synthetic" else TrainConfig.train_size,
        eval_size=args.eval_size,
        progress=False,
    )
    data = load_datasets(config)
    if not len(data.held_out):
        raise ValueError(f"the {data.kind} dataset has no held-out images to evaluate")
    spec = load_spec(preset)
    check_classes(spec, data.held_out, preset)
    weights, what = read_weights(args.model)
    model = Model(spec, seed=0, executor=LocalConv(), input_shape=data.held_out.image_shape)
    try:
        model.load_state(weights)
    except ValueError as e:
        raise ValueError(f"{what} does not fit network {preset}: {e}") from None
    if run is not None:
        print(f"network and data from {run / CONFIG_NAME}", file=sys.stderr)
    loss, accuracy = evaluate(model, data.held_out, args.batch)
    source = data.kind if data.kind == "synthetic" else data_dir
    print(
        f"{what}: held-out loss {loss:.4f}, accuracy {100 * accuracy:.2f}% on "
        f"{len(data.held_out)} images of {source} ({data.held_out_from}; chance "
        f"{100 / data.held_out.num_classes:.0f}%)"
    )
    return 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="draw a training run's figures",
        description=(
            "Draw the figures of a run folder that hetconv train wrote (runs/NAME), as PNGs in "
            "its figures/: loss and accuracy (training and held-out), the step-time breakdown, "
            "each node's share and compute time, and bytes per step. Needs matplotlib "
            "(pip install 'hetconv[plot]')."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument("run", metavar="RUN", help="the run folder (or its metrics.csv)")
    p.add_argument("--out", metavar="DIR", help="write the PNGs here (default: RUN/figures)")
    p.set_defaults(func=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from hetconv.training.report import ReportUnavailable, draw_report

    try:
        figures = draw_report(args.run, args.out)
    except ReportUnavailable as e:
        raise ValueError(str(e)) from None
    for figure in figures:
        if figure.path is not None:
            print(figure.path)
        else:
            print(f"({figure.name}: none, {figure.skipped})", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetconv",
        description="Train CNNs with their convolutions split across heterogeneous workers.",
    )
    parser.add_argument("--version", action="version", version=f"hetconv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)
    sub.required = True
    _add_train(sub)
    _add_worker(sub)
    _add_evaluate(sub)
    _add_report(sub)
    _add_devices(sub)
    _add_simulate(sub)
    _add_plan(sub)
    _add_export(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    try:
        if getattr(args, "config", None):
            _apply_config(args, argv)
        return args.func(args)
    except KeyboardInterrupt as e:
        from hetconv.training import TrainingInterrupted

        if isinstance(e, TrainingInterrupted):
            saved = [f"model {e.model}"] if e.model is not None else []
            if e.checkpoint is not None:
                saved.append(f"checkpoint {e.checkpoint}")
            where = "saved " + ", ".join(saved) if saved else "nothing saved"
            if e.checkpoint is None:
                where += "; its checkpoint could not be written (see above)"
            resume = getattr(e, "resume_command", "the same command with --resume")
            print(
                f"hetconv: {e}: {where}; to continue from the latest checkpoint: {resume}",
                file=sys.stderr,
            )
            return 128 + e.signum
        hint = (
            " (nothing saved: --no-run-dir without --checkpoint-dir keeps nothing of a run "
            "stopped early)"
            if getattr(args, "no_run_dir", False) and not getattr(args, "checkpoint_dir", None)
            else ""
        )
        print(f"hetconv: interrupted{hint}", file=sys.stderr)
        return 130
    except (ValueError, OSError, FloatingPointError) as e:
        # Bad input is the user's to fix: one line naming it, not a traceback, with the
        # prefix argparse gives the command's usage errors.
        print(f"hetconv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        # A worker that failed or could not be reached or started: named, no traceback.
        print(f"hetconv {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
