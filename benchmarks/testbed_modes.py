"""The modes of ``benchmarks/testbed.py``: each a way to train through the workers, as extra
``hetconv train`` flags over the paper's kernel split (:data:`BASE`). A new mode is one line of
:data:`MODES`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from hetconv.simulations.testbed import SHARED_LINK, SWITCHED_LINK

#: The cost model's fabric for each testbed link.
FABRIC = {SWITCHED_LINK: "switched", SHARED_LINK: "wifi"}
ALL = "all"


@dataclass(frozen=True)
class Mode:
    """One way to train through the workers: extra ``hetconv train`` flags.

    ``flags`` may hold ``{network}``, replaced by ``switched`` or ``wifi`` (what the testbed's
    link is to ``hetconv train --network``). ``needs``: a flag ``hetconv train --help`` must
    list for the mode to run. ``in_all``: part of the ``all`` row. ``over_base``: the flags
    go over the paper's kernel split (:data:`BASE`); else they are all ``hetconv train`` is
    given (``default``: none, whatever its defaults are)."""

    name: str
    flags: tuple[str, ...]
    about: str
    needs: str | None = None
    in_all: bool = True
    over_base: bool = True

    def arguments(self, link: str) -> list[str]:
        """``hetconv train``'s flags: the kernel split's (:data:`BASE`) unless not
        :attr:`over_base`, then the mode's, which override them (argparse keeps an option's
        last value)."""
        flags = (*BASE, *self.flags) if self.over_base else self.flags
        return [flag.replace("{network}", FABRIC[link]) for flag in flags]


#: The paper's kernel split, which every mode changes one thing of: shares by probe, plain
#: convolutions on the workers, kernels sent every step, nothing replicated or overlapped, the
#: fully connected layer on the master (``hetconv train``'s own defaults are link-aware shares,
#: and fused stages, resident kernels, the replicated block, overlap and the split head where
#: the cost model picks them).
BASE = (
    "--shares", "compute", "--stages", "unfused", "--kernels", "sent", "--replicate", "off",
    "--overlap", "off", "--head", "master",
)  # fmt: skip
#: Every exact mode's flags at once (link-aware shares, fused stages, resident kernels, the
#: replicated first block), without overlap.
EXACT = (
    "--shares", "link", "--network", "{network}", "--stages", "fused", "--kernels", "resident",
    "--replicate", "first",
)  # fmt: skip
#: every exact mode at once with the split head (exact_head), and the variants built on it
EXACT_HEAD = (*EXACT, "--overlap", "auto", "--head", "split")
#: exact_head's modes with every node's share equal instead of planned from probes and links
EQUAL_SHARES = (
    "--shares", "compute", "--stages", "fused", "--kernels", "resident", "--replicate", "first",
    "--overlap", "auto", "--head", "split", "--deterministic",
)  # fmt: skip
MODES: tuple[Mode, ...] = (
    Mode("kernel_split", (), "the paper's: every conv's kernels split by probe", in_all=False),
    Mode("float16", ("--wire-format", "float16"), "activations and their gradients as float16"),
    Mode("bfloat16", ("--wire-format", "bfloat16"), "the same as bfloat16", in_all=False),
    Mode("link_shares", ("--shares", "link", "--network", "{network}"), "link-aware shares"),
    Mode("fused", ("--stages", "fused"), "workers run the layers after their conv", "--stages"),
    Mode(
        "resident",
        ("--stages", "fused", "--kernels", "resident"),
        "fused, and workers keep their kernel slices and update them",
        "--kernels",
    ),
    Mode(
        "replica",
        ("--stages", "fused", "--replicate", "first"),
        "fused, and every node computes the first block from the images",
        "--replicate",
    ),
    Mode(
        "overlap",
        ("--stages", "fused", "--overlap", "on"),
        "fused, and workers send each image group's output while computing the next",
        "--overlap",
    ),
    Mode(
        "head",
        ("--stages", "fused", "--kernels", "resident", "--head", "split"),
        "fused, resident, and the last stage's workers keep the fc's columns and answer logits",
        "--head",
    ),
    Mode(
        "exact_whole",
        EXACT,
        "every exact mode but overlap: link shares, fused, resident, replicated first block",
        "--replicate",
        in_all=False,
    ),
    Mode(
        "exact",
        (*EXACT, "--overlap", "auto"),
        "every exact mode at once: link shares, fused, resident, replicated, overlap (where "
        "a worker's answer is over one message)",
        "--overlap",
        in_all=False,
    ),
    Mode(
        "exact_bfloat16",
        (*EXACT, "--overlap", "auto", "--wire-format", "bfloat16"),
        "exact, with activations and their gradients as bfloat16 on the wire",
        "--overlap",
        in_all=False,
    ),
    Mode(
        "exact_head",
        EXACT_HEAD,
        "every exact mode with the split head: link shares, fused, resident, replicated, "
        "overlap (auto), the last stage answering logits (what `hetconv train` does by default)",
        "--head",
        in_all=False,
    ),
    Mode(
        "exact_head_equal",
        EQUAL_SHARES,
        "exact_head with every node's share equal (--deterministic), not planned from probes",
        "--head",
        in_all=False,
    ),
    Mode(
        "exact_head_serial_probe",
        (*EXACT_HEAD, "--probe-nodes", "one-at-a-time"),
        "exact_head with the nodes probed one at a time before training (the paper's way), "
        "not all at once",
        "--probe-nodes",
        in_all=False,
    ),
    Mode(
        "exact_head_settle",
        (*EXACT_HEAD, "--settle-steps", "4"),
        "exact_head with the nodes' shares settled once on their measured finish times after "
        "four steps and two that warm up (use --warmup 8: the steps timed then come after the "
        "two that warm up after a move)",
        "--settle-steps",
        in_all=False,
    ),
    Mode(
        "exact_head_split",
        (*EXACT_HEAD, "--replicate", "split"),
        "exact_head with the replicated block split by images among the workers, who exchange "
        "its outputs and gradients node to node (switched links)",
        "--replicate",
        in_all=False,
    ),
    Mode(
        "exact_head_split_settle",
        (*EXACT_HEAD, "--replicate", "split", "--settle-steps", "4"),
        "exact_head_split with the shares settled once on the nodes' measured finish times "
        "after four steps (use --warmup 8)",
        "--settle-steps",
        in_all=False,
    ),
    Mode(
        "exact_head_split_all",
        (*EXACT_HEAD, "--replicate", "split_all"),
        "exact_head_split with the master one of the block's peers: it computes the block on "
        "its own share of the images and exchanges parts with the workers",
        "--replicate",
        in_all=False,
    ),
    Mode(
        "exact_head_split_none",
        (*EXACT_HEAD, "--replicate", "split_all", "--master-block", "none"),
        "exact_head_split_all with the master computing none of the block: it fetches every "
        "worker's output and sends them its input-gradient rows",
        "--master-block",
        in_all=False,
    ),
    Mode(
        "exact_head_split_all_settle",
        (*EXACT_HEAD, "--replicate", "split_all", "--settle-steps", "4"),
        "exact_head_split_all with the shares settled once on the nodes' measured finish times "
        "after four steps (use --warmup 8)",
        "--settle-steps",
        in_all=False,
    ),
    Mode(
        "exact_head_late",
        (*EXACT_HEAD, "--start-ahead", "off"),
        "exact_head with the second layer's stage calls sent when the master reaches it, not "
        "started with the replicated block",
        "--start-ahead",
        in_all=False,
    ),
    Mode(
        "exact_head_bfloat16",
        (*EXACT_HEAD, "--wire-format", "bfloat16"),
        "exact_head, with activations and their gradients as bfloat16 on the wire",
        "--head",
        in_all=False,
    ),
    Mode(
        "default",
        (),
        "`hetconv train` with no mode flag: whatever its defaults are",
        in_all=False,
        over_base=False,
    ),
    Mode(
        "unchecked",
        ("--spot-check-every", "0"),
        "`hetconv train` with no mode flag but spot checks off (what the checks cost)",
        "--spot-check-every",
        in_all=False,
        over_base=False,
    ),
    Mode(
        "kernels",
        ("--split", "kernels"),
        "`hetconv train` with no mode flag but `--split kernels`: the defaults' split by "
        "kernels, whatever `--split auto` would choose (its prediction against the run)",
        "--split",
        in_all=False,
        over_base=False,
    ),
    Mode(
        "images",
        ("--split", "images"),
        "the whole network split by images: every node trains the model on its share of the "
        "batch, the gradients summed through the master (heterogeneous data parallelism)",
        "--split",
        in_all=False,
        over_base=False,
    ),
    Mode(
        "images_ring",
        ("--split", "images", "--exchange", "ring"),
        "the whole network split by images, the weights kept on the workers and the gradients "
        "summed by a ring among them, spot-checked by sketches of each worker's own gradient",
        "--exchange",
        in_all=False,
        over_base=False,
    ),
    *(
        Mode(
            f"cut_{layer}",
            ("--split", f"{layer}=images"),
            f"the network cut after {layer}'s block (vgg11's: `--split {layer}=images`): the "
            "layers up to it split by images among the workers with the ring, the rest on the "
            "master",
            "--split",
            in_all=False,
            over_base=False,
        )
        for layer in ("conv4", "conv5", "conv6")
    ),
    Mode(
        "images_ring_unchecked",
        ("--split", "images", "--exchange", "ring", "--spot-check-every", "0"),
        "images_ring without spot checks (what the ring's checks cost)",
        "--exchange",
        in_all=False,
        over_base=False,
    ),
)
DEFAULT_MODES = (
    "kernel_split", "float16", "link_shares", "fused", "resident", "replica", "overlap", "head",
    "exact_whole", "exact", "exact_head", ALL,
)  # fmt: skip


def modes_named(names: Sequence[str]) -> list[str]:
    """``names`` checked against :data:`MODES` (and ``all``).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    known = [m.name for m in MODES] + [ALL]
    for name in names:
        if name not in known:
            raise ValueError(f"mode {name!r} is not one of {', '.join(known)}")
    return list(dict.fromkeys(names))


