"""``hetconv train``: the flags (:mod:`.train_flags`) into the run's configuration objects, which
refuse what does not go together (:class:`~hetconv.training.TrainConfig`,
:class:`~hetconv.training.rundir.RunFolderConfig`,
:class:`~hetconv.master.config.ClusterConfig`), then the run: through
:mod:`hetconv.training` with :class:`~hetconv.conv.LocalConv` (``--local``, which imports
nothing of the master) or the master's cluster."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from hetconv.argtypes import parse_address
from hetconv.optim import SGDConfig
from hetconv.security import read_pem, resolve_token
from hetconv.training import TrainConfig, TrainingInterrupted, train
from hetconv.training.checkpoint import CheckpointDir
from hetconv.training.config import TRAIN_SIZE_WITH_DATA
from hetconv.training.rundir import RunDir, RunFolderConfig
from hetconv.training.trace import RunFileError

from .common import HelpFormatter
from .train_config import write_run_config
from .train_flags import FIRST_TIER, MORE_OPTIONS, RUN_DIR_VARIABLE, add_train_arguments

DESCRIPTION = (
    "Train a CNN preset on the synthetic set (offline, the default) or your data "
    "(--data-dir: CIFAR-10/100, an image folder, an .npz). "
    "The master (this process) trains every non-convolutional layer; each "
    "convolution's kernels are split across the workers named with --worker or "
    "--workers-file, and the master itself, in proportion to a probe of each one's "
    "speed on the layer's real shape (with --split images, every node trains the whole "
    "network on its share of each batch's images instead; by default, with workers named or "
    "discovered, whichever the cost model predicts faster). With no worker named and no "
    "--local, two local worker processes are started on loopback (the embedded default)."
)

#: Flags that mean nothing without workers: (dest, its default, what --local has none of).
_NOT_LOCAL = (
    ("wire_format", "float32", "so nothing goes on the wire: drop --wire-format"),
    ("stages", "auto", "so nothing is fused: drop --stages"),
    ("kernels", "auto", "so no kernel is resident: drop --kernels"),
    ("replicate", "auto", "so nothing is replicated: drop --replicate"),
    ("overlap", "auto", "so nothing overlaps: drop --overlap"),
    ("head", "auto", "so the head is not split: drop --head"),
    ("split", "auto", "so nothing is split: drop --split"),
    ("exchange", "auto", "so no gradient is exchanged: drop --exchange"),
    ("alone_check", "on", "so there is no cluster to check: drop --alone-check"),
)
#: Flags of a split by kernels, which ``--split images`` has none of: (dest, its default).
_KERNEL_SPLIT_ONLY = (
    ("wire_format", "float32"), ("stages", "auto"), ("kernels", "auto"), ("replicate", "auto"),
    ("overlap", "auto"), ("head", "auto"), ("start_ahead", "on"), ("master_block", "share"),
)  # fmt: skip


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a network", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    add_train_arguments(p)
    p.set_help_tiers(FIRST_TIER, MORE_OPTIONS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    folder = RunFolderConfig(
        root=args.run_dir,
        name=args.name,
        enabled=not args.no_run_dir,
        resume=args.resume,
        checkpoint_dir=args.checkpoint_dir,
        tensorboard=args.tensorboard,
    )
    run_dir = folder.choose()
    config = train_config(args, run_dir)
    addresses = [parse_address(a) for a in args.worker]
    if args.workers_file:
        from hetconv.master.membership import read_workers_file

        addresses += read_workers_file(args.workers_file)
    token = resolve_token(args.token)  # --token, else $HETCONV_TOKEN
    _check_where(args, addresses)
    cluster_config = None if args.local else cluster_config_of(args, addresses, token)
    created, previous_config = False, None
    if run_dir is not None:
        created = run_dir.make()
        if run_dir.config.is_file():  # a resume: kept until the run is known to continue
            previous_config = run_dir.config.read_bytes()
    try:
        if run_dir is not None:  # in the try: a refusal here leaves no run folder either
            write_run_config(run_dir.config, args)
        result = _train(args, config, cluster_config, addresses)
    except (TrainingInterrupted, RunFileError) as e:  # a full disk too: the resume command
        e.resume_command = _resume_command(args, run_dir)
        raise
    except BaseException as e:
        if created:
            run_dir.discard_if_empty()
        elif previous_config is not None and isinstance(e, (ValueError, OSError)):
            # A resume refused (another run's settings, say) leaves the run's config as it was.
            run_dir.config.write_bytes(previous_config)
        raise
    if run_dir is not None:
        print(
            f"run folder {run_dir.path}: `hetconv report {shlex.quote(os.fspath(run_dir.path))}` "
            "draws its figures",
            file=sys.stderr,
        )
    return _final_checkpoint_status(config.checkpoint_dir, result.steps)


def train_config(args: argparse.Namespace, run_dir: RunDir | None) -> TrainConfig:
    """The run's :class:`TrainConfig` from the flags, its outputs in ``run_dir`` unless named."""
    if args.data_dir and args.train_size is not None:  # given, even at the default's value
        raise ValueError(TRAIN_SIZE_WITH_DATA)
    return TrainConfig(
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
        trace=args.trace or (run_dir and os.fspath(run_dir.trace)),
        run_dir=run_dir and os.fspath(run_dir.path),
        metrics=run_dir and os.fspath(run_dir.metrics),
        tensorboard=run_dir and args.tensorboard and os.fspath(run_dir.tensorboard) or None,
        save=args.save or (run_dir and os.fspath(run_dir.model)),
        load=args.load,
        progress=not args.no_progress,
        checkpoint_dir=args.checkpoint_dir or (run_dir and os.fspath(run_dir.checkpoints)),
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
    )


