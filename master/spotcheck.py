"""Spot checks: the master recomputes a random sample of a worker's answer and compares.

A worker can answer with finite but wrong numbers (a broken driver, a bad overclock, a laptop
that lies). Nothing else would notice: the shapes are right, the values finite, and training
goes on to a different model. So on one step in ``every`` on average (default
:data:`DEFAULT_EVERY`; each step drawn with probability ``1 / every`` from a secret the master
draws when the run starts, so a worker cannot tell the checked steps from the step numbers),
for every answer of every worker in that step, the master picks a few kernels of the worker's
slice, a few images and a few input channels, recomputes exactly those values itself and
compares them with the answer:

* forward: the feature maps of the sampled kernels on the sampled images (a ``kernels`` x
  ``images`` convolution);
* backward: the kernel gradients of the sampled kernels on a few sampled input channels (over
  all images: a kernel's gradient is a sum over the batch; one input channel's slice of it
  needs only that channel of the input), their bias gradients, and the worker's input-gradient
  part on the sampled images and input channels (over all its kernels: the part is a sum over
  them).

Resident kernels (:mod:`.resident`) are the workers' own between syncs, so their answers can
be recomputed only from the last synced copy: at one sync (FetchKernels) of a slice in
``every``, drawn in secret, the master replays a few kernels of it drawn in secret at
the sync before (the whole slice with a split head, whose answer is a sum over it) from the
synced copy and its replay log, and compares the worker's forward answers of every step since
(it keeps the drawn kernels' stage outputs, or the split head's partial logits) and the
fetched slice (the worker's own SGD updates): :meth:`SpotChecker.compare`, with the tolerances
:data:`REPLAY_RTOL` and :data:`UPDATE_RTOL` (the replay is float32 on the master's BLAS, not
the worker's bit for bit). A worker caught there is lost and kept out as below; its slice is
replayed from the sync (the updates it should have made) and the step is computed again.

So every tensor a worker returns is sampled. An answer of which nothing can be compared (a
resident forward between syncs, a fused stage holding batch norm) is not counted as a check.
The master computes the samples in float64 by FFT
(scipy), independent of every backend: a bug its own backend shared with a worker's would not
hide, and a few kernels' gradients over a whole batch cost less this way than a backend's
lowering of the input. A mismatch raises :class:`SpotCheckFailed`, a
:class:`~.client.WorkerError`: the runner covers the piece (the master computes it) and the
worker is lost with an event naming it, the layer, the phase, the worst error and the
tolerance. The training loop then computes the step again without it
(:meth:`~.cluster.Cluster.redo_step`): its earlier answers in the step passed their checks but
may be wrong where they were not sampled. It is *kept out* for the rest of the run
(``keep_out``, state ``distrusted``): the monitor never re-admits it, since a worker that lied
once is not trusted with the unchecked values that would follow its return (a new run admits
it again). Answers it gave in unchecked steps (``every`` above 1), or that passed the checks of
earlier steps, stay in the weights: sampling bounds how long a lie goes unseen, not what it
costs until then (``benchmarks/spot_checks.py`` measures both).

What is sampled follows from the secret, the seed, the step, the layer, the phase and the
node; with ``unpredictable=False`` not the secret (every ``every``-th step from step 0 is
checked), so a run repeated with the same settings checks the same values. A check only
reads: an honest worker's answer is used unchanged, so checks never change what a run computes
(``--deterministic`` runs stay bitwise identical).

Tolerance (:func:`tolerance`): the sample's largest error over its scale (the largest value
the master computed for that tensor; the kernel and bias gradients of a kernel share one
scale, since a bias gradient alone can cancel to near zero) must stay within ``rtol`` plus,
for tensors that travel in a 16-bit wire format (feature maps, input gradients), one unit in
the last place of that format (:data:`FORMAT_ULP`), since the worker's and the master's float32
results, a round-off apart, can round to neighbouring 16-bit values. The master recomputes
from the inputs *as the worker received them* (rounded through the wire format), so the
format's rounding of the inputs costs nothing; kernel and bias gradients travel as float32 and
get ``rtol`` alone. ``rtol`` (:data:`DEFAULT_RTOL`, 1e-4) is five times the 2e-5 that the
backends' own tests allow between a device and the cpu backend (``tests/test_backend_cuda.py``)
and over a hundred times the worst that honest cpu workers showed (``benchmarks/spot_checks.py``
prints it); it catches an answer scaled by 1.5 at once and a relative perturbation of 1e-3 in
float32 (``tests/test_spot_checks.py``).
"""

