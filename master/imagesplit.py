"""The whole network split by images (``hetconv train --split images``): heterogeneous data
parallelism run by hetconv over its own workers (:mod:`hetconv.imagesplit`).

:class:`ImageSplit` is a :class:`~.cluster.Cluster` (the same connection, token and TLS,
membership, backoff and rejoining, local workers), but it splits no layer: the model's
convolutions run in this process, and each training step goes through
:meth:`ImageSplit.train_batch` instead. Per step:

* the batch is cut into contiguous ranges of images, one per node (the master first, then the
  active workers in order), so that every node finishes together by what the steps before
  measured (smoothed): its seconds per image, and a worker's seconds per step beyond its
  computation (its bytes on the link); equal before anything is measured, and always with
  ``deterministic``;
* each worker gets one ImagesStep call (:data:`hetconv.calls.IMAGES_STEP`): the model's spec,
  every parameter (float32), its images (palette8 where they fit) and labels; it answers every
  parameter's gradient of its images' summed losses over the batch size, the images' losses
  and hits;
* the master computes its own range meanwhile, on the model itself;
* a worker whose call fails (gone, past its deadline, a bad answer) is lost (the membership
  retries it with backoff, and it rejoins at a step boundary), and the master computes its
  range itself: the same images and weights, so no step is lost and the step is the same;
* the gradients are summed in node order into the model's gradient arrays; the loop's
  optimizer then updates the master's weights, which every worker gets with the next step.

What moves is the parameter-server exchange of :mod:`hetconv.dataparallel`: the parameters to
every worker and their gradients back (both float32, each the model's parameter bytes), plus
the worker's images and labels. Each step record says ``split: images``, each node's images,
seconds and bytes; the plan record says the same of the first step's ranges.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from typing import TextIO

import numpy as np

from hetconv.calls import IMAGES_STEP, images_step_names
from hetconv.formats import FLOAT32, PALETTE8
from hetconv.imagesplit import (
    IMAGES,
    backward_hooks,
    batch_loss,
    image_ranges,
    images_gradients,
    parameter_shapes,
    refuse_batchnorm,
    seconds_per_image,
    spec_json,
)
from hetconv.proto import worker_pb2 as pb
from hetconv.spec import CIFAR_INPUT

from .call import Call
from .client import CallStats, WorkerClient, WorkerError
from .cluster import Cluster
from .membership import ACTIVE, MASTER, Node
from .spotcheck import IMAGES_RTOL, Comparison, SpotCheckFailed, norm_scale

#: Weight of the newest measurement in a node's smoothed seconds per image.
SMOOTHING = 0.5
#: A new cut of the batch is taken only where predicted this much faster (its slowest node's
#: time) than the last: a node's measured seconds per image scatter from step to step (on a
#: capped core, its computation between batch norm's sums by 10-20 %), and a cut that follows
#: them moves images back and forth (resnet20 at batch 64 on 4 equal workers of the testbed:
#: 13-19 images a worker from step to step, where 16 each is even).
RANGES_DEADBAND = 0.10
#: With batch norm's sums, a node's seconds per image is the median of its last this many
#: steps' computation between the sums: on a capped core a pause of the cap falls within the
#: computation or within a wait, so one step's figure scatters by 15-40 % (the testbed,
#: resnet20 at batch 64: 4.0-8.6 ms an image per worker, medians over 12 steps 5.0-5.7 ms);
#: the first are used once there are WINDOW_FIRST.
WINDOW, WINDOW_FIRST = 7, 3
#: Their medians still scatter (on the testbed a cut at 10 % made 16 each into 17, 13, 19 and
#: 15, and that step took 0.384 s where the others took 0.28-0.33 s): with them the deadband is
#: at least this many times the largest relative standard error of a node's median
#: (:meth:`ImageSplit._scatter`), so a cut moves where the figures differ beyond their
#: scatter: on a laptop's steady core a few per cent, on a capped one 10-20 %.
SCATTER_BAND = 2.0


def _slowest(cut, seconds: list[float], fixed: list[float]) -> float:
    """The predicted time of the slowest node given images by ``cut`` ((first, count) each)."""
    return max((f + s * c for (_, c), s, f in zip(cut, seconds, fixed, strict=True) if c),
               default=0.0)  # fmt: skip


#: Steps in a row a worker may get no image before its figures are forgotten (tried again).
IDLE_RETRY_STEPS = 20
#: A worker's first call may take this long (no measurement yet to derive a deadline from).
FIRST_DEADLINE_S = 120.0


def images_step(
    client: WorkerClient,
    session: int,
    step: int,
    model,
    spec: str,
    x: np.ndarray,
    labels: np.ndarray,
    first: int,
    batch: int,
    timeout: float,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, CallStats]:
    """One worker's ImagesStep: the whole ``model`` (its ``spec`` as JSON) on images ``x``,
    rows ``first ..`` of a batch of ``batch``; returns (gradients by parameter name, float32
    losses, bool hits, the call's figures)."""
    parameters = model.parameters()
    request = pb.ConvRequest(
        phase=IMAGES_STEP.phase, session=session, step=step,
        images=pb.ImagesStep(
            spec_json=spec, input_shape=model.input_shape, seed=model.seed, first=first,
            batch=batch,
        ),
    )  # fmt: skip
    names, expect = images_step_names(parameters)
    images = PALETTE8.prepared(x) if PALETTE8.nbytes(x.shape) < FLOAT32.nbytes(x.shape) else None
    arrays = [*parameters.values(), x, labels.astype(np.float32)]
    formats = [FLOAT32] * len(parameters) + [images or FLOAT32, FLOAT32]
    answer = sum(p.nbytes for p in parameters.values()) + 8 * len(x)
    got, stats = client._call(
        IMAGES_STEP, f"images step {step}", request, list(zip(names, arrays, strict=True)),
        list(expect), {}, timeout, answer, formats,
    )  # fmt: skip
    grads = {name: got[name] for name in parameters}
    for name, g in grads.items():
        if g.shape != parameters[name].shape or not np.isfinite(g).all():
            raise WorkerError(client.address, f"images step {step}: bad gradient of {name}")
    losses, hits = got["losses"], got["hits"]
    if losses.shape != (len(x),) or hits.shape != (len(x),) or not np.isfinite(losses).all():
        raise WorkerError(client.address, f"images step {step}: bad losses or hits")
    return grads, losses, hits.astype(bool), stats


class ImageSplit(Cluster):
    """A :class:`~.cluster.Cluster` that trains the whole network split by images (see the
    module's docstring); its arguments are the cluster's."""

    supports_stages = False  # the model runs its layers one by one, here
    supports_head = False

    def __init__(self, addresses: Sequence[str], backend="cpu", config=None):
        super().__init__(addresses, backend, config)
        self._spec: str | None = None
        self._parameter_bytes = 0
        self._input: tuple[tuple[int, ...], bool] = (CIFAR_INPUT, True)  # shape, palette8 fits
        self._batch = 0
        self._seconds: dict[str, float] = {}  # node -> smoothed seconds per image
        self._fixed: dict[str, float] = {}  # worker -> smoothed seconds of its call's bytes
        self._idle: dict[str, int] = {}  # worker -> steps in a row it got no image
        self._warm: set[str] = set()  # nodes whose first step was measured (and left out)
        self._cut: tuple = ()  # (nodes, batch, counts) of the last cut of the images
        self._windows: dict[str, deque] = {}  # node -> its last figures between sums
        self._record: dict = {}  # this step's
        self._conv_seconds = 0.0
        self._console: TextIO | None = None  # until the split's line is said there

    # -- setting up ------------------------------------------------------------------------

    def prepare(self, layers, batch: int, log: TextIO | None = None) -> None:
        """Connect to the workers (no layer is probed: shares follow the images per second
        each node computes) and start watching for lost and new workers."""
        self._events.console = log
        if log is not None and len(self.nodes) > 1:
            count = len(self.nodes) - 1
            print(f"connecting to {count} worker{'s' * (count != 1)} (device, link) ...",
                  file=log, flush=True)  # fmt: skip
        self.connect()
        self._batch = batch
        if layers:  # the network's input, as its first convolution takes it
            first = layers[0].written or layers[0]
            self._input = (first.input_shape, first.images_fit)
        self.membership.read_initial_workers_file()
        self._console = log  # the split's line waits for the model (_say_split)
        self.membership.start_monitor()

    def _say_split(self) -> None:
        """The console's line of the split, once the model is known (with batch norm under the
        ring the master computes no images): each computing node's images per step."""
        log, self._console = self._console, None
        if log is not None:
            parts = ", ".join(f"{n.name} {c}" for (n, (_, c)) in self._ranges(self._batch))
            print(f"split by images: every node runs the whole network on its images ({parts} "
                  f"of {self._batch} per step)", file=log)  # fmt: skip

    def check_model(self, model) -> None:
        """Refuse a network the split cannot train (batch norm, naming the layer)."""
        self._take_spec(model.spec, model.input_shape)

    def _take_spec(self, spec, input_shape) -> None:
        refuse_batchnorm(spec)
        self._spec = spec_json(spec)
        shapes, _ = parameter_shapes(spec, input_shape)
        self._parameter_bytes = sum(FLOAT32.nbytes(shape) for shape in shapes.values())

    def _computing(self) -> list[Node]:
        """The nodes that get images this step: the master (when it computes, or when no
        worker is active) and the active workers, in node order."""
        workers = [n for n in self.nodes[1:] if n.state == ACTIVE]
        master = self.config.master_compute or not workers
        return ([self.nodes[0]] if master else []) + workers

    def _ranges(self, batch: int) -> list[tuple[Node, tuple[int, int]]]:
        """Each computing node's (first, count) of a batch: equal when deterministic or
        nothing is measured yet; else so that every node finishes together, from its measured
        seconds per image and its seconds per step that do not depend on them (its call's
        wall time beyond its computation: the parameters and gradients on its link); a node
        not measured yet counts as the mean of those measured."""
        nodes = self._computing()
        if self.config.deterministic or not self._seconds:
            seconds, fixed = [1.0] * len(nodes), None
        else:
            mean = float(np.mean(list(self._seconds.values())))
            seconds = [self._seconds.get(n.name, mean) for n in nodes]
            fixed = self._fixed_seconds(nodes)
        cut = image_ranges(batch, seconds, fixed)
        names = tuple(n.name for n in nodes)
        if fixed is not None and self._cut[:2] == (names, batch):
            last = self._cut[2]
            band = max(RANGES_DEADBAND, self._scatter(names))
            if _slowest(cut, seconds, fixed) > _slowest(last, seconds, fixed) * (1 - band):
                cut = last  # not worth a move: the figures scatter by more
        self._cut = (names, batch, cut)
        return list(zip(nodes, cut, strict=True))

    def _scatter(self, names: Sequence[str]) -> float:
        """:data:`SCATTER_BAND` times the largest relative standard error of the median among
        the windowed figures of the nodes ``names`` (1.25 MAD / median / sqrt(figures), the
        median's error for normal scatter); 0 with none."""
        worst = 0.0
        for name in names:
            window = self._windows.get(name)
            if window is None or len(window) < WINDOW_FIRST:
                continue
            middle = statistics.median(window)
            spread = statistics.median(abs(f - middle) for f in window)
            worst = max(worst, 1.25 * spread / middle / math.sqrt(len(window)))
        return SCATTER_BAND * worst

    def _fixed_seconds(self, nodes: list[Node]) -> list[float]:
        """Each computing node's seconds per step that do not depend on its images: a
        worker's call beyond its computation (the parameters and gradients on its link; a
        node not measured yet counts as the mean of those measured), none for the master."""
        mean = float(np.mean(list(self._fixed.values()))) if self._fixed else 0.0
        return [0.0 if n.is_master else self._fixed.get(n.name, mean) for n in nodes]

    def _measured(
        self, node: Node, images: int, seconds: float, wall: float = 0.0, waited: float = 0.0
    ) -> None:
        """Smooth in a node's step: ``seconds`` computing ``images``, ``waited`` of them in
        batch norm's sums, ``wall`` its call's. A node's first step is left out: it warms up (a
        worker builds the model, its channel connects). Its speed leaves the sums' waits out:
        they are the slowest rank's time, not its own (counted in, they gave the rank the
        others wait for the most images: resnet20 at batch 64 on the testbed drifted from 16
        images each to 14, 16, 16 and 18)."""
        if node.name not in self._warm:
            self._warm.add(node.name)
            return
        figure = seconds_per_image(images, seconds - waited)
        if math.isfinite(figure) and waited > 0:  # the median of the last few (see WINDOW)
            window = self._windows.setdefault(node.name, deque(maxlen=WINDOW))
            window.append(figure)
            if len(window) >= WINDOW_FIRST:  # until then, as a node not measured yet
                self._seconds[node.name] = statistics.median(window)
        elif math.isfinite(figure):
            old = self._seconds.get(node.name, figure)
            self._seconds[node.name] = (1 - SMOOTHING) * old + SMOOTHING * figure
        if not node.is_master and wall > 0:
            fixed = max(wall - seconds, 0.0)
            old = self._fixed.get(node.name, fixed)
            self._fixed[node.name] = (1 - SMOOTHING) * old + SMOOTHING * fixed

    def _measured_record(self, node: Node, images: int, figures: dict) -> None:
        """:meth:`_measured` from ``node``'s record of a step (its answer's figures)."""
        self._measured(node, images, figures["seconds"], figures.get("wall_seconds", 0.0),
                       figures.get("batchnorm_seconds", 0.0))  # fmt: skip

    def _retry_idle(self, ranges: list[tuple[Node, tuple[int, int]]]) -> None:
        """A worker the ranges give no image is not measured again: after
        :data:`IDLE_RETRY_STEPS` such steps its figures are forgotten, so it is tried again
        with the others' mean."""
        for node, (_, count) in ranges:
            if node.is_master:
                continue
            idle = self._idle.get(node.name, 0) + 1 if not count else 0
            self._idle[node.name] = idle
            if idle >= IDLE_RETRY_STEPS:
                self._seconds.pop(node.name, None)
                self._windows.pop(node.name, None)
                self._fixed.pop(node.name, None)
                self._warm.discard(node.name)
                self._idle[node.name] = 0

    def _deadline(self, node: Node, images: int, image_bytes: int) -> float:
        """Seconds ``node``'s call may take: its bytes over its measured link (the
        parameters out, their gradients back, the images), and its images at its measured
        seconds per image, each with the configured factor; before any measurement, at
        least :data:`FIRST_DEADLINE_S` for the computation (the worker builds the model)."""
        moved = self.config.transfer_deadline(node, 2 * self._parameter_bytes + image_bytes)
        figure = self._seconds.get(node.name)
        if figure is None:
            return moved + FIRST_DEADLINE_S
        return moved + self.config.deadline_factor * figure * images

    # -- a step ----------------------------------------------------------------------------

    def train_batch(self, model, x: np.ndarray, labels: np.ndarray, step: int):
        """The step's loss and hits, every parameter's gradient left in the model's layers
        (the batch's mean-loss gradient, summed over the nodes in order)."""
        if self._spec is None:
            self.check_model(model)
        self._say_split()
        batch = len(x)
        cut = self._ranges(batch)
        if not self.config.deterministic:
            self._retry_idle(cut)
        ranges = [(node, first, count) for node, (first, count) in cut if count]
        calls = {
            node.name: Call(
                images_step, node.client, self.session, step, model, self._spec,
                x[first : first + count], labels[first : first + count], first, batch,
                self._deadline(node, count, x[first : first + count].nbytes),
            )
            for node, first, count in ranges
            if not node.is_master
        }  # fmt: skip
        parts: dict[str, tuple] = {}
        for node, first, count in ranges:  # the master's own range, while workers compute
            if node.is_master:
                parts[node.name] = self._local(model, x, labels, first, count, batch, step)
                self._record[node.name] = {"images": count, "seconds": parts[node.name][3]}
        covered = [r for r in ranges if r[0].name in calls and not self._answer(r, calls, parts)]
        self._spot_check([r for r in ranges if r[0].name in parts], parts, model, x, labels)
        for node, first, count in covered:  # the same images and weights, here
            parts[node.name] = self._local(model, x, labels, first, count, batch, step)
            self._record[node.name] = {"images": count, "seconds": 0.0, "covered_by": MASTER}
        for node, _, count in ranges:
            figures = self._record[node.name]
            if "covered_by" not in figures:
                self._measured_record(node, count, figures)
        ordered = [parts[node.name] for node, _, _ in ranges]
        self._set_gradients(model, [p[0] for p in ordered])
        return batch_loss([p[1] for p in ordered], batch), np.concatenate([p[2] for p in ordered])

    def _answer(self, at: tuple[Node, int, int], calls: dict, parts: dict) -> bool:
        """Take a worker's answer into ``parts``; False, the worker lost, when its call
        failed."""
        node, _, count = at
        try:
            grads, losses, hits, stats = calls[node.name].result()
        except WorkerError as e:
            self.membership.lose(node, e)
            return False
        parts[node.name] = (grads, losses, hits, stats.compute_seconds)
        self._record[node.name] = {
            "images": count, "seconds": stats.compute_seconds, "wall_seconds": stats.wall_seconds,
            "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
        }  # fmt: skip
        return True

    def _spot_check(self, answered: list, parts: dict, model, x, labels) -> None:
        """On a step the spot checker draws, recompute the whole range of a few workers drawn
        in secret (``--spot-check-sample`` of them, from the step's answers) and compare every
        gradient and loss: a worker off by more than the tolerance is lost for the run and
        its range is the master's (the other ranges do not depend on it: nothing to redo)."""
        checker = self.spot_checks
        workers = [r for r in answered if not r[0].is_master]
        if checker is None or not checker.due or not workers:
            return
        drawn = checker.ranges(IMAGES, len(workers))
        for node, first, count in (workers[int(i)] for i in drawn):
            start = time.perf_counter()
            mine = self._local(model, x, labels, first, count, len(x), self.step)
            got = parts[node.name]
            comparisons = [
                Comparison(name, f"the gradient of {name}", got[0][name], want,
                           norm_scale(want), False, IMAGES_RTOL, norm=True)
                for name, want in mine[0].items()
            ]  # fmt: skip
            scale = float(np.abs(mine[1]).max(initial=0.0))
            comparisons.append(Comparison("losses", "the losses", got[1], mine[1], scale, False))
            checker.seconds += time.perf_counter() - start
            try:
                checker.compare(node, IMAGES, "step", comparisons)
            except SpotCheckFailed as e:
                self.membership.lose(node, e)
                parts[node.name] = mine
                self._record[node.name].update(covered_by=MASTER, spot_check="failed")

    def _local(self, model, x, labels, first: int, count: int, batch: int, step: int,
               overlap=None):  # fmt: skip
        """The master's range: (gradients, losses, hits, seconds); ``overlap`` is told each
        parameter's gradient as backward gives it (:func:`~hetconv.imagesplit.backward_hooks`)."""
        start = time.perf_counter()
        rows = slice(first, first + count)
        with backward_hooks(model, overlap):
            grads, losses, hits = images_gradients(
                model, x[rows], np.asarray(labels[rows]), first, batch, step
            )
        seconds = time.perf_counter() - start
        self._conv_seconds += seconds
        return grads, losses, hits, seconds

    @staticmethod
    def _set_gradients(model, parts: list[dict[str, np.ndarray]]) -> None:
        """The parts' sum, in order, as every layer's gradients."""
        for layer in model.layers:
            if layer.params:
                layer.grads = {
                    key: _sum_in_order([p[f"{layer.name}.{key}"] for p in parts])
                    for key in layer.params
                }

    # -- the calls a training run makes ----------------------------------------------------

    def forward(self, layer, x, w, b, padding):
        return self.backend.conv_forward(x, w, b, padding)

    def backward(self, layer, x, w, dy, padding, need_input_grad):
        dw, db, input_grad = self.backward_kernels_first(layer, x, w, dy, padding, need_input_grad)
        return input_grad(), dw, db

    def backward_kernels_first(self, layer, x, w, dy, padding, need_input_grad):
        """The master's range's kernel gradient before its input gradient: its part of the
        bucket goes to rank 0 while the input gradient computes (the same values)."""
        dw, db = self.backend.conv_grad_kernels(x, dy, w.shape[2:], padding)

        def input_grad():
            if not need_input_grad:
                return None
            return self.backend.conv_grad_input(dy, w, x.shape[2:], padding)

        return dw, db, input_grad

    def stage_mode(self, layer: str) -> str:
        return "unfused"

    def begin_step(self, step: int) -> None:
        """Admit workers that came (back) and let those whose line left go: the ranges of
        this step are cut over the nodes active now."""
        self.step = self.ctx.step = self._events.step = step
        self._record, self._conv_seconds = {}, 0.0
        if self.spot_checks is not None:
            self.spot_checks.start_step(step)
        self.membership.admit()

    def redo_step(self) -> bool:
        """Never: a worker caught by a spot check had its range recomputed by the master, and
        no other range depends on it."""
        if self.spot_checks is not None:
            self.spot_checks.take_caught()
        return False

    def end_step(self) -> dict:
        """This step's trace fields: ``split``, and per node its images, seconds and bytes."""
        record = self._record
        workers = [r for name, r in record.items() if name != MASTER and "bytes_sent" in r]
        conv = max((r["seconds"] for r in record.values()), default=0.0)
        wall = max((r["wall_seconds"] for r in workers), default=0.0)
        out = {
            "split": IMAGES,
            "workers_computed": len(workers),
            "comm_seconds": max(wall - conv, 0.0),
            "conv_seconds": max(conv, self._conv_seconds),
            "images": {name: r["images"] for name, r in record.items()},
            "nodes": record,
            "bytes_sent": sum(r["bytes_sent"] for r in workers),
            "bytes_received": sum(r["bytes_received"] for r in workers),
        }
        if events := self._events.take_step_events():
            out["events"] = events
        checks = self.spot_checks.record() if self.spot_checks is not None else None
        if checks is not None:
            out["spot_checks"] = checks
        return out

    def plan_record(self) -> dict:
        """The plan: ``split: images``, the nodes and the first step's images per node."""
        return {
            "split": IMAGES,
            "nodes": [
                {"name": n.name, "description": n.description, "state": str(n.state)}
                for n in self.nodes
            ],
            "images": {n.name: c for n, (_, c) in self._ranges(self._batch)},
            "exchange": "ps",
            "deterministic": self.config.deterministic,
            "parameter_bytes": self._parameter_bytes,
            "worker_bytes": self._worker_bytes(),
        }

    def _worker_bytes(self) -> dict[str, dict[str, int]]:
        """Per worker, the tensor bytes its call of the first step moves each way: the
        parameters and its images (palette8 where they fit) and labels out; the gradients,
        losses and hits back."""
        shape, fits = self._input
        out = {}
        for node, (_, count) in self._ranges(self._batch):
            if not node.is_master and count:
                images = (count, *shape)
                fmt = (
                    PALETTE8
                    if fits and PALETTE8.nbytes(images) < FLOAT32.nbytes(images)
                    else FLOAT32
                )
                out[node.name] = {
                    "sent": self._parameter_bytes + fmt.nbytes(images) + 4 * count,
                    "received": self._parameter_bytes + 8 * count,
                }
        return out

    def predict_step(
        self, comp_alone_s: float, comp_s: float, spec=None, chains_s=None
    ) -> dict | None:
        """Nothing predicted yet (no layer is probed); the model's ``spec`` is taken here,
        before the run starts: a network with batch norm is refused now, and the plan says
        what each worker's call moves."""
        if spec is not None:
            self._take_spec(spec, self._input[0])
            self._say_split()
        return None


def _sum_in_order(arrays: list[np.ndarray]) -> np.ndarray:
    total = np.array(arrays[0], np.float32)
    for a in arrays[1:]:
        total += a
    return total


__all__ = ["ImageSplit", "images_step"]