def _check_where(args: argparse.Namespace, addresses: list[str]) -> None:
    """Refuse flags that do not fit where the convolutions run: a cluster's flags with
    ``--local`` (which has no configuration of its own), TLS for the embedded workers."""
    if args.tls_ca is not None:
        read_pem(args.tls_ca, "TLS CA certificate (--tls-ca)")  # one line now, not mid-start
        if not addresses and not args.local and not args.discover:
            raise ValueError("--tls-ca needs --worker/--workers-file: local workers serve no TLS")
    if args.engine == "cuda" and not args.local:
        raise ValueError("--engine cuda trains the whole model on this machine's GPU with "
                         "--local only (a worker serves a GPU: --backend cuda)")  # fmt: skip
    if args.split == "images" and not args.local:
        _check_image_split(args)
    elif "=" in args.split and not args.local:
        _check_cut_split(args)
    elif args.split == "kernels" and args.exchange != "auto":
        raise ValueError("--exchange says how a split by images sums its gradients: with "
                         "--split kernels nothing is; drop --exchange")  # fmt: skip
    if args.exchange == "ring" and args.tls_ca is not None:
        raise ValueError("--exchange ring sends gradients worker to worker over plain gRPC, "
                         "which TLS (--tls-ca) would not cover; use --exchange master")  # fmt: skip
    if not args.local:
        return
    if addresses or args.discover:
        raise ValueError("--local runs no workers; drop --worker/--workers-file/--discover")
    if args.spot_check_every is not None or args.spot_check_sample is not None:
        raise ValueError("--local runs no workers, so nothing to spot-check: drop --spot-check-*")
    for dest, default, why in _NOT_LOCAL:
        if getattr(args, dest) != default:
            raise ValueError(f"--local runs no workers, {why}")


def split_of(args: argparse.Namespace, addresses: list[str]) -> tuple[str, str]:
    """(the split ``--split`` resolves to: kernels, images or auto, why). ``auto`` chooses by
    the cost model at start (:mod:`hetconv.master.splitchoice`) only with workers named or
    discovered, and is the split by kernels where the measurements could not choose: the
    embedded default (its workers share this machine's cores, and it shows the kernel split),
    ``--deterministic`` (no timing may choose), or a flag of the kernel split given."""
    if args.split != "auto":
        return args.split, "--split"
    if not addresses and not args.discover:
        return "kernels", "the embedded default's workers share this machine"
    if args.deterministic:
        return "kernels", "--deterministic: no timing chooses"
    for dest, default in _KERNEL_SPLIT_ONLY:
        if getattr(args, dest) != default:
            return "kernels", f"--{dest.replace('_', '-')} is the split by kernels'"
    return "auto", "the cost model's choice at start"


def _check_cut_split(args: argparse.Namespace) -> None:
    """Refuse what ``--split LAYER=images`` cannot do: a layer the network cannot be cut
    after, the flags of a split by kernels, the exchange through the master, TLS."""
    from hetconv.cutsplit import cut_after, cut_layer
    from hetconv.onnx_import import load_network

    layer = cut_layer(args.split)
    for dest, default in _KERNEL_SPLIT_ONLY:
        if getattr(args, dest) != default:
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"--split {args.split} splits no layer by kernels: drop {flag}")
    if args.exchange == "master" or args.tls_ca is not None:
        raise ValueError(f"--split {args.split} sums the first part's gradient by the ring "
                         "among the workers (plain gRPC): not with --exchange master or "
                         "--tls-ca")  # fmt: skip
    cut_after(load_network(args.preset).spec, layer)


