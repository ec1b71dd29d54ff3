"""The ring exchange of a step split by images (``hetconv train --split images --exchange
ring``): what the master and its workers share of it.

The workers keep the weights and the momentum buffers (placed from the master's copy at the
start, and whenever a worker (re)joins or its copy is in doubt) and sum their gradients among
themselves by a ring all-reduce (:func:`all_reduce`): a reduce-scatter then an all-gather, each
of ``ranks - 1`` rounds in which every rank sends one chunk of the flat gradient to the next
rank and takes one from the one before. Each chunk is summed in a fixed order (the rank that
starts it, then round by round), and the all-gather copies every summed chunk as it is, so
every rank ends with the same sum, bit for bit (whatever the :func:`segments` a chunk
travels in: each is sent on as soon as it has come, so the rounds overlap), and applies the
same SGD update (:func:`hetconv.optim.sgd_update`, the master's optimizer) to the same
weights: every copy stays bitwise equal. Each rank reports a digest of its weights after the
update (:func:`digest`); one that differs from the master's copy is re-placed.

The master is not a rank (it serves no calls): it puts its own range's gradient into rank 0,
which adds it to its own before the ring starts, and each rank answers its chunk of the sum
(:func:`chunk_bounds`), which the master joins to update its copy. The master's link then
carries the parameters' bytes twice per step whatever the number of workers
(:func:`master_link_bytes`), where the exchange through the master carries them twice per
worker, and a master that is a rank, four times ``(ranks - 1) / ranks``; where its images do
not pay for its part (:func:`master_range_pays`), it computes none and puts nothing in.

The workers run the ring bucket by bucket while backward goes on (:func:`buckets`; each
value keeps its chunk of the whole vector, :func:`bucket_chunks`, so the sum is the same bit
for bit), and their digests cover a sample of the weights drawn by the master each step
(:func:`digest`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np

#: ``--exchange``: auto (the cost model's choice for the measured links), the gradients
#: through the master (every worker gets the parameters and sends back its gradient each
#: step), or a ring among the workers.
AUTO, MASTER, RING = "auto", "master", "ring"
EXCHANGES = (AUTO, MASTER, RING)
#: The round of the master's part, put into rank 0 before the ring's first round.
MASTER_ROUND = 1 << 20
#: Rounds kept for each sum of a step: the gradient's from 0, the k-th batch norm sum's
#: (:func:`hetconv.imagesplit.sync_batchnorm`) from ``k * ROUNDS_PER_SUM`` (a ring of at most
#: ``ROUNDS_PER_SUM / 2`` workers).
ROUNDS_PER_SUM = 256
#: The most workers a ring holds (its gradient's rounds within :data:`ROUNDS_PER_SUM`).
MAX_RANKS = ROUNDS_PER_SUM // 2
#: A worker's answer: ``ring`` is ``[outcome, digest as 4 16-bit values, then the seconds
#: of its step spent in batch norm's sums, in the gradient's ring after the passes, in the
#: update after it and in the digest]`` (:data:`RING_SECONDS`), then the sketches of its own
#: gradient where asked (:mod:`hetconv.ringcheck`, :data:`SKETCH_VALUES`; else zeros); the
#: outcomes.
OWN, SUMMED, DONE = 0, 1, 2  # its own gradient (the ring failed); the sum; updated, no sum
RING_SECONDS = ("batchnorm_seconds", "ring_seconds", "update_seconds", "digest_seconds")
SKETCH_VALUES = 17  # hetconv.ringcheck: 8 sketches, the absolute sum, 2 digests of 4 x 16 bits
RING_ANSWER_VALUES = 5 + len(RING_SECONDS) + SKETCH_VALUES


def flat(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The arrays, in order, as one fresh float32 vector."""
    if not arrays:
        return np.zeros(0, np.float32)
    return np.concatenate([np.asarray(a, np.float32).ravel() for a in arrays])