from __future__ import annotations

import secrets
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import fft as sfft

from hetconv.batchnorm import BatchNorm2d
from hetconv.formats import TensorFormat

from .client import WorkerError
from .spotcompare import (  # noqa: F401 - the comparisons, here where the checks use them
    FLOAT16_SUBNORMAL,
    FORMAT_ULP,
    Comparison,
    _as_answered,
    as_received,
    norm_scale,
    relative_error,
    tolerance,
)

#: Check every this many steps by default (step 0 included); see ``benchmarks/spot_checks.py``:
#: fused stages (the command line's default) cost more to check than plain convolutions (each
#: sampled kernel's halo runs through the stage's layers), 15 % of a paper-50-500 step at batch
#: 16 every step, under 2 % every 4th.
DEFAULT_EVERY = 4
#: Kernels of a worker's slice, images of the batch and input channels sampled per answer.
DEFAULT_KERNELS = 2
DEFAULT_IMAGES = 2
#: Workers whose whole range a split by images recomputes on a checked step: each is a whole
#: worker's step of work for the master (a kernel split's check is a few kernels and images).
DEFAULT_RANGES = 1
DEFAULT_CHANNELS = 2
#: The largest error over the scale allowed between a worker's float32 and the master's.
DEFAULT_RTOL = 1e-4
#: A resident slice's forward answers, replayed at a sync (:mod:`.resident`): the replay's
#: weights may differ from the worker's in a kernel by a percent of the updates (a ReLU or
#: max-pool tie gone the other way on round-off), so a percent of their scale is allowed; a
#: lie of the kind a glance at the loss would not show (x1.5) is fifty times that.
REPLAY_RTOL = 1e-2
#: A worker's parameter gradients of a step split by images (after the whole network's forward
#: and backward), recomputed by the master, compared as a whole (``norm``: the 2-norm of the
#: difference over the 2-norm of the master's): element by element an honest worker differs
#: by far more than round-off wherever a max-pool window holds equal values (flat, saturated
#: image regions), since round-off then decides which of them takes the gradient, and a
#: different BLAS thread count or engine decides it differently (paper-150-800, batch 16, the
#: numpy engine at 1 and 2 threads on the same inputs: conv2's kernel gradient 2.5e-2 of its
#: largest value apart in 0.1 % of its values, where :data:`DEFAULT_RTOL` lost the worker;
#: 1.5e-3 of its norm, and conv1's 2.4e-3). A percent of the norm allows that; a liar of the
#: kinds the tests plant (x1.5) is off by a half. The losses (forward only) keep the default.
IMAGES_RTOL = 1e-2
#: A ring worker's sketches of its own gradient against those of its range recomputed here
#: (:mod:`.ringcheck`), compared as a scaling of the master's and what is left across it. With
#: batch norm, the whole batch's statistics carry a ReLU that round-off turned the other way
#: into every image's gradient, so an honest worker on another engine than the master's is off
#: by a percent or two of the scale, mostly across the gradient, not along it: resnet20 at
#: batch 64, a numpy-engine worker against a onednn master, checked every step, 100 checks
#: over three seeds: the projection within 0.6 % of 1, the rest up to 1.7 % of the scale; one
#: cuda worker on an H200: 0.4, 0.6 and 1.5 % in its first three checks, where a 1 % norm
#: tolerance lost it (``tests/test_ring_checks.py``; the gap itself:
#: ``benchmarks/gpu_gradients.py``). The projection of the worker's sketches on the master's
#: must be 1 within SKETCH_SCALE_RTOL (a worker scaling its gradient by 1.05 gives 1.05,
#: by 1.5 gives 1.5), the rest under SKETCH_REST_RTOL of the scale (a shifted gradient, or one
#: of other images, leaves about all of it).
SKETCH_SCALE_RTOL = 3e-2
SKETCH_REST_RTOL = 5e-2
_PHASES = {"forward": 0, "backward": 1}

#: How far from 1 the worker's updates of a resident slice since its sync may be over the
#: master's replay of them (their projection): an honest cpu worker's are 1 within 1e-4
#: (``benchmarks/spot_checks.py``); one that scales its updates by 1.01 is 1.01.
UPDATE_RTOL = 2e-3


