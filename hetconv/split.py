"""A replicated first block split by images among the workers (``--replicate split``).

With a replicated block (:mod:`hetconv.replica`) every node computes the first block on every
image: at paper-150-800 that is 24-33 % of a node's work, repeated on every node. Split, each
worker computes it only on its own images (``SplitPlan``: the batch in contiguous runs, in
proportion to the workers' speed) and the workers exchange the outputs node to node, so every
worker still runs the next layer's stage on the whole batch. Backward, each worker's stage
gives an input-gradient part over every image; it sends every other worker the rows of that
worker's images and sums the rows it gets for its own, then back-propagates the sum through
the block on its own images. The master keeps the whole block as before (its own kernels'
part goes back through it on every image), so its link carries only each worker's images, not
the whole batch: the exchange runs between the workers.

The sum is exact to float32 round-off: the block's backward is linear in the incoming gradient
and per image, so the block's kernel gradient over the batch is the sum over the workers of
its gradient over their images of every worker's rows, plus the master's over every image of
its own.

Nothing lost (:mod:`hetconv.master.cluster`): the master holds the block's whole output and,
for a lost worker's slice, computes its stage itself. So a worker lost in forward leaves its
peers waiting for its output, which the master sends them as that worker (PutPart); lost in
backward, the master sends the others that worker's input-gradient rows of their images from
its own computation of the slice, fetches the rows the others computed for the lost worker's
images (FetchPart), adds its own slice computation's rows of those images, and back-propagates
that through its block on those images. A part a worker already has from a source is not taken
twice, so a lost worker's parts that did arrive count once.

With ``--replicate split_all`` the master is one of the peers too (``MASTER``, no address: it
serves nothing): it computes the block on its own images only and puts that output into every
worker, and fetches each worker's own images' output (FetchPart) for its own stage piece.
Backward, it puts each worker the rows of that worker's images of its own input-gradient part
and fetches the rows every worker computed for its images, which its stage sends first. It still
covers a lost worker: it computes that worker's images' block itself when it has not got them,
and takes the lost worker's images' gradient through the block as above. On the reference
networks this moves the block's output and its gradient rows over the master's link (about 3.5
MB a step at paper-150-800, batch 16, four workers) to take most of the block off the master.

The exchange is plain gRPC between workers, with the worker's own token: a worker serving TLS
refuses to split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetconv.proto import worker_pb2 as pb


def split_images(batch: int, weights) -> list[int]:
    """``batch`` images in contiguous runs, one per weight, in proportion to the weights
    (largest remainders), each at least one image.

    Raises:
        ValueError: fewer images than weights, or a weight that is not positive.
    """
    weights = [float(w) for w in weights]
    if not weights or any(not w > 0 for w in weights):
        raise ValueError(f"split weights must be positive, got {weights}")
    if batch < len(weights):
        raise ValueError(f"{batch} images cannot be split among {len(weights)} workers")
    spare = batch - len(weights)  # one each first
    total = sum(weights)
    exact = [spare * w / total for w in weights]
    counts = [int(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: spare - sum(counts)]:
        counts[i] += 1
    return [c + 1 for c in counts]


def left_out(
    workers, unreachable: dict[str, dict[str, str]], failed: dict[str, str] | None = None
) -> dict[str, str]:
    """Worker -> why it is left out of a split's exchange, from a reach check at start:
    ``unreachable``, worker -> {peer it could not reach: why}; ``failed``, worker -> why it
    did not answer the check (left out first). An exchange needs both directions, so a pair
    fails where either cannot reach the other; the fewest workers go: the one in most failing
    pairs first (a tie: the one others failed to reach most often, then the later named),
    until no pair among those left fails. ``workers``: their addresses, in order."""
    order = {w: i for i, w in enumerate(workers)}
    out = dict(failed or {})
    pairs: dict[frozenset, list[str]] = {}
    reached_not = dict.fromkeys(order, 0)
    for worker, peers in unreachable.items():
        for peer, why in peers.items():
            if worker == peer or worker not in order or peer not in order:
                continue
            reached_not[peer] += 1
            pairs.setdefault(frozenset((worker, peer)), []).append((worker, peer, why))
    while True:
        live = {p: whys for p, whys in pairs.items() if not p & out.keys()}
        if not live:
            return out
        count = dict.fromkeys(order, 0)
        for pair in live:
            for w in pair:
                count[w] += 1
        worst = max(order, key=lambda w: (count[w], reached_not[w], order[w]))
        reasons = []
        for pair, whys in live.items():
            if worst not in pair:
                continue
            for src, dst, why in whys:
                if src == worst:
                    reasons.append(f"cannot reach {dst} ({why})")
                else:
                    reasons.append(f"{src} cannot reach it ({why})")
        out[worst] = "; ".join(reasons)


#: Values of each sender's block output a FetchPart sample asks for at most.
MAX_SAMPLE = 4096


def part_sample(part: np.ndarray, seed: int, node: int, count: int) -> np.ndarray:
    """``count`` values of node ``node``'s images' block output ``part``, at places drawn from
    ``seed`` (the same on the worker that received it and on the master that checks it: the
    sender, which put it before the seed was drawn, cannot know them), as float32."""
    rng = np.random.default_rng([seed, node])
    flat = np.ascontiguousarray(part).reshape(-1)
    return flat[rng.integers(0, flat.size, count)].astype(np.float32)


def row_sample(rows: np.ndarray, seed: int, node: int, count: int) -> np.ndarray:
    """``count`` values of the input-gradient rows node ``node`` put into a receiver
    (``rows``: its rows of the receiver's images), all of one image (:func:`sampled_image`),
    at places drawn from ``seed`` (:func:`part_sample`): the master recomputes that image."""
    return part_sample(rows[sampled_image(seed, rows.shape[0])], seed, node, count)


def sampled_image(seed: int, images: int) -> int:
    """The image (of ``images``) a :func:`row_sample` of ``seed`` takes its values from."""
    return int(np.random.default_rng([seed, 2**32]).integers(images))


#: The master's address in a :class:`SplitPlan` (``split_all``): it serves nothing.
MASTER = ""


@dataclass(frozen=True)
class SplitPlan:
    """Which node computes the block on which images: (address, start, count) in image
    order, tiling the batch; the master, when it is a peer, as :data:`MASTER`."""

    peers: tuple[tuple[str, int, int], ...]
    round: int = 0  # the master's count of split blocks in the session (SplitBlock.round)

    @classmethod
    def of(cls, addresses, counts, round_: int = 0) -> SplitPlan:
        """A plan of ``addresses``' ``counts`` images in turn; each at least one, but the
        first's (the master's, as the cluster and the simulator place it), which may be none:
        it then computes none of the block, fetches every worker's output and sends its
        gradient rows (``--master-block none``)."""
        peers, start = [], 0
        for i, (address, count) in enumerate(zip(addresses, counts, strict=True)):
            if int(count) < (0 if i == 0 else 1):
                raise ValueError(f"split peer {address or 'master'} gets {count} images")
            peers.append((address, start, int(count)))
            start += int(count)
        if len(peers) < 2:
            raise ValueError("a split needs at least two nodes")
        if len({a for a, _, _ in peers}) != len(peers):
            raise ValueError(f"a split names a worker twice: {[a for a, _, _ in peers]}")
        return cls(tuple(peers), round_)

    @property
    def addresses(self) -> list[str]:
        return [a for a, _, _ in self.peers]

    @property
    def master(self) -> int | None:
        """The master's index in the plan (None: it is not a peer)."""
        return self.addresses.index(MASTER) if MASTER in self.addresses else None

    @property
    def workers(self) -> list[str]:
        """The workers' addresses, in plan order."""
        return [a for a in self.addresses if a != MASTER]

    @property
    def batch(self) -> int:
        _, start, count = self.peers[-1]
        return start + count

    def node(self, address: str) -> int:
        """``address``'s index in the plan."""
        return self.addresses.index(address)

    def images(self, address: str) -> slice:
        """The images ``address`` computes the block on."""
        _, start, count = self.peers[self.node(address)]
        return slice(start, start + count)

    def request_for(self, address: str) -> pb.SplitBlock:
        """What ``address``'s ReplicaForward carries."""
        return pb.SplitBlock(
            node=self.node(address),
            round=self.round,
            peers=[
                pb.SplitPeer(address=a, start=s, count=c, master=a == MASTER)
                for a, s, c in self.peers
            ],
        )


__all__ = [
    "MASTER",
    "MAX_SAMPLE",
    "SplitPlan",
    "left_out",
    "part_sample",
    "row_sample",
    "sampled_image",
    "split_images",
]