def _check_image_split(args: argparse.Namespace) -> None:
    """Refuse what ``--split images`` cannot do: the flags of a split by kernels, a network
    with batch norm (naming the layer)."""
    from hetconv.imagesplit import refuse_batchnorm
    from hetconv.onnx_import import load_network

    for dest, default in _KERNEL_SPLIT_ONLY:
        if getattr(args, dest) != default:
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"--split images splits no layer by kernels: drop {flag}")
    ring = args.exchange != "master" and args.tls_ca is None
    try:
        refuse_batchnorm(load_network(args.preset).spec)
    except ValueError as e:
        if not ring:  # the ring sums its statistics among the workers
            raise ValueError(f"{e}, or sum them among the workers: --exchange ring") \
                from None  # fmt: skip


def cluster_config_of(args: argparse.Namespace, addresses: list[str], token: str | None):
    """The master's :class:`~hetconv.master.config.ClusterConfig` from the flags; the defaults
    that depend on others (``--shares``, ``--rebalance-every``) resolved into ``args`` too, so
    the run's config.toml holds them."""
    from hetconv.formats import format_named
    from hetconv.master.config import ClusterConfig

    if args.shares is None:
        # The embedded default demonstrates the split on one machine, where every "link"
        # is loopback: by compute, so its workers take part as the README says.
        embedded = not addresses and not args.discover
        args.shares = "compute" if args.deterministic or embedded else "link"
    if args.deterministic and args.rebalance_every:
        # A ClusterConfig ignores rebalance_every when deterministic; given as a flag, it is
        # a contradiction.
        raise ValueError(
            "--deterministic never rebalances (shares must not follow measured speed): "
            "drop --rebalance-every"
        )
    if args.rebalance_every is None:
        args.rebalance_every = 0 if args.deterministic else 20
    return ClusterConfig(
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


class _SaidFirst:
    """Standard error, with ``line`` written before the run's first words (a run refused
    before it starts says its one line only)."""

    def __init__(self, line: str | None):
        self._line = line

    def write(self, text: str) -> int:
        if self._line:
            line, self._line = self._line, None
            sys.stderr.write(line + "\n")
        return sys.stderr.write(text)

    def __getattr__(self, name: str):
        return getattr(sys.stderr, name)


def _train(args: argparse.Namespace, config: TrainConfig, cluster_config, addresses: list[str]):
    """Train where the flags say: in this process, on the workers found on the LAN, on the
    named workers, or on local worker processes (the embedded default)."""
    from hetconv.backends import resolve_engine

    args.engine, says = resolve_engine(args.engine)  # auto: onednn where it loads, else cpu
    log = _SaidFirst(says)
    if args.local:
        from hetconv.conv import LocalConv
        from hetconv.devicelocal import DeviceLocalConv

        local = DeviceLocalConv if args.engine == "cuda" else LocalConv  # the whole step there
        return train(config, local(args.engine), log)
    from hetconv.master.cluster import Cluster
    from hetconv.master.ring import image_split_class
    from hetconv.master.splitchoice import SplitChoice

    # --split images: the whole network on every node, each on its share of the images,
    # the gradients summed as --exchange says; auto: whichever the cost model predicts faster
    split, _ = split_of(args, addresses)
    if "=" in split:  # --split LAYER=images
        from hetconv.cutsplit import cut_layer
        from hetconv.master.cutsplit import cut_split_class

        layer = cut_layer(split)
        split = "cut"
    cluster_class = {
        "cut": lambda: cut_split_class(layer),
        "images": lambda: image_split_class(args.exchange),
        "auto": lambda: SplitChoice.with_exchange(args.exchange, args.alone_check == "on"),
        "kernels": lambda: Cluster,
    }[split]()
    if args.discover:
        from .discover import train_discovered

        wait = args.discover_wait
        if says:
            print(says, file=sys.stderr, flush=True)
        return train_discovered(
            config, cluster_config, addresses, wait, cluster_class, backend=args.engine
        )
    if addresses:
        with cluster_class(addresses, backend=args.engine, config=cluster_config) as cluster:
            return train(config, cluster, log)
    from hetconv.master.launch import EmbeddedCluster

    with EmbeddedCluster(
        args.local_workers, cluster_config, cluster_class, backend=args.engine
    ) as cluster:
        return train(config, cluster, log)


def _spot_check_config(args: argparse.Namespace):
    from hetconv.master.spotcheck import DEFAULT_EVERY, SpotCheckConfig

    every = DEFAULT_EVERY if args.spot_check_every is None else args.spot_check_every
    if every == 0 and args.spot_check_sample is not None:
        raise ValueError("--spot-check-every 0 checks nothing: drop --spot-check-sample")
    sample = args.spot_check_sample
    if sample is None:
        return SpotCheckConfig(every=every, seed=args.seed)
    return SpotCheckConfig(
        every=every, kernels=sample, images=sample, channels=sample, ranges=sample, seed=args.seed
    )


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