@dataclass(frozen=True)
class SpotCheckConfig:
    """How often and how much the master recomputes of workers' answers.

    Args:
        every: check every this many steps (step 0, ``every``, ``2 * every``, ...); 0: never.
        kernels: kernels of a worker's slice sampled per answer (all, if it has fewer).
        images: images of the batch sampled per answer (all, if the batch has fewer).
        channels: input channels sampled per backward answer (all, if the layer has fewer).
        ranges: workers whose whole range of images a split by images recomputes on a checked
            step (all, if it has fewer).
        seed: picks the samples, with the step, layer, phase and node.
        rtol: the largest error over the scale allowed between two float32 computations.
        unpredictable: the steps checked and the samples drawn also follow a secret the
            master draws when the run starts (a worker cannot tell them from the step
            number): each step is checked with probability ``1 / every``; False: every
            ``every``-th step from step 0, the samples following the settings alone (a run
            repeated checks the same values).
    """

    every: int = DEFAULT_EVERY
    kernels: int = DEFAULT_KERNELS
    images: int = DEFAULT_IMAGES
    channels: int = DEFAULT_CHANNELS
    ranges: int = DEFAULT_RANGES
    seed: int = 0
    rtol: float = DEFAULT_RTOL
    unpredictable: bool = True

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"spot-check interval must be >= 0 steps (0: off), got {self.every}")
        if min(self.kernels, self.images, self.channels) < 1:
            raise ValueError(
                "a spot check samples at least 1 kernel, 1 image and 1 input channel, got "
                f"{self.kernels} kernels, {self.images} images, {self.channels} channels"
            )
        if self.ranges < 1:
            raise ValueError(f"a spot check recomputes at least 1 range, got {self.ranges}")
        if not 0 < self.rtol < 1:
            raise ValueError(f"spot-check tolerance must be in (0, 1), got {self.rtol}")


@dataclass(frozen=True)
class Sample:
    """What one check recomputes: ``kernels`` (absolute kernel numbers, ascending, inside the
    piece), ``images`` (batch positions) and ``channels`` (input channels), ascending."""

    kernels: np.ndarray
    images: np.ndarray
    channels: np.ndarray


class SpotCheckFailed(WorkerError):
    """A worker's answer differs from what the master recomputed of it: it is lost and kept
    out for the rest of the run (``keep_out``; see :meth:`~.membership.Membership.lose`)."""

    keep_out = True


