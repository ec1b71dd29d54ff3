"""The cost of hetconv's own whole network split by images (``hetconv train --split
images``): the parameter-server step of :mod:`hetconv.dataparallel` without overlap, the images
the master sends, and, with ``--exchange ring``, the ring among the workers
(:mod:`hetconv.ring`) and batch norm's statistics summed over it. Asked by ``hetconv plan``,
the testbed's prediction and the tests; the master chooses its exchange with
:func:`hetconv.ring.choose`, and ``--split auto`` between the split by kernels and by images
with :func:`choose_split`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from hetconv.costmodel import WIFI, SimCluster, SimNode
from hetconv.dataparallel import (
    ALGORITHMS,
    PARAMETER_SERVER,
    RING,
    CollectiveCosts,
    DataParallelResult,
    batchnorm_layers,
    exchange_seconds,
    simulate_data_parallel,
)
from hetconv.imagesplit import IMAGES, KERNELS
from hetconv.model import CIFAR_INPUT
from hetconv.onnx_import import Network, load_network
from hetconv.ring import (
    BUCKET_BYTES,
    MASTER,
    MASTER_RANGE_MARGIN,
    doubling_rounds,
    master_link_bytes,
    ring_exchange_seconds,
)
from hetconv.ring import RING as RING_EXCHANGE
from hetconv.ringcheck import check_pass_seconds


def simulate_image_split(
    cluster: SimCluster,
    network: str | Sequence[Mapping],
    batch: int,
    comp_s: float,
    costs: CollectiveCosts | None = None,
    image_seconds: Sequence[float] | None = None,
    batches: Sequence[int] | None = None,
    input_shape: tuple[int, int, int] | None = None,
    image_bytes: int | None = None,
    exchange: str = PARAMETER_SERVER,
    overlap: bool = True,
    check: Callable[[int, float], float] | None = None,
) -> DataParallelResult:
    """One step of hetconv's own whole-network split by images (``hetconv train --split
    images``): every node trains the whole model on its slice of the batch and the master sums
    the gradients, a parameter server without overlap (:func:`simulate_data_parallel` with
    ``ps``, ``overlap=False``, the same arguments); and, as the master holds the data, it also
    sends every worker its images before they compute, ``image_bytes`` each (default one byte
    per value: palette8, what normalised 8-bit pixels travel as), on its own link (on Wi-Fi,
    the medium).

    ``exchange="ring"`` (``--exchange ring``): the workers that get images keep the weights
    and sum the gradients by a ring among themselves, the master's put into the first and the
    sum back (:func:`hetconv.ring.ring_exchange_seconds`) in place of the parameter server;
    the master's link carries the parameters twice, whatever the workers. With ``overlap`` (the
    workers' buckets summed during backward, as they run by default, the master's part put
    into rank 0 bucket by bucket as its backward gives them), the ring runs during the
    workers' backward, the master computing or not. Where the cluster lets the master
    compute and ``batches`` are not given, both are simulated, the master with a range and
    without, and the master's range taken where predicted
    :data:`hetconv.ring.MASTER_RANGE_MARGIN` faster, as the master cuts its ranges
    (:func:`hetconv.ring.master_range_pays`). A network with batch norm runs only so: the
    master computes no images, and each batch norm layer adds two sums a step, each
    gathered in the fewest puts (:func:`batchnorm_sums_seconds`).

    ``check(images, beside_s)`` (the ring's spot checks on; None: off): what the master's
    recomputation of drawn ranges adds to a step on average where the workers take ``images``
    and it runs beside ``beside_s`` (:func:`hetconv.ring.master_range_pays`' ``check``):
    beside the workers' step where the master computes no range, beside the ring past the
    passes after its own range; and every step the checks' passes over the gradient
    (:func:`hetconv.ringcheck.check_pass_seconds`): each worker's sketch of its own gradient
    before it answers, then the master's digest and sketch of the sum, and of its own part
    where it computed one. The master's range is weighed with them, as the master weighs
    it."""
    costs = costs or CollectiveCosts()
    if exchange not in ALGORITHMS:
        raise ValueError(f"exchange {exchange!r} is not one of {', '.join(ALGORITHMS)}")
    named = load_network(network) if isinstance(network, str) else Network(list(network))
    norms = batchnorm_layers(named.spec)
    if norms and exchange != RING:
        raise ValueError("a network with batch norm is split by images only with the ring")
    if norms and cluster.workers:
        cluster = replace(cluster, master_compute=False)
    args = (network, batch, comp_s, costs, named, norms, input_shape, image_bytes, overlap)
    if exchange == RING and cluster.master_compute and cluster.workers and batches is None:
        ranks = len(cluster.workers) + 1
        theirs = image_seconds[1:] if image_seconds is not None and len(image_seconds) == ranks \
            else image_seconds  # fmt: skip
        steps = [_image_step(cluster, *args, image_seconds, None, exchange),
                 _image_step(replace(cluster, master_compute=False), *args, theirs, None,
                             exchange)]  # fmt: skip
        with_master, without = (_checked(got, batch, costs, check) for got in steps)
        pays = with_master.step_s < without.step_s * (1 - MASTER_RANGE_MARGIN)
        return with_master if pays else without
    got = _image_step(cluster, *args, image_seconds, batches, exchange)
    return _checked(got, batch, costs, check) if exchange == RING else got


def _checked(got: DataParallelResult, batch: int, costs, check) -> DataParallelResult:
    """``got`` (a ring's step) with its spot checks (:func:`simulate_image_split`'s
    ``check``): the passes every step, and the drawn ranges' recomputation on average."""
    if check is None or not any(got.batches[1:]):
        return got
    own = bool(got.batches[0])  # the master's own range: after it, beside the ring
    passes = (3 if own else 2) * check_pass_seconds(got.gradient_bytes, costs)
    recompute = check(batch - got.batches[0], got.comm_s if own else got.step_s)
    return replace(got, step_s=got.step_s + passes + recompute)


def _image_step(cluster, network, batch, comp_s, costs, named, norms, input_shape, image_bytes,
                overlap, image_seconds, batches, exchange) -> DataParallelResult:  # fmt: skip
    """:func:`simulate_image_split` on ``cluster`` as it is (the master computing or not)."""
    got = simulate_data_parallel(
        cluster, network, batch, comp_s, PARAMETER_SERVER, False, costs, image_seconds,
        batches, input_shape,
    )  # fmt: skip
    if exchange == RING:
        used = tuple(w for w, b in zip(cluster.workers, got.batches[1:], strict=True) if b)
        # with overlap the master's part goes into rank 0 bucket by bucket as its backward
        # gives them: the ring runs during the workers' backward, the master computing or not
        overlapped = bool(overlap and used)
        computes = cluster.master_compute and not overlapped
        ring_s = ring_exchange_seconds(replace(cluster, workers=used, master_compute=computes),
                                       got.gradient_bytes, costs)  # fmt: skip
        whole = ring_s
        if overlapped:
            theirs = got.batches[1:]
            seconds = image_seconds
            if seconds is not None and len(seconds) == len(cluster.workers) + 1:
                seconds = seconds[1:]
            ring_s -= ring_hidden_seconds(
                replace(cluster, master_compute=False), network, sum(theirs), comp_s, costs,
                seconds, theirs, input_shape, got.gradient_bytes, kernels_first=not norms,
            )  # fmt: skip
            if cluster.master_compute and whole > 0:  # its part, hidden as the ring is
                into = ring_exchange_seconds(replace(cluster, workers=used),
                                             got.gradient_bytes, costs) - whole  # fmt: skip
                ring_s += into * min(1.0, ring_s / whole)
        ring_s += batchnorm_sums_seconds(used, norms, costs)
        got = replace(
            got, algorithm=RING, step_s=got.step_s - got.comm_s + ring_s, comm_s=ring_s,
            exchange_s=ring_s,
            master_bytes=master_link_bytes(got.gradient_bytes, len(used),
                                           RING_EXCHANGE if used else MASTER),
        )  # fmt: skip
    c, h, w = input_shape or named.input_shape or CIFAR_INPUT
    per_image = c * h * w if image_bytes is None else image_bytes
    nbytes = sum(got.batches[1:]) * per_image  # master first (0 where it computes nothing)
    port = min(cluster.master.bytes_per_s, costs.tcp_bytes_per_s)
    if cluster.fabric == WIFI:
        port = min(port, cluster.medium_bytes_per_s)
    images_s = nbytes / port
    return replace(
        got,
        step_s=got.step_s + images_s,
        comm_s=got.comm_s + images_s,
        exchange_s=got.exchange_s + images_s,
        master_bytes=got.master_bytes + nbytes,
    )


def ring_hidden_seconds(cluster, network, batch, comp_s, costs, image_seconds, batches,
                        input_shape, nbytes: float,
                        kernels_first: bool = False) -> float:  # fmt: skip
    """The seconds of the workers' ring that backward hides (the master computing nothing):
    the ring after backward less what runs past it bucket by bucket, each bucket ready once
    every worker's backward has passed its layers (``kernels_first``: its convolutions'
    kernel gradients, computed before their input gradients where no batch norm sum waits),
    as DDP's buckets are modelled (:func:`simulate_data_parallel` with ``ring`` and overlap,
    the workers the ranks, buckets of :data:`hetconv.ring.BUCKET_BYTES`)."""
    buckets = replace(costs, bucket_bytes=BUCKET_BYTES, first_bucket_bytes=BUCKET_BYTES)
    during = simulate_data_parallel(
        cluster, network, batch, comp_s, RING, True, buckets, image_seconds, batches,
        input_shape, kernels_first=kernels_first,
    )  # fmt: skip
    after = exchange_seconds(cluster, nbytes, RING, costs)
    return max(0.0, after - (during.step_s - during.compute_s))


#: Seconds of a whole core a batch norm sum among the workers costs
#: (:func:`batchnorm_sums_seconds`): its own software (the sum's setup, the values' split and
#: join, the computing thread's hand-offs), each round's wake-up of the rank waiting for its
#: part, and each small part, both ends: a frame on the peer's sum port
#: (:mod:`hetconv.worker.summesh`; 49 us of CPU in all on loopback). Fitted to resnet20 batch
#: 64 on 4 workers at 0.36 of a core on the scaled testbed: 2.9-3.6 ms a sum waited doubling
#: (2 rounds of 1 part, 42 sums; 0.12-0.15 s of a step), with the waits for the slowest
#: worker in it (each sum ends when the last worker's part comes). As RingPart calls (gRPC at
#: both ends) the same sums took 10.5-15 ms each.
SUM_S, ROUND_S, PUT_S = 0.5e-3, 0.3e-3, 0.05e-3
#: Sums over the ring a batch norm layer takes a step (``hetconv.imagesplit``'s
#: ``_SyncBatchNorm``): forward's values and squares at once, then backward's two sums at once.
SUMS_PER_LAYER = 2


def batchnorm_sums_seconds(
    workers: Sequence[SimNode], norms: int, costs: CollectiveCosts | None = None
) -> float:
    """Seconds a step of ``norms`` batch norm layers split by images over ``workers`` (the
    ring's) waits on their statistics: :data:`SUMS_PER_LAYER` sums a layer, each gathered in
    the fewest puts (:meth:`hetconv.worker.ring.RingCalls.sum64`: every worker into every other
    at once on three workers or fewer, else ``ceil(log2(workers))`` rounds of one put,
    :func:`hetconv.ring.all_gather_doubling`): each put's software out and in on each worker's
    core, each sum's and each round's (:data:`SUM_S`, :data:`ROUND_S`, :data:`PUT_S`, at the
    share of a core ``costs`` were scaled to), and each round half a round trip and a message's
    cost (their bytes are few)."""
    costs = costs or CollectiveCosts()
    ranks = len(workers)
    if ranks < 2:
        return 0.0
    hop = costs.message_s + max(w.rtt_s for w in workers) / 2
    puts = min(ranks - 1, doubling_rounds(ranks))
    rounds = 1 if puts == ranks - 1 else puts
    each = (SUM_S + rounds * ROUND_S + puts * PUT_S) / costs.core + rounds * hop
    return SUMS_PER_LAYER * norms * each


#: How much faster (a fraction of the kernel split's predicted step) a split by images must
#: be predicted before it is chosen.
SPLIT_MARGIN = 0.10


def choose_split(
    kernels_s: float, images_s: dict[str, float], allowed: Sequence[str],
    ruled_out: dict[str, str] | None = None, margin: float = SPLIT_MARGIN,
) -> dict:  # fmt: skip
    """The split ``--split auto`` takes: ``{"split": kernels|images, "exchange": ...,
    "predicted_s": {way: step}, "why": one line}`` from the kernel split's predicted step and
    each exchange's split by images (only those ``allowed``; chosen where predicted faster by
    ``margin``). ``ruled_out``: for an exchange not allowed, what rules it out and the flag
    that would allow it; where it is predicted faster by the margin than the way taken,
    ``why`` says so and names the flag."""
    choice = _choose_split(kernels_s, images_s, allowed, margin)
    taken = images_s.get(choice["exchange"], kernels_s) if choice["exchange"] else kernels_s
    for exchange, reason in (ruled_out or {}).items():
        seconds = images_s.get(exchange)
        if exchange not in allowed and seconds and seconds < taken * (1 - SPLIT_MARGIN):
            choice["why"] += (f"; the split by images with the {_way(exchange)} is predicted "
                              f"{taken / seconds:.2f}x faster, but {reason}")  # fmt: skip
    return choice


def _choose_split(
    kernels_s: float, images_s: dict[str, float], allowed: Sequence[str], margin: float
) -> dict:
    usable = {k: v for k, v in images_s.items() if k in allowed}
    predicted = {KERNELS: kernels_s, **{f"{IMAGES} ({k})": v for k, v in images_s.items()}}
    if not usable:
        refused = ", ".join(sorted(set(images_s) - set(allowed))) or "none"
        return {
            "split": KERNELS, "exchange": None, "predicted_s": predicted,
            "why": f"no split by images may run here (exchanges ruled out: {refused})",
        }  # fmt: skip
    exchange = min(usable, key=lambda k: (usable[k], k != MASTER))
    best = usable[exchange]
    faster = kernels_s / best if best > 0 else float("inf")
    if best < kernels_s * (1 - margin):
        split, why = IMAGES, f"predicted {faster:.2f}x faster than the split by kernels"
    else:
        split, exchange = KERNELS, None
        why = (
            f"the split by images ({_way(min(usable, key=usable.get))}) is predicted "
            f"{faster:.2f}x the split by kernels' speed, under the {1 / (1 - margin):.2f}x "
            "a switch needs"
        )
    return {"split": split, "exchange": exchange, "predicted_s": predicted, "why": why}


def _way(exchange: str) -> str:
    if exchange.startswith("cut:"):  # hetconv.cutcost.CUT_WAY
        return f"network cut after {exchange[4:]}'s block, the rest on the master"
    return "gradients through the master" if exchange == MASTER else "ring among the workers"


def describe_choice(choice: dict) -> str:
    """One console line: the split chosen, each way's predicted step, and why."""
    ways = ", ".join(f"{name} {seconds:.3g} s" for name, seconds in choice["predicted_s"].items())
    chosen = choice["split"]
    if choice["exchange"] is not None:
        chosen += f" ({_way(choice['exchange'])})"
    return (
        f"split (auto): by {chosen}: {choice['why']} (predicted per step: {ways}; "
        "--split kernels|images overrides)"
    )


__all__ = [
    "PUT_S",
    "ROUND_S",
    "SPLIT_MARGIN",
    "SUMS_PER_LAYER",
    "SUM_S",
    "batchnorm_sums_seconds",
    "choose_split",
    "ring_hidden_seconds",
    "describe_choice",
    "simulate_image_split",
]
