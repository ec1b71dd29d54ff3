"""The worker's resident kernel calls (:mod:`hetconv.resident`, :mod:`hetconv.master.resident`).

PlaceKernels puts a kernel slice of a layer on this worker with its SGD state (momentum
buffers, settings) and a version; the worker keeps it, per session and layer, until another
placement of that layer replaces it or the session is evicted (least recently used, the
service's ``sessions`` bound). ResidentStageForward runs the fused stage with the slice's own
kernels and the halo kernels the request brings; ResidentStageBackward computes the slice's
gradients, applies the SGD update to the slice in place (version + 1) and answers the updated
edge kernels (its neighbours' next halo) and the input-gradient part. FetchKernels answers
the slice and its momentum at the version asked for.

Every call names the version it expects; a slice at another version (or none) is refused with
FAILED_PRECONDITION naming both, so a stale slice is never computed with.
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
from hetconv.optim import SGDConfig, sgd_update
from hetconv.proto import worker_pb2 as pb
from hetconv.resident import edge_rows, sgd_config, version_text
from hetconv.stages import StageRun, StageSpec, spec_from_proto, stage_backward, stage_forward
from hetconv.worker.overlap import (
    GroupedRun,
    GroupedStart,
    Streamed,
    check_overlap,
    forward_groups,
    grad_range,
)
from hetconv.worker.requests import request_padding


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


@dataclass
class _Run:
    step: int
    version: int
    run: StageRun
    spec: StageSpec


class ResidentCalls:
    """The four resident handlers' cores on a
    :class:`~hetconv.worker.service.ConvWorkerService` (its backend, device lock, request
    checks and session bound)."""

    def __init__(self, service):
        self.service = service
        self._lock = threading.Lock()
        # session -> layer -> the slice this worker holds
        self._slices: OrderedDict[int, dict[str, _Slice]] = OrderedDict()
        self._runs: dict[tuple[int, str], _Run] = {}

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
        request, (w, b, mw, mb), receive = self.service._receive(messages, PLACE_KERNELS)
        ref = request.resident
        if w.ndim != 4 or w.shape[0] < 1:
            raise InvalidCall(f"w has shape {w.shape}, expected (k >= 1, C, kh, kw)")
        if b.shape != (w.shape[0],) or mw.shape != w.shape or mb.shape != b.shape:
            raise InvalidCall(
                f"b {b.shape}, mw {mw.shape}, mb {mb.shape} must match w {w.shape} "
                f"(({w.shape[0]},), {w.shape}, ({w.shape[0]},))"
            )
        if ref.count != w.shape[0]:
            raise InvalidCall(f"resident.count is {ref.count}, but w holds {w.shape[0]} kernels")
        if ref.version == 0:
            raise InvalidCall("resident.version is 0; a placed slice needs a version above 0")
        try:
            config = sgd_config(ref)
        except ValueError as e:
            raise InvalidCall(f"optimizer settings: {e}") from None
        if not (np.isfinite(w).all() and np.isfinite(b).all()):
            raise InvalidCall("w or b holds NaN or Inf")
        placed = _Slice(
            request.kernel_offset,
            *(np.array(a, np.float32) for a in (w, b, mw, mb)),  # owned and writable
            started=ref.momentum_started,
            version=ref.version,
            config=config,
        )
        with self._lock:
            layers = self._slices.setdefault(request.session, {})
            layers[request.layer] = placed
            self._slices.move_to_end(request.session)
            while len(self._slices) > self.service.config.sessions:
                gone, _ = self._slices.popitem(last=False)
                for key in [k for k in self._runs if k[0] == gone]:
                    del self._runs[key]
        return [], 0.0, receive

    def fetch(self, messages: Iterator):
        request, _, receive = self.service._receive(messages, FETCH_KERNELS)
        held = self._held(request)
        formats = FETCH_KERNELS.answer_formats()
        arrays = (held.w, held.b, held.mw, held.mb)
        return [(n, a, f) for (n, f), a in zip(formats.items(), arrays, strict=True)], 0.0, receive

    def forward(self, messages: Iterator):
        service = self.service
        request, (x, hw, hb), receive = service._receive(messages, RESIDENT_STAGE_FORWARD)
        x = service.replicas.input_for(request, x)
        held = self._held(request)
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
        except ValueError as e:
            raise InvalidCall(str(e)) from None
        if spec.batchnorms:
            # The master sends a layer whose stage holds batch norm with its kernels (StageForward)
            raise InvalidCall(
                f"the stage holds {spec.batchnorms} batch norm layers: resident stages do not "
                "run batch norm; send it with StageForward"
            )
        # As StageForward: the stage's intermediates, a few times the widened feature maps,
        # must fit the worker's limit too.
        kept = 6 * 4 * conv.n * conv.k * conv.out_hw[0] * conv.out_hw[1]
        if kept > service.config.max_request_bytes:
            raise RequestTooLarge(
                f"the stage would hold {kept} bytes: beyond this worker's limit of "
                f"{service.config.max_request_bytes} bytes per request"
            )
        before = ref.halo_before
        w = np.concatenate([hw[:before], held.w, hw[before:]])
        b = np.concatenate([hb[:before], held.b, hb[before:]])
        own = slice(before, before + k)
        groups = check_overlap(request, spec, x.shape[0])
        start = time.perf_counter()
        ((name, fmt),) = RESIDENT_STAGE_FORWARD.answer_formats(
            fmt=answer_format(request.answer_dtype)
        ).items()
        if groups is not None:  # each group's output goes as soon as it is computed

            def keep(run: GroupedRun) -> None:
                with self._lock:
                    self._runs[request.session, request.layer] = _Run(
                        request.step, held.version, run, spec
                    )

            outputs = forward_groups(service, x, w, b, padding, spec, own, groups, keep)
            shape = (x.shape[0], k, *spec.output_hw(conv.out_hw))
            return Streamed([(name, shape, fmt)], ((0, y) for y in outputs), start, receive)

        def forward_work():
            out = stage_forward(service.backend, x, w, b, padding, spec, own)
            service.backend.synchronize()
            return out

        y, run = service._on_device(forward_work)
        compute = time.perf_counter() - start
        with self._lock:
            self._runs[request.session, request.layer] = _Run(request.step, held.version, run, spec)
        return [(name, y, fmt)], compute, receive

    def _kept(self, request: pb.ConvRequest) -> tuple[_Slice, _Run]:
        """The slice a resident stage backward names and its forward's run of the same step
        and version; MissingForward (FAILED_PRECONDITION) naming what is held otherwise."""
        held = self._held(request)
        with self._lock:
            kept = self._runs.get((request.session, request.layer))
        if kept is None or kept.step != request.step or kept.version != held.version:
            have = "nothing" if kept is None else f"step {kept.step}"
            raise MissingForward(
                f"no resident stage forward of layer {request.layer!r} at step {request.step} "
                f"with version {version_text(held.version)} (have {have}); send "
                "ResidentStageForward first"
            )
        return held, kept

    def backward(self, messages: Iterator):
        service = self.service
        grouped = GroupedStart(service, lambda request: self._kept(request)[1].run)
        request, (dy,), receive = service._receive(
            messages, RESIDENT_STAGE_BACKWARD, grouped.progress
        )
        held, kept = self._kept(request)
        run = kept.run
        grad = grad_range(run, dy.shape, request.stage.grad_start)
        start = grouped.started or time.perf_counter()
        replica = bool(request.replica_layer)

        def backward_work():
            need = request.need_input_grad or replica
            out = stage_backward(service.backend, run, dy, grad, need)
            service.backend.synchronize()
            return out

        dx, dw, db = grouped.result() if grouped.started else service._on_device(backward_work)
        # the block's gradients before the update: a refused call leaves the slice as it was
        through = service.replicas.gradients(request, dx) if replica else None
        with self._lock:
            del self._runs[request.session, request.layer]
            # The update, in place: bitwise what the master's SGD gives these rows.
            mw = sgd_update(held.w, dw, held.mw if held.started else None, held.config)
            mb = sgd_update(held.b, db, held.mb if held.started else None, held.config)
            if mw is not None:
                held.mw[...], held.mb[...] = mw, mb
            held.started = True
            held.version += 1
        rows = edge_rows(held.w.shape[0], kept.spec.halo)
        formats = RESIDENT_STAGE_BACKWARD.answer_formats(
            request.need_input_grad, answer_format(request.answer_dtype), replica
        )
        arrays = [held.w[rows], held.b[rows]]
        if through is not None:
            arrays += through
        elif request.need_input_grad:
            arrays.append(dx)
        answer = [(name, a, f) for (name, f), a in zip(formats.items(), arrays, strict=True)]
        return answer, time.perf_counter() - start, receive


__all__ = ["ResidentCalls", "StaleSlice"]