class SpotChecker:
    """Decides which steps and values are checked, runs the comparisons, and keeps the step's
    summary for the trace.

    A job is checked when it has a ``spot_sample(piece, answer, draw)`` method returning the
    :class:`Comparison` of every tensor sampled (None or empty: nothing of this answer can be
    compared now, and nothing is counted), where ``draw(images, channels)`` gives the
    :class:`Sample` for a batch of ``images`` with ``channels`` input channels (the kernel
    split's jobs do, see :mod:`.dispatch`); a job of a strategy without one is not checked.
    Answers compared later (a resident slice's, at its sync: :mod:`.resident`) go through
    :meth:`compare`.
    """

    def __init__(self, config: SpotCheckConfig):
        self.config = config
        #: mixed into every draw (``unpredictable``): known to the master alone
        self.secret = secrets.randbits(64) if config.unpredictable else None
        self.step = 0
        self.due = False
        self.start_step(0)

    def _rng(self, *words: int) -> np.random.Generator:
        key = [self.config.seed & 0xFFFFFFFF, *words]
        if self.secret is not None:
            key += [self.secret & 0xFFFFFFFF, self.secret >> 32]
        return np.random.default_rng(key)

    def due_at(self, step: int) -> bool:
        """Whether the answers of ``step`` are checked."""
        every = self.config.every
        if every <= 0:
            return False
        if self.secret is None:
            return step % every == 0
        return every == 1 or bool(self._rng(step, 0xD0E).random() < 1 / every)

    def replay_due(self, placed, layer: str) -> bool:
        """Whether a resident slice's steps since its sync are replayed and compared now
        (:mod:`.resident`): one sync in ``every``, drawn in secret (a replay recomputes every
        step of the slice since, so one in ``every`` costs what checking one step in
        ``every`` would); predictably, when one of its logged steps is due."""
        if self.secret is None:
            return any(self.due_at(e.step) for e in placed.log)
        every = self.config.every
        key = (
            placed.synced_step,
            zlib.crc32(layer.encode()),
            zlib.crc32(placed.node.name.encode()),
        )
        return every == 1 or bool(self._rng(*key, 0xA0D).random() < 1 / every)

    def start_step(self, step: int) -> None:
        """Calls from now on belong to ``step``."""
        self.step = step
        self.due = self.due_at(step)
        self.summary: dict[str, dict] = {}  # worker -> checks, worst, where
        self.seconds = 0.0
        self.caught: list[str] = []  # workers caught in this step, not yet redone

    def sample(
        self, layer: str, phase: str, node_index: int, part: slice, images: int, channels: int
    ) -> Sample:
        """The kernels of ``part``, the images of a batch of ``images`` and the input channels
        of ``channels`` to recompute."""
        c = self.config
        rng = self._rng(self.step, zlib.crc32(layer.encode()), _PHASES[phase], node_index)
        size = part.stop - part.start
        kernels = rng.choice(size, min(c.kernels, size), replace=False) + part.start
        chosen = rng.choice(images, min(c.images, images), replace=False)
        inputs = rng.choice(channels, min(c.channels, channels), replace=False)
        return Sample(np.sort(kernels), np.sort(chosen), np.sort(inputs))

    def ranges(self, layer: str, workers: int) -> np.ndarray:
        """The workers (their places among ``workers``, ascending) whose whole range a split by
        images recomputes on this step: ``ranges`` of them, drawn as the samples are."""
        rng = self._rng(self.step, zlib.crc32(layer.encode()), _PHASES["forward"], 0)
        return np.sort(rng.choice(workers, min(self.config.ranges, workers), replace=False))

    def watch(self, layer: str, node: str, part: slice, step: int) -> np.ndarray:
        """The kernels of a resident slice ``part`` whose answers are kept from ``step`` on
        and replayed at its next sync (:mod:`.resident`): drawn when the slice is placed or
        synced, so its worker cannot know them."""
        rng = self._rng(step, zlib.crc32(layer.encode()), 2, zlib.crc32(node.encode()))
        size = part.stop - part.start
        return np.sort(rng.choice(size, min(self.config.kernels, size), replace=False)) + part.start

    def check(self, job, piece, answer, layer: str) -> None:
        """Recompute a sample of ``answer`` (``piece``'s, from a worker) on a due step.

        Raises:
            SpotCheckFailed: a sampled value is off by more than the tolerance.
        """
        spot_sample = getattr(job, "spot_sample", None)
        if not self.due or spot_sample is None:
            return
        start = time.perf_counter()
        try:

            def draw(images: int, channels: int) -> Sample:
                return self.sample(layer, job.phase, piece.index, piece.part, images, channels)

            comparisons = spot_sample(piece, answer, draw)
            if comparisons:  # None or empty: nothing of it can be compared (it says why)
                self._compare(piece.node, layer, job.phase, comparisons)
        finally:
            self.seconds += time.perf_counter() - start

    def compare(self, node, layer: str, phase: str, comparisons: Sequence[Comparison]) -> None:
        """Compare ``comparisons`` of ``node``'s answers made outside a phase (a resident
        slice's replay at its sync), counted in this step's record.

        Raises:
            SpotCheckFailed: a value is off by more than the tolerance.
        """
        if comparisons:
            self._compare(node, layer, phase, comparisons)

    def _compare(self, node, layer: str, phase: str, comparisons: Sequence[Comparison]) -> None:
        fmt = node.client.wire_format
        entry = self.summary.setdefault(node.name, {"checks": 0, "worst": 0.0})
        entry["checks"] += 1
        for comparison in comparisons:
            rtol = comparison.rtol or self.config.rtol
            relative, absolute = tolerance(rtol, fmt, comparison.wire_rounded)
            error, worst = relative_error(comparison)
            if error >= entry["worst"]:
                entry.update(worst=float(f"{error:.3g}"), at=f"{layer} {phase} {comparison.tensor}")
            if worst > relative * comparison.scale + absolute:
                self.caught.append(node.name)
                raise SpotCheckFailed(
                    node.name,
                    f"{phase} {layer}: spot check failed: {comparison.what} differ from the "
                    f"master's by {error:.3g} of their scale {comparison.scale:.3g} (tolerance "
                    f"{relative:.3g}{' + float16 subnormal' if absolute else ''}): finite "
                    "but wrong; not re-admitted this run",
                )

    def take_caught(self) -> list[str]:
        """Workers caught since the last call in this step (the step is then computed again:
        their answers that passed earlier checks in it may be wrong where not sampled)."""
        caught, self.caught = self.caught, []
        return caught

    def record(self) -> dict | None:
        """The step's checks for its trace record: per worker the answers compared (an answer
        of which nothing could be compared is not counted) and the worst error over scale (and
        where), and the seconds the checks took; None when nothing was compared."""
        if not self.summary:
            return None
        return {"seconds": self.seconds, "workers": self.summary}


