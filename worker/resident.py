"""The worker's resident kernel calls (:mod:`hetconv.resident`, :mod:`hetconv.master.resident`).

PlaceKernels puts a kernel slice of a layer on this worker with its SGD state (momentum
buffers, settings) and a version; the worker keeps it, per session and layer, until another
placement of that layer replaces it or the session is evicted (least recently used, the
worker's ``sessions`` bound). ResidentStageForward runs the fused stage with the slice's own
kernels and the halo kernels the request brings; ResidentStageBackward computes the slice's
gradients, applies the SGD update to the slice in place (version + 1) and answers the updated
edge kernels (its neighbours' next halo) and the input-gradient part. FetchKernels answers
the slice and its momentum at the version asked for.

A stage with batch norm runs it as StageForward does: the request brings the batch norms'
weight and bias of the widened slice (their running statistics in evaluation), the forward
answers the owned channels' batch statistics and the backward their weight and bias
gradients; the master keeps and updates those parameters. A slice placed with ``fixed_bias``
(a convolution without bias) keeps its bias and its momentum exactly zero: the update skips
them.

What a slice holds (kernels, bias, momentum, split-head columns) is held in the worker's memory
budget from before it is copied until the layer is placed again or its session goes
(:meth:`~hetconv.worker.budget.MemoryBudget.hold`): a placement that does not fit is refused
(RESOURCE_EXHAUSTED) naming the layer and the budget, as is a session's layer beyond
:data:`MAX_LAYERS`. What a forward keeps for its backward (the stage's run) is a saved state in
the same budget, as a fused stage's is. Placed state holding NaN or Inf is refused.

Every call names the version it expects; a slice at another version (or none) is refused with
FAILED_PRECONDITION naming both, so a stale slice is never computed with.

On a device backend (cuda) the slice lives on the device: placed there once, computed with
there (the stage, the split head's logits and columns) and updated there; a call's tensors
cross once each way, and FetchKernels copies the slice back.

With a split head (:mod:`hetconv.head`) the slice also holds the final fc's columns of its
channels (``f``, momentum ``mf``): the forward answers the slice's partial logits ``z`` instead of
its stage output, the backward takes the logits' gradient ``dz`` and updates the columns beside
the kernels.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from hetconv.backends import conv_shape
from hetconv.calls import (
    FETCH_KERNELS,
    PLACE_KERNELS,
    RESIDENT_STAGE_BACKWARD,
    RESIDENT_STAGE_FORWARD,
)
from hetconv.errors import InvalidCall, MissingForward, RequestTooLarge
from hetconv.formats import answer_format
from hetconv.head import columns_grad, partial_logits, stage_grad
from hetconv.optim import SGDConfig, sgd_update
from hetconv.proto import worker_pb2 as pb
from hetconv.resident import edges, sgd_config, version_text
from hetconv.stages import (
    StageRun,
    StageSpec,
    batch_statistics_rows,
    batchnorm_grad_rows,
    kept_bytes,
    spec_from_proto,
    stage_backward,
    stage_forward,
    unpack_batchnorm,
)
from hetconv.worker.context import WorkerContext, answer
from hetconv.worker.overlap import (
    GroupedRun,
    GroupedStart,
    Streamed,
    check_overlap,
    forward_groups,
    grad_range,
)
from hetconv.worker.requests import request_padding

#: Resident layers one session may place on a worker (a network's convolutions are far fewer).
MAX_LAYERS = 256


class StaleSlice(MissingForward):
    """A call that names a slice version this worker does not hold (FAILED_PRECONDITION)."""


@dataclass
class _Slice:
    offset: int
    w: np.ndarray
    b: np.ndarray
    mw: np.ndarray
    mb: np.ndarray
    started: bool
    version: int
    config: SGDConfig
    f: np.ndarray  # the split head's columns (k, P, classes); (k, 0, 0) without a head
    mf: np.ndarray
    classes: int = 0
    fixed_bias: bool = False  # a convolution without bias: b and mb stay zero


@dataclass
class _Run:
    step: int
    version: int
    run: StageRun
    spec: StageSpec
    # a split head: the widened slice's fc columns and the owned channels' stage output
    head: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def held_bytes(self) -> int:
        """What it keeps for the backward, for the worker's memory budget."""
        head = sum(a.nbytes for a in self.head) if self.head is not None else 0
        return kept_bytes(self.run) + head