def unflat(vector: np.ndarray, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """The arrays of ``shapes`` that :func:`flat` made ``vector`` of (views of it)."""
    sizes = [math.prod(s) for s in shapes]
    if sum(sizes) != vector.size:
        raise ValueError(f"{vector.size} values for shapes holding {sum(sizes)}")
    ends = np.cumsum([0, *sizes])
    return [vector[a:b].reshape(s) for a, b, s in zip(ends[:-1], ends[1:], shapes, strict=True)]


def chunk_bounds(length: int, ranks: int) -> list[tuple[int, int]]:
    """``ranks`` contiguous (start, stop) chunks tiling ``length`` values, the first ones one
    value longer where it does not divide."""
    base, extra = divmod(length, ranks)
    bounds, start = [], 0
    for r in range(ranks):
        stop = start + base + (r < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def rounds(ranks: int) -> int:
    """Rounds of a ring all-reduce over ``ranks``: reduce-scatter, then all-gather."""
    return 2 * (ranks - 1)


def schedule(rank: int, ranks: int, round_: int) -> tuple[int, int, bool]:
    """(the chunk ``rank`` sends in ``round_``, the chunk it receives, whether it adds what it
    receives (reduce-scatter) or takes it as it is (all-gather))."""
    if round_ < ranks - 1:
        return (rank - round_) % ranks, (rank - round_ - 1) % ranks, True
    t = round_ - (ranks - 1)
    return (rank + 1 - t) % ranks, (rank - t) % ranks, False


#: Bytes of a segment of a ring's chunk (:func:`segments`): each goes on as soon as the
#: previous rank's segment of the round before has come and been added, so one segment's
#: encoding, sending and adding at both ends overlaps the next one's transfer.
SEGMENT_BYTES = 1 << 20


def segments(start: int, stop: int, values: int = 0) -> list[tuple[int, int]]:
    """The (start, stop) segments of the chunk ``start .. stop``: of ``values`` each, the last
    one shorter (``values`` 0: the chunk whole); none where it is empty."""
    if stop <= start:
        return []
    if values <= 0:
        return [(start, stop)]
    return [(a, min(a + values, stop)) for a in range(start, stop, values)]


def all_reduce(
    vector: np.ndarray,
    rank: int,
    ranks: int,
    send: Callable[[int, int, np.ndarray], None],
    receive: Callable[[int, int], np.ndarray],
    bounds: Sequence[tuple[int, int]] | None = None,
    segment_values: int = 0,
) -> np.ndarray:
    """Sum ``vector`` (float32, this rank's) over the ring in place: ``send(round, segment,
    part)`` to the next rank, ``receive(round, segment)`` the previous rank's part of that
    round (each raises when the ring fails). Every rank returns the same values, bit for bit.
    ``bounds``: the chunks (default :func:`chunk_bounds`; a bucket's: :func:`bucket_chunks`);
    an empty one is neither sent nor waited for (both ranks know it). Each chunk travels in
    :func:`segments` of ``segment_values`` (0: whole), each sent on as soon as it has come
    and been added (the chunk a rank receives in a round is the one it sends in the next), so
    ``send`` may return before its part has gone: each value is added in the same order
    whatever the segments, so the sum does not change.

    The parts sent are views of ``vector``, not copies: this rank writes none of them again
    before the next rank has taken it (a chunk is written again only with a sum that holds
    what this rank sent of it), but the caller must see every put through before it writes
    ``vector``."""
    bounds = chunk_bounds(vector.size, ranks) if bounds is None else bounds
    if len(bounds) != ranks:
        raise ValueError(f"{len(bounds)} chunks for a ring of {ranks}")
    total = rounds(ranks)
    if not total:
        return vector
    first, _, _ = schedule(rank, ranks, 0)
    for s, (a, b) in enumerate(segments(*bounds[first], segment_values)):
        send(0, s, vector[a:b])
    for round_ in range(total):
        _, into, adds = schedule(rank, ranks, round_)
        for s, (a, b) in enumerate(segments(*bounds[into], segment_values)):
            got = receive(round_, s)
            if got.shape != (b - a,):
                raise ValueError(f"round {round_}: a part of {got.shape}, expected ({b - a},)")
            if adds:
                np.add(vector[a:b], got, out=vector[a:b])
            else:
                vector[a:b] = got
            if round_ + 1 < total:  # the next round sends the chunk this one received
                send(round_ + 1, s, vector[a:b])
    return vector


def buckets(sizes: Sequence[int], ranks: int, bucket_values: int) -> list[tuple[int, int]]:
    """The flat gradient's buckets for the ring overlapped with backward: contiguous (start,
    stop) ranges of whole parameters (``sizes``: each one's values, in the model's order), in
    the order backward fills them (the last parameters first), each closed once it holds
    ``bucket_values``; at most :data:`ROUNDS_PER_SUM` rounds in all (larger buckets where
    more would not fit)."""
    ends = np.cumsum([0, *sizes]).tolist()
    most = max(1, ROUNDS_PER_SUM // max(1, rounds(ranks)))
    values = max(1, int(bucket_values))
    while True:
        out, stop = [], ends[-1]
        for i in range(len(sizes) - 1, -1, -1):
            if stop - ends[i] >= values:
                out.append((ends[i], stop))
                stop = ends[i]
        if stop > 0 or not out:
            out.append((0, stop))
        if len(out) <= most:
            return out
        values *= 2


def bucket_chunks(bucket: tuple[int, int], length: int, ranks: int) -> list[tuple[int, int]]:
    """A bucket's part of each chunk of the whole vector's ring (:func:`chunk_bounds` of
    ``length``), relative to the bucket: each value keeps its chunk, so it is summed in the
    same order, and the bucket's sum is the whole ring's, bit for bit."""
    start, stop = bucket
    return [(min(max(a, start), stop) - start, min(max(b, start), stop) - start)
            for a, b in chunk_bounds(length, ranks)]  # fmt: skip


def all_gather(
    vector: np.ndarray,
    rank: int,
    ranks: int,
    send: Callable[[int, int, np.ndarray], None],
    receive: Callable[[int, int], np.ndarray],
) -> list[np.ndarray]:
    """Every rank's ``vector`` (float32, one size), in rank order, on every rank: ``ranks -
    1`` rounds, each passing on the one received in the round before (its own first), whole
    (segment 0: :func:`all_reduce`'s ``send`` and ``receive``)."""
    pieces: list[np.ndarray | None] = [None] * ranks
    pieces[rank] = vector
    for round_ in range(ranks - 1):
        send(round_, 0, pieces[(rank - round_) % ranks])
        got = receive(round_, 0)
        if got.shape != vector.shape:
            raise ValueError(f"round {round_}: a part of {got.shape}, expected {vector.shape}")
        pieces[(rank - round_ - 1) % ranks] = got
    return pieces


def all_to_all(
    vector: np.ndarray,
    rank: int,
    ranks: int,
    send: Callable[..., None],
    receive: Callable[[int, int], np.ndarray],
) -> list[np.ndarray]:
    """:func:`all_gather`'s pieces in one round: this rank puts its ``vector`` into every
    other rank at once (``send(round, segment, part, to)``, its round this rank's number),
    then takes each other rank's (``receive(round, 0)``, the round the sender's number). Every
    rank holds the same pieces in rank order, as the gather gives them, after one message's
    latency instead of ``ranks - 1`` one after another."""
    if ranks > ROUNDS_PER_SUM:
        raise ValueError(f"a ring of {ranks}: at most {ROUNDS_PER_SUM} ranks put at once")
    pieces: list[np.ndarray | None] = [None] * ranks
    pieces[rank] = vector
    for k in range(1, ranks):
        send(rank, 0, vector, (rank + k) % ranks)
    for k in range(1, ranks):
        source = (rank - k) % ranks
        got = receive(source, 0)
        if got.shape != vector.shape:
            raise ValueError(f"rank {source}: a part of {got.shape}, expected {vector.shape}")
        pieces[source] = got
    return pieces


def doubling_rounds(ranks: int) -> int:
    """Rounds of :func:`all_gather_doubling` over ``ranks``: ``ceil(log2(ranks))``."""
    return max(0, ranks - 1).bit_length()


def all_gather_doubling(
    vector: np.ndarray,
    rank: int,
    ranks: int,
    send: Callable[..., None],
    receive: Callable[[int, int], np.ndarray],
) -> list[np.ndarray]:
    """:func:`all_gather`'s pieces in :func:`doubling_rounds` rounds (Bruck's all-gather): in
    round ``k`` this rank puts the pieces it holds (its own and the next ``2**k - 1`` ranks',
    as many as the rank it goes to lacks) into rank ``rank - 2**k`` as one part
    (``send(round, segment, part, to)``) and takes rank ``rank + 2**k``'s (``receive(round,
    0)``). Every rank holds the same pieces in rank order, after ``ceil(log2(ranks))`` puts
    out and in where the gather and :func:`all_to_all` take ``ranks - 1``: on a capped core
    each put's software is what a small sum costs."""
    held = [vector]  # the pieces of ranks rank, rank + 1, ... (mod ranks)
    for k in range(doubling_rounds(ranks)):
        distance = 1 << k
        count = min(distance, ranks - distance)
        send(k, 0, np.concatenate(held[:count]), (rank - distance) % ranks)
        got = receive(k, 0)
        if got.shape != (count * vector.size,):
            raise ValueError(f"round {k}: a part of {got.shape}, expected "
                             f"({count * vector.size},)")  # fmt: skip
        held += np.split(got, count)
    return [held[(r - rank) % ranks] for r in range(ranks)]


def split64(values: np.ndarray) -> np.ndarray:
    """float64 ``values`` as float32 (high parts, then the remainders): 48 bits of them."""
    high = values.astype(np.float32)
    return np.concatenate([high, (values - high).astype(np.float32)])


def join64(pieces: Sequence[np.ndarray]) -> np.ndarray:
    """The float64 sum, in order, of :func:`split64`'s pieces (the same on every rank)."""
    total = None
    for piece in pieces:
        high, low = np.split(piece.astype(np.float64), 2)
        value = high + low
        total = value if total is None else total + value
    return total


def own64(values):
    """:func:`join64` of :func:`split64`'s pieces of ``values`` alone (a ring of one's sum),
    in their array module (a device's values stay there): the same float64 values, bit for
    bit."""
    high = values.astype(np.float32)
    low = (values - high).astype(np.float32)
    return high.astype(np.float64) + low.astype(np.float64)


def digest(arrays: Sequence[np.ndarray], seed: int = 0, share: float = 1.0) -> bytes:
    """8 bytes that differ, but by chance, where any value of ``arrays`` differs (BLAKE2b of
    their float32 bytes, in order). With ``seed`` (not 0) and ``share`` below 1, only a sample:
    blocks of :data:`DIGEST_BLOCK` values of each array, each taken with chance ``share``,
    drawn from ``seed`` (:func:`digest_blocks`; the master draws a seed per step, so a
    worker cannot know which blocks count); arrays of one block or less always whole."""
    h = hashlib.blake2b(digest_size=8)
    rng = np.random.default_rng(seed) if seed and share < 1 else None
    for a in arrays:
        values = np.ascontiguousarray(a, np.float32).reshape(-1)
        if rng is None or values.size <= DIGEST_BLOCK:
            h.update(values)
            continue
        for block in digest_blocks(rng, values.size, share):
            h.update(values[block * DIGEST_BLOCK : (block + 1) * DIGEST_BLOCK])
    return h.digest()


#: Values in a block of a sampled digest (:func:`digest`).
DIGEST_BLOCK = 4096


def digest_blocks(rng: np.random.Generator, size: int, share: float) -> np.ndarray:
    """The blocks of an array of ``size`` values a sampled digest covers: each with chance
    ``share``, at least one."""
    count = -(-size // DIGEST_BLOCK)
    taken = np.flatnonzero(rng.random(count) < share)
    return taken if taken.size else rng.integers(count, size=1)


def digest_values(d: bytes) -> np.ndarray:
    """A digest as 4 float32 values of 16 bits each (exact in float32)."""
    return np.frombuffer(d, dtype="<u2").astype(np.float32)


def digest_of_values(values: np.ndarray) -> bytes:
    """:func:`digest_values` undone."""
    return np.asarray(values, np.float32).astype("<u2").tobytes()


def momentum_name(parameter: str) -> str:
    """The name a parameter's momentum buffer travels under when weights are placed."""
    return f"momentum:{parameter}"


def buffer_name(buffer: str) -> str:
    """The name a buffer (batch norm's running statistics) travels under when placed."""
    return f"buffer:{buffer}"


# -- the cost -----------------------------------------------------------------------------


def master_link_bytes(parameter_bytes: float, workers: int, exchange: str) -> float:
    """Gradient and parameter bytes through the master's link per step, both ways: through
    the master, the parameters out and the gradients back, per worker; the ring, the master's
    gradient into rank 0 and the sum back (none where no worker takes part)."""
    if workers < 1:
        return 0.0
    return 2.0 * parameter_bytes * (workers if exchange == MASTER else 1)


#: Gradient bytes a bucket of the ring overlapped with backward holds at least (the
#: request's ``bucket_bytes``; 0 sums the whole gradient after backward).
BUCKET_BYTES = 4 * 2**20


#: Bytes of ring parts per second of a whole core that a part's software takes at both ends
#: together: a frame on the peer's sum port (:mod:`hetconv.worker.summesh`: the kernel's
#: copies out and in, the check), 1 MB frames on loopback 0.41 ms of CPU each in all (as
#: RingPart calls, gRPC and the message's encoding and decoding, it was 1.9 ms).
PART_BYTES_PER_S = 2.5e9


def part_seconds(nbytes: float, costs=None) -> float:
    """CPU seconds of parts of ``nbytes`` (:data:`PART_BYTES_PER_S`), at the share of a core
    ``costs`` were scaled to (:meth:`hetconv.dataparallel.CollectiveCosts.scaled`: as its
    adds)."""
    from hetconv.dataparallel import CollectiveCosts

    costs = costs or CollectiveCosts()
    return nbytes / (PART_BYTES_PER_S * costs.sum_bytes_per_s / CollectiveCosts().sum_bytes_per_s)


def all_reduce_seconds(
    workers, nbytes: float, costs=None, segment_bytes: float = SEGMENT_BYTES
) -> float:
    """Seconds of :func:`all_reduce` of ``nbytes`` over ``workers``' workers (a
    :class:`~hetconv.costmodel.SimCluster`, the master computing nothing), links idle. In whole
    chunks, ``2 (ranks - 1)`` rounds one after another, each a chunk's transfer, its parts'
    software at both ends (:func:`part_seconds`) and a message's latency
    (:func:`hetconv.dataparallel.exchange_seconds`' ring, and the software). In segments of
    ``segment_bytes``, a round's segment goes once the same segment of the round before has
    come: each rank's link and core work at once, the slower of the two sets the pace (or the
    segments' messages, where they cost more), and one segment's transfer and software and a
    latency fill the pipeline. The scaled testbed (0.36 of a core, 87 MB/s links,
    paper-150-800 on 4 workers): whole chunks took 0.45 s where the links needed 0.24 s."""
    from hetconv.costmodel import WIFI
    from hetconv.dataparallel import RING as DP_RING
    from hetconv.dataparallel import CollectiveCosts, exchange_seconds

    costs = costs or CollectiveCosts()
    ranks = len(workers.workers)
    if ranks < 2:
        return 0.0
    chunk = nbytes / ranks
    software = part_seconds(chunk, costs)
    count = math.ceil(chunk / segment_bytes) if segment_bytes > 0 else 1
    if count < 2:
        return exchange_seconds(workers, nbytes, DP_RING, costs) + rounds(ranks) * software
    round_s = chunk / min(min(w.bytes_per_s for w in workers.workers), costs.tcp_bytes_per_s)
    if workers.fabric == WIFI:
        round_s = max(round_s, ranks * chunk / workers.medium_bytes_per_s)
    latency = costs.message_s + max(w.rtt_s for w in workers.workers) / 2
    adds = (ranks - 1) * chunk / costs.sum_bytes_per_s
    busy = rounds(ranks) * max(round_s, software, count * costs.message_s)
    return busy + (round_s + software) / count + latency + adds


def ring_exchange_seconds(
    cluster, nbytes: float, costs=None, backward_s: float | None = None,
    bucket_bytes: float = BUCKET_BYTES, segment_bytes: float = SEGMENT_BYTES,
) -> float:  # fmt: skip
    """Seconds of the ring exchange on ``cluster`` (a :class:`~hetconv.costmodel.SimCluster`)
    the step waits for, links idle: the master's gradient into rank 0 (where the master
    computes), a ring all-reduce over the workers in segments of ``segment_bytes``
    (:func:`all_reduce_seconds`), the sum back to the master (each rank its chunk, at
    once). With ``backward_s`` (the workers' backward), the ring runs bucket by
    bucket as backward fills them (buckets of ``bucket_bytes``, filling evenly over backward,
    as :func:`hetconv.dataparallel.simulate_data_parallel` models DDP's): only what runs past
    backward's end counts; not where the master computes (rank 0 adds its whole part, put
    after the master's range, before any bucket; where the master puts it bucket by bucket
    as its backward goes, the ring is the workers' alone: ``master_compute=False``)."""
    from hetconv.costmodel import WIFI
    from hetconv.dataparallel import CollectiveCosts

    costs = costs or CollectiveCosts()
    if not cluster.workers:
        return 0.0
    workers = replace(cluster, master_compute=False)
    if backward_s is None or bucket_bytes <= 0 or cluster.master_compute:
        ring = all_reduce_seconds(workers, nbytes, costs, segment_bytes)
    else:
        count = max(1, math.ceil(nbytes / bucket_bytes))
        took, t = all_reduce_seconds(workers, nbytes / count, costs, segment_bytes), 0.0
        for k in range(count):
            t = max(t, backward_s * (k + 1) / count) + took
        ring = t - backward_s
    port = min(cluster.master.bytes_per_s, cluster.workers[0].bytes_per_s, costs.tcp_bytes_per_s)
    if cluster.fabric == WIFI:
        port = min(port, cluster.medium_bytes_per_s)
    latency = costs.message_s + cluster.workers[0].rtt_s / 2
    into = (nbytes / port + latency) if cluster.master_compute else 0.0
    # the sum back: every rank's chunk at once, on its own link and the master's
    master_port = min(cluster.master.bytes_per_s, costs.tcp_bytes_per_s)
    slowest = min(min(w.bytes_per_s for w in cluster.workers), costs.tcp_bytes_per_s)
    back = max(nbytes / master_port, nbytes / len(cluster.workers) / slowest)
    if cluster.fabric == WIFI:
        back = max(back, nbytes / cluster.medium_bytes_per_s)
    return into + ring + back + latency


#: How much shorter (a fraction of the step without it) the step with the master's range
#: must be predicted before the master computes one with the ring: the predictions of the two
#: scatter by a few per cent from step to step.
MASTER_RANGE_MARGIN = 0.02


def master_range_pays(
    batch: int,
    seconds_per_image: Sequence[float],
    part_s: float,
    after_s: float,
    during: Callable[[Sequence[int]], float],
    check: Callable[[int, float], float] | None = None,
    overlapped: bool = False,
) -> tuple[bool, float, float]:
    """Whether the master computing a range of the batch is predicted to make the ring's
    step shorter: (it does, the step with it, the step without), in the mean over steps.
    ``seconds_per_image``: the master's first, then the workers'; ``part_s``: its
    gradient's way into rank 0; ``during(images)``: the seconds of the ring past the
    workers' passes where they compute ``images`` (each worker's count) and sum bucket by
    bucket during backward; ``check(images, beside_s)``: what the master's spot checks add
    to a step on average where the workers take ``images`` and the recomputation runs beside
    ``beside_s`` (None: no checks).

    With it, the ranges finish together, the master's ``part_s`` early
    (:func:`hetconv.imagesplit.image_ranges`); where its part goes into rank 0 bucket by
    bucket as its backward gives them (``overlapped``: :class:`hetconv.master.ringparts.
    MasterBuckets`), the ring runs during the workers' backward as without it
    (``during``), and the part, crossing rank 0's link beside its share of the ring, is
    hidden in the same proportion as the ring (the scaled testbed, paper-150-800 on 4
    workers: at batch 64 the ring mostly hidden, its range took 2.19-2.40 s a step against
    2.57-2.65 s without; at batch 16 the ring mostly past the passes, 1.19-1.39 s against
    1.08-1.12 s); else the ring runs once backward has ended (``after_s``: rank 0 adds the
    master's whole part before any bucket). Without it, the workers share the batch and
    the ring runs during their backward (``during``). The sum back to the master costs both
    alike. A checked step's recomputation runs on the master after its own range, beside
    the ring (what outlasts the ring added to the step), where without a range of its own
    it runs beside the workers' passes and their ring (what outlasts them added). Which
    steps are checked stays secret either way: the choice is made from the chance, never
    from the step's draw. It pays where the step with it is predicted
    :data:`MASTER_RANGE_MARGIN` shorter."""
    from hetconv.imagesplit import image_ranges

    if len(seconds_per_image) < 2:
        return True, 0.0, math.inf
    fixed = [part_s] + [0.0] * (len(seconds_per_image) - 1)
    ranges = image_ranges(batch, seconds_per_image, fixed)
    ends = [f + s * c for f, s, (_, c) in zip(fixed, seconds_per_image, ranges, strict=True) if c]
    ring_with = after_s
    if overlapped:  # rank 0's link carries the part beside its ring: hidden alike
        ring_with = during([c for _, c in ranges[1:]])
        ring_with += part_s * min(1.0, ring_with / after_s) if after_s > 0 else part_s
    with_s = max(ends) + ring_with
    workers = list(seconds_per_image[1:])
    alone = image_ranges(batch, workers)
    ends = [s * c for s, (_, c) in zip(workers, alone, strict=True) if c]
    without_s = max(ends, default=0.0) + during([c for _, c in alone])
    if check is not None:
        with_s += check(batch - ranges[0][1], ring_with)
        without_s += check(batch, without_s)
    return with_s < without_s * (1 - MASTER_RANGE_MARGIN), with_s, without_s


def choose(cluster, nbytes: float, costs=None) -> tuple[str, dict[str, float]]:
    """(the faster exchange on ``cluster`` for ``nbytes`` of parameters, each one's seconds)."""
    from hetconv.dataparallel import PARAMETER_SERVER, exchange_seconds

    seconds = {
        MASTER: exchange_seconds(cluster, nbytes, PARAMETER_SERVER, costs),
        RING: ring_exchange_seconds(cluster, nbytes, costs),
    }
    return min(seconds, key=lambda k: (seconds[k], k != MASTER)), seconds


def check_exchange(exchange: str) -> str:
    if exchange not in EXCHANGES:
        raise ValueError(f"--exchange {exchange!r} is not one of {', '.join(EXCHANGES)}")
    return exchange


def shapes_of(parameters: Mapping[str, np.ndarray]) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in parameters.values()]


__all__ = [
    "AUTO",
    "BUCKET_BYTES",
    "DIGEST_BLOCK",
    "DONE",
    "EXCHANGES",
    "MASTER",
    "MASTER_RANGE_MARGIN",
    "MASTER_ROUND",
    "MAX_RANKS",
    "OWN",
    "PART_BYTES_PER_S",
    "RING",
    "RING_ANSWER_VALUES",
    "RING_SECONDS",
    "SKETCH_VALUES",
    "ROUNDS_PER_SUM",
    "SEGMENT_BYTES",
    "SUMMED",
    "all_gather",
    "all_gather_doubling",
    "all_reduce",
    "all_reduce_seconds",
    "all_to_all",
    "bucket_chunks",
    "buckets",
    "buffer_name",
    "check_exchange",
    "choose",
    "chunk_bounds",
    "digest",
    "digest_blocks",
    "digest_of_values",
    "digest_values",
    "doubling_rounds",
    "flat",
    "join64",
    "master_link_bytes",
    "master_range_pays",
    "momentum_name",
    "part_seconds",
    "ring_exchange_seconds",
    "rounds",
    "schedule",
    "segments",
    "shapes_of",
    "split64",
    "unflat",
]