def _names(indices: np.ndarray) -> str:
    return ",".join(map(str, indices.tolist()))


def _spectrum(a: np.ndarray, size: tuple[int, int], at: tuple[int, int] = (0, 0)) -> np.ndarray:
    """The 2-D real FFT, in float64, of ``a`` (..., H, W) placed at row, column ``at`` of
    zeros of ``size`` (padded by hand: scipy's own padding, ``s=``, is several times slower
    for float64 here)."""
    padded = np.zeros(a.shape[:-2] + size)
    padded[..., at[0] : at[0] + a.shape[-2], at[1] : at[1] + a.shape[-1]] = a
    return sfft.rfft2(padded, axes=(-2, -1))


def _inverse(spectrum: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    return sfft.irfft2(spectrum, s=size, axes=(-2, -1))


def _product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per frequency, the matrix product of ``a`` (P, Q, F1, F2) and ``b`` (Q, R, F1, F2): a
    sum over the second axis of ``a`` (P, R, F1, F2)."""
    f = a.shape[2:]
    left = a.reshape(a.shape[0], a.shape[1], -1).transpose(2, 0, 1)
    right = b.reshape(b.shape[0], b.shape[1], -1).transpose(2, 0, 1)
    return (left @ right).transpose(1, 2, 0).reshape(a.shape[0], b.shape[1], *f)


def kernel_forward_sample(fmt: TensorFormat, x, w, b, sides, y, sample: Sample) -> list[Comparison]:
    """The kernel split's forward: the feature maps ``y`` (N, K, Ho, Wo) a worker wrote, of the
    sampled kernels on the sampled images, against the master's convolution of the inputs as
    the worker received them (in ``fmt``) with those kernels, rounded to ``fmt`` as the maps
    travelled.

    .. note:: The master computes samples in float64 by FFT (scipy): independent of every
       backend (a bug the master's backend shared with a worker's would not hide) and, for a
       few kernels over a whole batch, cheaper than a backend's lowering of the input.
    """
    ks, images = sample.kernels, sample.images
    top, bottom, left, right = sides
    size = (x.shape[2] + top + bottom, x.shape[3] + left + right)
    ho, wo = size[0] - w.shape[2] + 1, size[1] - w.shape[3] + 1
    inputs = _spectrum(as_received(fmt, x[images]), size, (top, left))
    kernels = _spectrum(w[ks], size).conj()  # correlation: y[p] = sum over i of w[i] x[p + i]
    maps = _inverse(_product(inputs, kernels.transpose(1, 0, 2, 3)), size)[..., :ho, :wo]
    want = _as_answered(fmt, maps + b[ks][:, None, None])
    scale = float(np.abs(want).max(initial=0.0))
    what = f"feature maps of kernels {_names(ks)}, images {_names(images)}"
    return [Comparison("y", what, y[np.ix_(images, ks)], want, scale, wire_rounded=True)]


def kernel_backward_sample(
    fmt: TensorFormat,
    x,
    w,
    dy,
    sides,
    part: slice,
    dw,
    db,
    dx_part,
    sample: Sample,
) -> list[Comparison]:
    """The kernel split's backward: the kernel gradients ``dw`` (K, C, kh, kw) a worker wrote
    for the sampled kernels and input channels (summed over every image, so that channel of
    every image of ``x`` is used), their bias gradients ``db``, and its input-gradient part
    ``dx_part`` (N, C, H, W; None when not asked) on the sampled images and channels (summed
    over every kernel of its slice ``part``), against the master's, from the inputs and
    output gradients as the worker received them in ``fmt`` (float64, by FFT: see
    :func:`kernel_forward_sample`)."""
    ks, images, cs = sample.kernels, sample.images, sample.channels
    top, bottom, left, right = sides
    h, w_ = x.shape[2:]
    size = (h + top + bottom, w_ + left + right)
    kh, kw = w.shape[2:]
    grads = as_received(fmt, dy[:, ks])
    # dw[k, c, i, j] = sum over n, p, q of dy[n, k, p, q] * padded x[n, c, p + i, q + j]
    inputs = _spectrum(as_received(fmt, x[:, cs]), size, (top, left))
    grads_conj = _spectrum(grads, size).conj()
    products = _product(grads_conj.transpose(1, 0, 2, 3), inputs)
    want_dw = _inverse(products, size)[..., :kh, :kw].astype(np.float32)
    want_db = grads.sum(axis=(0, 2, 3), dtype=np.float64).astype(np.float32)
    scale = float(max(np.abs(want_dw).max(initial=0.0), np.abs(want_db).max(initial=0.0)))
    named = f"kernels {_names(ks)}"
    out = [
        Comparison(
            "dw", f"kernel gradients of {named}, input channels {_names(cs)}",
            dw[np.ix_(ks, cs)], want_dw, scale, wire_rounded=False,
        ),
        Comparison(
            "db", f"bias gradients of {named}", db[ks], want_db, scale, wire_rounded=False
        ),
    ]  # fmt: skip
    if dx_part is not None:
        # padded dx[n, c, u, v] = sum over k, i, j of dy[n, k, u - i, v - j] * w[k, c, i, j]
        slice_grads = _spectrum(as_received(fmt, dy[images][:, part]), size)
        products = _product(slice_grads, _spectrum(w[part][:, cs], size))
        padded = _inverse(products, size)
        want_dx = _as_answered(fmt, padded[..., top : top + h, left : left + w_])
        scale_dx = float(np.abs(want_dx).max(initial=0.0))
        what = f"input-gradient part on images {_names(images)}, channels {_names(cs)}"
        got = dx_part[np.ix_(images, cs)]
        out.append(Comparison("dx", what, got, want_dx, scale_dx, wire_rounded=True))
    return out


def _correlate(inputs: np.ndarray, w: np.ndarray, size, out_hw) -> np.ndarray:
    """Float64 feature maps (N, k, Ho, Wo) of input spectra ``inputs`` (from
    :func:`_spectrum` of the padded input, ``size``) with kernels ``w`` (k, C, kh, kw)."""
    kernels = _spectrum(w, size).conj()
    maps = _inverse(_product(inputs, kernels.transpose(1, 0, 2, 3)), size)
    return maps[..., : out_hw[0], : out_hw[1]]


def _stage_run(stage, maps: np.ndarray, batchnorm: Sequence = (), rows: slice = slice(0, 0)):
    """The stage's layers (fresh objects, the code every node runs) over float32 ``maps`` of
    kernels ``rows``, its batch norms with ``batchnorm``'s rows (BatchNormSlice of the whole
    layer: a channel's statistics are its own); (output, layers with their saved state)."""
    layers = stage.build("spot", maps.shape[1])
    given = iter(batchnorm)
    a = maps.astype(np.float32)
    for layer in layers:
        if isinstance(layer, BatchNorm2d):
            bn = next(given)
            layer.params = {"weight": bn.weight[rows], "bias": bn.bias[rows]}
            layer.training = bn.training
            if not bn.training:
                layer.buffers["running_mean"][...] = bn.running_mean[rows]
                layer.buffers["running_var"][...] = bn.running_var[rows]
        a = layer.forward(a)
    return a, layers


def stage_forward_sample(
    fmt: TensorFormat,
    x,
    w,
    b,
    sides,
    stage,
    y,
    sample: Sample,
    batchnorm: Sequence = (),
    received: np.ndarray | None = None,
) -> list[Comparison]:
    """A fused stage's forward: the stage output ``y`` (N, K, Ho', Wo') a worker wrote for the
    sampled kernels on the sampled images, against the master's: the convolution of each
    sampled kernel's halo-widened range (float64 by FFT, as :func:`kernel_forward_sample`) put
    through the stage's layers, rounded to ``fmt`` as the output travelled. A stage's batch
    norms (``batchnorm``: the layer's BatchNormSlices, every channel) normalise a channel by
    its own statistics over the batch: with them every image is computed, a few compared.
    ``received``: ``x`` as the worker had it where it did not travel in ``fmt``: a
    replicated block's output, which the worker computed itself in float32 (and, split by
    images, got the peers' rows of as float32 parts)."""
    ks, images = sample.kernels, sample.images
    top, bottom, left, right = sides
    size = (x.shape[2] + top + bottom, x.shape[3] + left + right)
    out_hw = (size[0] - w.shape[2] + 1, size[1] - w.shape[3] + 1)
    batch = np.arange(x.shape[0]) if batchnorm else images
    got = as_received(fmt, x[batch]) if received is None else received[batch]
    inputs = _spectrum(got, size, (top, left))
    want = np.empty((len(images), len(ks), *y.shape[2:]), np.float32)
    for i, k in enumerate(ks.tolist()):
        wide = stage.widened(slice(k, k + 1), w.shape[0])
        maps = _correlate(inputs, w[wide], size, out_hw) + b[wide][:, None, None]
        out, _ = _stage_run(stage, maps, batchnorm, wide)
        want[:, i] = out[images if batchnorm else slice(None), k - wide.start]
    want = _as_answered(fmt, want)
    scale = float(np.abs(want).max(initial=0.0))
    what = f"stage outputs of kernels {_names(ks)}, images {_names(images)}"
    return [Comparison("y", what, y[np.ix_(images, ks)], want, scale, wire_rounded=True)]


def stage_backward_sample(
    fmt: TensorFormat,
    x,
    w,
    b,
    dy,
    sides,
    stage,
    dw,
    db,
    sample: Sample,
    batchnorm: Sequence = (),
    received: np.ndarray | None = None,
) -> list[Comparison]:
    """A fused stage's backward: the kernel gradients ``dw`` a worker wrote for the sampled
    kernels and input channels and their bias gradients ``db`` (each summed over every image),
    against the master's: each sampled kernel's halo-widened forward over the whole batch
    (float64 convolution by FFT, then the stage's layers), the stage-output gradient of its
    range as the worker received it put back through those layers, and the kernel gradient by
    FFT; ``batchnorm`` as :func:`stage_forward_sample`'s (the whole batch is computed here
    anyway). The input-gradient part is not sampled here: it sums over the whole slice, whose
    stage the master would have to run again (the kernel split samples it). ``received`` as
    :func:`stage_forward_sample`'s."""
    ks, cs = sample.kernels, sample.channels
    top, bottom, left, right = sides
    size = (x.shape[2] + top + bottom, x.shape[3] + left + right)
    kh, kw = w.shape[2:]
    out_hw = (size[0] - kh + 1, size[1] - kw + 1)
    received = as_received(fmt, x) if received is None else received
    inputs = _spectrum(received, size, (top, left))
    channels = _spectrum(received[:, cs], size, (top, left))
    grads = np.empty((x.shape[0], len(ks), *out_hw), np.float32)
    for i, k in enumerate(ks.tolist()):
        wide = stage.widened(slice(k, k + 1), w.shape[0])
        grad = stage.grad_range(slice(k, k + 1), w.shape[0])
        maps = _correlate(inputs, w[wide], size, out_hw) + b[wide][:, None, None]
        out, layers = _stage_run(stage, maps, batchnorm, wide)
        g = np.zeros(out.shape, np.float32)
        g[:, grad.start - wide.start : grad.stop - wide.start] = as_received(fmt, dy[:, grad])
        for layer in reversed(layers):
            g = layer.backward(g)
        grads[:, i] = g[:, k - wide.start]
    # dw[k, c, i, j] = sum over n, p, q of g[n, k, p, q] * padded x[n, c, p + i, q + j]
    products = _product(_spectrum(grads, size).conj().transpose(1, 0, 2, 3), channels)
    want_dw = _inverse(products, size)[..., :kh, :kw].astype(np.float32)
    want_db = grads.sum(axis=(0, 2, 3), dtype=np.float64).astype(np.float32)
    scale = float(max(np.abs(want_dw).max(initial=0.0), np.abs(want_db).max(initial=0.0)))
    named = f"kernels {_names(ks)}"
    return [
        Comparison(
            "dw", f"stage kernel gradients of {named}, input channels {_names(cs)}",
            dw[np.ix_(ks, cs)], want_dw, scale, wire_rounded=False,
        ),
        Comparison(
            "db", f"stage bias gradients of {named}", db[ks], want_db, scale, wire_rounded=False
        ),
    ]  # fmt: skip