class ResidentCalls:
    """The four resident handlers' cores on a :class:`~hetconv.worker.context.WorkerContext`
    (its request checks, device thread and session bound)."""

    def __init__(self, context: WorkerContext):
        self.context = context
        self._lock = threading.Lock()
        # session -> layer -> the slice this worker holds
        self._slices: OrderedDict[int, dict[str, _Slice]] = OrderedDict()

    def cores(self) -> dict:
        """Each resident call's core, by call."""
        return {
            PLACE_KERNELS: self.place,
            FETCH_KERNELS: self.fetch,
            RESIDENT_STAGE_FORWARD: self.forward,
            RESIDENT_STAGE_BACKWARD: self.backward,
        }

    # -- the store ---------------------------------------------------------------------------

    def _held(self, request: pb.ConvRequest) -> _Slice:
        """The slice of the request's session and layer at the version it names."""
        want = request.resident.version
        with self._lock:
            held = self._slices.get(request.session, {}).get(request.layer)
            if held is not None:
                self._slices.move_to_end(request.session)
        if held is None:
            raise StaleSlice(
                f"layer {request.layer!r}: no resident slice for this session (request names "
                f"version {version_text(want)}); send PlaceKernels first"
            )
        if held.version != want:
            raise StaleSlice(
                f"layer {request.layer!r}: the request names slice version "
                f"{version_text(want)}, this worker holds version {version_text(held.version)}"
            )
        return held

    # -- the calls ---------------------------------------------------------------------------

    def place(self, messages: Iterator):
        request, (w, b, mw, mb, f, mf), receive = self.context.receive(messages, PLACE_KERNELS)
        ref = request.resident
        if w.ndim != 4 or w.shape[0] < 1:
            raise InvalidCall(f"w has shape {w.shape}, expected (k >= 1, C, kh, kw)")
        if b.shape != (w.shape[0],) or mw.shape != w.shape or mb.shape != b.shape:
            raise InvalidCall(
                f"b {b.shape}, mw {mw.shape}, mb {mb.shape} must match w {w.shape} "
                f"(({w.shape[0]},), {w.shape}, ({w.shape[0]},))"
            )
        classes = ref.head_classes
        head_ok = f.ndim == 3 and f.shape[0] == w.shape[0] and mf.shape == f.shape
        if classes:
            head_ok = head_ok and f.shape[1] >= 1 and f.shape[2] == classes
        else:
            head_ok = head_ok and f.shape[1:] == (0, 0)
        if not head_ok:
            want = f"({w.shape[0]}, P, {classes})" if classes else f"({w.shape[0]}, 0, 0)"
            raise InvalidCall(
                f"f {f.shape} and mf {mf.shape} must both be {want} (head_classes {classes})"
            )
        if ref.count != w.shape[0]:
            raise InvalidCall(f"resident.count is {ref.count}, but w holds {w.shape[0]} kernels")
        if ref.version == 0:
            raise InvalidCall("resident.version is 0; a placed slice needs a version above 0")
        try:
            config = sgd_config(ref)
        except ValueError as e:
            raise InvalidCall(f"optimizer settings: {e}") from None
        for names, arrays in (("w or b", (w, b)), ("mw or mb (the momentum)", (mw, mb))):
            if not all(np.isfinite(a).all() for a in arrays):
                raise InvalidCall(f"{names} holds NaN or Inf")
        if not np.isfinite(f).all():
            raise InvalidCall("f (the split head's columns) holds NaN or Inf")
        if not np.isfinite(mf).all():
            raise InvalidCall("mf (the split head's columns' momentum) holds NaN or Inf")
        if ref.fixed_bias and (b.any() or mb.any()):
            raise InvalidCall("fixed_bias is set (a layer without bias), but b or mb is not zero")
        self._hold(request, 4 * sum(a.size for a in (w, b, mw, mb, f, mf)))
        put = self.context.backend.to_device
        w, b, mw, mb, f, mf = (put(np.array(a, np.float32)) for a in (w, b, mw, mb, f, mf))
        placed = _Slice(  # owned, writable, on the device the stages run on
            request.kernel_offset,
            w,
            b,
            mw,
            mb,
            started=ref.momentum_started,
            version=ref.version,
            config=config,
            f=f,
            mf=mf,
            classes=classes,
            fixed_bias=ref.fixed_bias,
        )
        with self._lock:
            layers = self._slices.setdefault(request.session, {})
            layers[request.layer] = placed
            self._slices.move_to_end(request.session)
            while len(self._slices) > self.context.config.sessions:
                gone, held = self._slices.popitem(last=False)
                for layer in held:
                    self.context.budget.release(("resident", gone, layer))
        return [], 0.0, receive

    def _hold(self, request: pb.ConvRequest, nbytes: int) -> None:
        """Hold a placement's ``nbytes`` in the memory budget before it is copied; refused
        (RESOURCE_EXHAUSTED) beyond :data:`MAX_LAYERS` layers or the budget."""
        with self._lock:
            layers = self._slices.get(request.session, {})
            if request.layer not in layers and len(layers) >= MAX_LAYERS:
                raise RequestTooLarge(
                    f"layer {request.layer!r}: this session has resident slices of "
                    f"{len(layers)} layers on this worker, the most one session may place"
                )
        what = f"the resident slice of layer {request.layer!r} (kernels, momentum, head)"
        key = ("resident", request.session, request.layer)
        self.context.budget.hold(key, nbytes, what, request.session)

    def fetch(self, messages: Iterator):
        request, _, receive = self.context.receive(messages, FETCH_KERNELS)
        held = self._held(request)
        formats = FETCH_KERNELS.answer_formats()
        host = self.context.backend.to_host
        arrays = [host(a) for a in (held.w, held.b, held.mw, held.mb, held.f, held.mf)]
        return answer(formats, arrays), 0.0, receive

    def _check_forward(self, request: pb.ConvRequest, x, hw, hb, hf, bn, held: _Slice):
        """A resident stage forward's request against the slice held: (padding, spec, the
        widened slice's ConvShape, its batch norms); InvalidCall or RequestTooLarge naming
        what is wrong."""
        padding = request_padding(request)
        ref, d = request.resident, request.stage
        k = held.w.shape[0]
        if d.own_start != ref.halo_before or d.own_count != k:
            raise InvalidCall(
                f"stage owns {d.own_count} kernels from {d.own_start}; the resident slice has "
                f"{k} after {ref.halo_before} halo kernels"
            )
        if hw.ndim != 4 or hw.shape[1:] != held.w.shape[1:] or hb.shape != (hw.shape[0],):
            raise InvalidCall(
                f"halo hw {hw.shape}, hb {hb.shape} do not match the slice's kernels "
                f"{held.w.shape[1:]} (hw (halo, C, kh, kw), hb (halo,))"
            )
        if ref.halo_before > hw.shape[0]:
            raise InvalidCall(f"halo_before {ref.halo_before} exceeds the {hw.shape[0]} sent")
        try:
            spec = spec_from_proto(d.ops)
            conv = conv_shape(x.shape, (k + hw.shape[0], *held.w.shape[1:]), padding)
            spec.output_hw(conv.out_hw)
            batchnorm = unpack_batchnorm(bn, spec.batchnorms, not d.batchnorm_eval)
            for i, one in enumerate(batchnorm):
                one.check(i, conv.k)
        except ValueError as e:
            raise InvalidCall(str(e)) from None
        positions = int(np.prod(spec.output_hw(conv.out_hw)))
        want = (hw.shape[0], positions, held.classes) if held.classes else (hw.shape[0], 0, 0)
        if hf.shape != want or (held.classes and held.f.shape[1] != positions):
            raise InvalidCall(
                f"halo columns hf {hf.shape} and the slice's f {held.f.shape} do not fit the "
                f"stage: hf must be {want}, f ({k}, {positions}, {held.classes})"
            )
        # As StageForward: the stage's intermediates, a few times the widened feature maps,
        # must fit the worker's limit too.
        kept = 6 * 4 * conv.n * conv.k * conv.out_hw[0] * conv.out_hw[1]
        if kept > self.context.config.max_request_bytes:
            raise RequestTooLarge(
                f"the stage would hold {kept} bytes: beyond this worker's limit of "
                f"{self.context.config.max_request_bytes} bytes per request"
            )
        return padding, spec, conv, batchnorm

    def forward(self, messages: Iterator):
        ctx = self.context
        request, (x, hw, hb, hf, bn), receive = ctx.receive(messages, RESIDENT_STAGE_FORWARD)
        x = ctx.replicas.input_for(request, x)
        held = self._held(request)
        padding, spec, conv, batchnorm = self._check_forward(request, x, hw, hb, hf, bn, held)
        k, before = held.w.shape[0], request.resident.halo_before
        backend = ctx.backend
        xp, put = backend.xp, backend.to_device
        with backend.scope():  # the halo up once, beside the slice held there
            hw, hb = put(hw), put(hb)
            w = xp.concatenate([hw[:before], held.w, hw[before:]])
            b = xp.concatenate([hb[:before], held.b, hb[before:]])
        own = slice(before, before + k)
        groups = check_overlap(request, spec, x.shape[0])
        if groups is not None and held.classes:
            raise InvalidCall("a split head's stage answers logits: it does not run in groups")
        start = time.perf_counter()
        formats = RESIDENT_STAGE_FORWARD.answer_formats(fmt=answer_format(request.answer_dtype))
        (name, fmt), (z_name, z_fmt), (s_name, s_fmt) = formats.items()
        if groups is not None:  # each group's output goes as soon as it is computed

            def keep(run: GroupedRun) -> None:
                self._keep(request, _Run(request.step, held.version, run, spec))

            outputs = forward_groups(ctx, x, w, b, padding, spec, own, groups, keep)
            shape = (x.shape[0], k, *spec.output_hw(conv.out_hw))
            tensors = [  # no head: no z; no batch norm (check_overlap): no stats
                (name, shape, fmt),
                (z_name, (x.shape[0], 0), z_fmt),
                (s_name, (0, k), s_fmt),
            ]
            return Streamed(tensors, ((0, y) for y in outputs), start, receive)
        f = None
        if held.classes:
            with backend.scope():
                hf = put(hf)
                f = xp.concatenate([hf[:before], held.f, hf[before:]])

        def forward_work():
            y, run = stage_forward(backend, x, w, b, padding, spec, own, batchnorm, on_device=True)
            if f is not None:  # the logits' part instead of the maps: y stays for backward
                with backend.scope():
                    z = backend.to_host(partial_logits(y, held.f))
                answer = np.empty((y.shape[0], 0, *y.shape[2:]), np.float32)
            else:
                z, answer = np.empty((len(x), 0), np.float32), backend.to_host(y)
            backend.synchronize()
            return y, run, z, answer

        y, run, z, answer_y = ctx.run(forward_work)
        compute = time.perf_counter() - start
        self._keep(
            request, _Run(request.step, held.version, run, spec, (f, y) if f is not None else None)
        )
        y = answer_y
        stats = batch_statistics_rows(run)
        return [(name, y, fmt), (z_name, z, z_fmt), (s_name, stats, s_fmt)], compute, receive

    def _kept(self, request: pb.ConvRequest) -> tuple[_Slice, _Run]:
        """The slice a resident stage backward names and its forward's run of the same step
        and version; MissingForward (FAILED_PRECONDITION) naming what is held otherwise."""
        held = self._held(request)

        def missing(have: str) -> str:
            return (
                f"no resident stage forward of layer {request.layer!r} at step {request.step} "
                f"with version {version_text(held.version)} (have {have}); send "
                "ResidentStageForward first"
            )

        kept = self.context.kept_for_step(request, _run_key(request), missing)
        if kept.version != held.version:
            raise MissingForward(missing(f"version {version_text(kept.version)}"))
        return held, kept

    def _keep(self, request: pb.ConvRequest, kept: _Run) -> None:
        """Keep a forward's run for its backward, in the worker's memory budget."""
        self.context.keep(request, _run_key(request), kept)

    def backward(self, messages: Iterator):
        ctx = self.context
        grouped = GroupedStart(ctx, lambda request: self._kept(request)[1].run)
        request, (dy, dz), receive = ctx.receive(
            messages, RESIDENT_STAGE_BACKWARD, grouped.progress
        )
        held, kept = self._kept(request)
        run = kept.run
        start = grouped.started or time.perf_counter()
        backend = ctx.backend
        if kept.head is not None:  # the stage-output gradient from the logits' gradient
            f, y = kept.head
            if dy.shape[1] != 0 or dz.shape != (y.shape[0], held.classes):
                raise InvalidCall(
                    f"a split head's backward takes dz ({y.shape[0]}, {held.classes}) and an "
                    f"empty dy; got dz {dz.shape}, dy {dy.shape}"
                )
            grad = kept.spec.grad_range(run.own, f.shape[0])
            if grad.start != request.stage.grad_start:
                raise InvalidCall(
                    f"grad_start {request.stage.grad_start}; this slice's gradient starts at "
                    f"{grad.start} of its widened kernels"
                )
        elif dz.size:
            raise InvalidCall(f"dz {dz.shape} sent for a slice without a split head")
        else:
            grad = grad_range(run, dy.shape, request.stage.grad_start)
        replica = bool(request.replica_layer)

        first = ctx.split.rows_first(request) if replica else ()

        def backward_work():
            g, df = dy, None
            if kept.head is not None:
                with backend.scope():
                    dz_here = backend.to_device(dz)
                    g = stage_grad(dz_here, f[grad], y.shape[2:])
                    df = columns_grad(dz_here, y)
            need = request.need_input_grad or replica
            dx, dw, db = stage_backward(
                backend, run, g, grad, need, rows_first=first, on_device=True
            )
            backend.synchronize()
            return dx, dw, db, df

        if grouped.started:  # the kernel gradients stay where the update runs
            (dx, dw, db), df = grouped.result(on_device=True), None
        else:
            dx, dw, db, df = ctx.run(backward_work)
        # the block's gradients before the update: a refused call leaves the slice as it was
        through = ctx.replicas.gradients(request, dx) if replica else None
        self.context.budget.discard(request.session, _run_key(request))
        with self._lock, backend.scope():
            # The update, in place: bitwise what the master's SGD gives these rows.
            mw = sgd_update(held.w, dw, held.mw if held.started else None, held.config)
            if mw is not None:
                held.mw[...] = mw
            if not held.fixed_bias:  # a layer without bias keeps b and mb zero
                mb = sgd_update(held.b, db, held.mb if held.started else None, held.config)
                if mb is not None:
                    held.mb[...] = mb
            if df is not None:
                mf = sgd_update(held.f, df, held.mf if held.started else None, held.config)
                if mf is not None:
                    held.mf[...] = mf
            held.started = True
            held.version += 1
            halo, host = kept.spec.halo, backend.to_host
            arrays = [host(edges(a, halo)) for a in (held.w, held.b, held.f)]
        formats = RESIDENT_STAGE_BACKWARD.answer_formats(
            request.need_input_grad, answer_format(request.answer_dtype), replica
        )
        arrays.append(batchnorm_grad_rows(run))
        if through is not None:
            arrays += through
        elif request.need_input_grad:
            arrays.append(host(dx))
        return answer(formats, arrays), time.perf_counter() - start, receive


def _run_key(request: pb.ConvRequest) -> tuple[str, int]:
    """The key a resident stage forward's run is kept under in its session's saved states."""
    return (f"resident {request.layer}", 0)


__all__ = ["MAX_LAYERS", "ResidentCalls", "StaleSlice"]