def train_help() -> str:
    """What ``hetconv train --help-all`` prints (to see which modes' flags exist); ``--help``
    where a hetconv from before ``--help-all`` listed every flag there."""
    command = [sys.executable, "-I", "-m", "hetconv", "train"]
    done = subprocess.run([*command, "--help-all"], capture_output=True, text=True)
    if done.returncode != 0:
        done = subprocess.run([*command, "--help"], capture_output=True, text=True, check=True)
    return done.stdout


def runnable_modes(names: Sequence[str], help_text: str) -> tuple[list[Mode], list[str]]:
    """The modes of ``names`` that ``hetconv train`` offers, in order (``all`` as a mode of
    the flags of every offered ``in_all`` mode), and a note for each one left out."""
    table = {m.name: m for m in MODES}
    offered = {m.name for m in MODES if m.needs is None or m.needs in help_text}
    chosen, notes = [], []
    for name in names:
        if name == ALL:
            parts = [m for m in MODES if m.in_all and m.name in offered]
            if not parts:
                notes.append("all: no mode offered to combine")
                continue
            flags = tuple(flag for m in parts for flag in m.flags)
            chosen.append(Mode(ALL, flags, " + ".join(m.name for m in parts), in_all=False))
        elif name in offered:
            chosen.append(table[name])
        else:
            notes.append(f"{name}: skipped, `hetconv train --help` lists no {table[name].needs}")
    return chosen, notes
