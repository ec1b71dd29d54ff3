"""The calls of resident kernels (:mod:`hetconv.master.resident`): place a slice of a layer's
kernels on the worker, fetch it back, and run a fused stage on it, forward and backward (the
worker updates its slice itself). A mixin of :class:`~hetconv.master.client.WorkerClient`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hetconv.calls import (
    FETCH_KERNELS,
    PLACE_KERNELS,
    RESIDENT_STAGE_BACKWARD,
    RESIDENT_STAGE_FORWARD,
    ResidentStageShape,
    StageShape,
    call_shape,
)
from hetconv.formats import answer_dtype
from hetconv.master.client_connection import CallStats
from hetconv.optim import SGDConfig
from hetconv.proto import worker_pb2 as pb
from hetconv.replica import ReplicaBlock
from hetconv.stages import BatchNormSlice, StageSpec, ops_to_proto, pack_batchnorm
from hetconv.wire import BUNDLE_BYTES


class ResidentCalls:
    """PlaceKernels, FetchKernels, ResidentStageForward and ResidentStageBackward, over the
    client's :meth:`_call`."""

    def place_kernels(
        self,
        session: int,
        layer: str,
        offset: int,
        version: int,
        w: np.ndarray,
        b: np.ndarray,
        mw: np.ndarray,
        mb: np.ndarray,
        momentum_started: bool,
        sgd: SGDConfig,
        timeout: float = 600.0,
        head: tuple[np.ndarray, np.ndarray] | None = None,
        fixed_bias: bool = False,
    ) -> CallStats:
        """Put kernels ``offset ..`` of ``layer`` (``w`` (k, C, kh, kw), ``b`` (k,)) on the
        worker with their momentum buffers ``mw``, ``mb`` and the optimizer's settings, at
        ``version``; it replaces what the worker held of the layer. ``head``: a split head's
        fc columns of the slice's channels and their momentum, (f, mf), each (k, P, classes)
        (:mod:`hetconv.head`). ``fixed_bias``: the layer has no bias (``b``, ``mb`` zeros): the
        worker never updates them."""
        f, mf = head if head is not None else (_no_head(w.shape[0]),) * 2
        request = pb.ConvRequest(
            phase=PLACE_KERNELS.phase, session=session, layer=layer, kernel_offset=offset,
            resident=pb.ResidentSlice(
                version=version, count=w.shape[0], momentum_started=momentum_started,
                lr=sgd.lr, momentum=sgd.momentum, weight_decay=sgd.weight_decay,
                head_classes=f.shape[2], fixed_bias=fixed_bias,
            ),
        )  # fmt: skip
        arrays = list(zip(PLACE_KERNELS.request_names, (w, b, mw, mb, f, mf), strict=True))
        _, stats = self._call(
            PLACE_KERNELS, f"place kernels {layer}", request, arrays, [], {}, timeout, 0
        )
        return stats

    def fetch_kernels(
        self,
        session: int,
        layer: str,
        version: int,
        outs: Sequence[np.ndarray] | None = None,
        timeout: float = 600.0,
    ) -> tuple[tuple[np.ndarray, ...], CallStats]:
        """(w, b, mw, mb, f, mf) of the slice of ``layer`` the worker holds at ``version``
        (``f``, ``mf`` (k, 0, 0) without a split head); written into ``outs`` (six arrays of
        their shapes) when given."""
        request = pb.ConvRequest(
            phase=FETCH_KERNELS.phase, session=session, layer=layer,
            resident=pb.ResidentSlice(version=version),
        )  # fmt: skip
        expect = FETCH_KERNELS.answer_names()
        dests = dict(zip(expect, outs, strict=True)) if outs is not None else {}
        size = sum(a.nbytes for a in outs) if outs is not None else BUNDLE_BYTES + 1
        got, stats = self._call(
            FETCH_KERNELS, f"fetch kernels {layer}", request, [], expect, dests, timeout, size
        )
        return tuple(got[n] for n in expect), stats

    def resident_stage_forward(
        self,
        session: int,
        step: int,
        layer: str,
        x: np.ndarray,
        hw: np.ndarray,
        hb: np.ndarray,
        halo_before: int,
        version: int,
        padding: tuple[int, int, int, int],
        stage: StageSpec,
        own_count: int,
        out: np.ndarray | None = None,
        timeout: float = 600.0,
        kernel_offset: int = 0,
        replica: ReplicaBlock | None = None,
        overlap_images: int = 0,
        hf: np.ndarray | None = None,
        batchnorm: Sequence[BatchNormSlice] = (),
        stats_out: np.ndarray | None = None,
    ) -> tuple[np.ndarray, CallStats]:
        """A fused stage on the worker's resident slice (``own_count`` kernels at ``version``)
        widened by the halo kernels ``hw``, ``hb`` (``halo_before`` of them before it);
        ``replica`` and ``overlap_images`` as :meth:`stage_forward`'s. ``hf``: with a split
        head (the slice was placed with one), the halo channels' fc columns (halo, P,
        classes); the answer is then the slice's partial logits (N, classes) (into ``out``,
        when given) instead of its stage output. ``batchnorm``: as :meth:`stage_forward`'s, of
        the widened slice; training, the owned channels' batch statistics (float32 (2 per batch
        norm, own_count)) are written into ``stats_out``, which must then be given."""
        training = all(bn.training for bn in batchnorm)
        if any(bn.training != training for bn in batchnorm):
            raise ValueError(f"{layer}: the stage's batch norms are not all in one mode")
        classes = hf.shape[2] if hf is not None else 0
        if hf is None:
            hf = _no_head(hw.shape[0])
        request = pb.ConvRequest(
            phase=RESIDENT_STAGE_FORWARD.phase, session=session, step=step, layer=layer,
            padding=padding, kernel_offset=kernel_offset,
            answer_dtype=answer_dtype(self.wire_format),
            stage=pb.StageDescription(
                ops=ops_to_proto(stage), own_start=halo_before, own_count=own_count,
                batchnorm_eval=bool(batchnorm) and not training,
            ),
            resident=pb.ResidentSlice(version=version, count=own_count, halo_before=halo_before),
            overlap_images=overlap_images,
        )  # fmt: skip
        fmt = self.wire_format
        widened = (own_count + hw.shape[0], *hw.shape[1:])
        conv = call_shape(x.shape, widened, padding)
        out_hw = stage.output_hw(conv.out_hw)
        stage_shape = StageShape(conv, own_count, 0, out_hw, len(batchnorm), training)
        shape = ResidentStageShape(stage_shape, 0, classes)
        bn = pack_batchnorm(batchnorm, widened[0])
        before, x = self._replicate(request, session, step, x, replica, timeout)
        y, z, stats_name = RESIDENT_STAGE_FORWARD.answer_names()
        want = z if classes else y
        dests = {want: out} if out is not None else {}
        if stats_out is not None:
            dests[stats_name] = stats_out
        got, stats = self._call(
            RESIDENT_STAGE_FORWARD, f"resident stage forward {layer}", request,
            list(zip(RESIDENT_STAGE_FORWARD.request_names, (x, hw, hb, hf, bn), strict=True)),
            [y, z, stats_name], dests, timeout,
            RESIDENT_STAGE_FORWARD.answer_bytes(shape, fmt=fmt),
            list(RESIDENT_STAGE_FORWARD.request_formats(fmt).values()), stream=overlap_images > 0,
        )  # fmt: skip
        return got[want], stats.add(before)

    def resident_stage_backward(
        self,
        session: int,
        step: int,
        layer: str,
        dy: np.ndarray,
        grad_start: int,
        version: int,
        need_input_grad: bool,
        edges_out: tuple[np.ndarray, ...] | None = None,
        timeout: float = 600.0,
        answer_bytes: int | None = None,
        replica: tuple[str, np.ndarray, np.ndarray] | None = None,
        grouped: bool = False,
        dz: np.ndarray | None = None,
        dbn_out: np.ndarray | None = None,
    ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, CallStats]:
        """(input-gradient part or None, ew, eb): the worker updates its resident slice (at
        ``version``; it then holds ``version + 1``) and answers its updated edge kernels;
        ``replica`` and ``grouped`` as :meth:`stage_backward`'s. ``dz``: with a split head,
        the logits' gradient (N, classes), sent instead of ``dy`` (then (N, 0, Ho', Wo'));
        ``edges_out`` may then hold a third array, for the edge channels' updated fc columns
        ``ef`` (edges, P, classes). ``dbn_out``: where the stage's batch norms' weight and bias
        gradients of the owned channels go (float32 (2 per batch norm, owned))."""
        if dz is None:
            dz = np.empty((dy.shape[0], 0), np.float32)
        request = pb.ConvRequest(
            phase=RESIDENT_STAGE_BACKWARD.phase, session=session, step=step, layer=layer,
            need_input_grad=need_input_grad and replica is None,
            answer_dtype=answer_dtype(self.wire_format),
            stage=pb.StageDescription(grad_start=grad_start),
            resident=pb.ResidentSlice(version=version),
            replica_layer=replica[0] if replica is not None else "",
        )  # fmt: skip
        expect = RESIDENT_STAGE_BACKWARD.answer_names(request.need_input_grad, replica is not None)
        dests = dict(zip(expect[:3], edges_out, strict=False)) if edges_out is not None else {}
        if replica is not None:
            dests.update(rw=replica[1], rb=replica[2])
        if dbn_out is not None:
            dests["dbn"] = dbn_out
        answer = answer_bytes if answer_bytes is not None else BUNDLE_BYTES + 1
        got, stats = self._call(
            RESIDENT_STAGE_BACKWARD, f"resident stage backward {layer}", request,
            list(zip(RESIDENT_STAGE_BACKWARD.request_names, (dy, dz), strict=True)), expect, dests,
            timeout, answer,
            list(RESIDENT_STAGE_BACKWARD.request_formats(self.wire_format).values()),
            stream=grouped,
        )  # fmt: skip
        ew, eb = got["ew"], got["eb"]
        return got.get("dx"), ew, eb, stats


def _no_head(rows: int) -> np.ndarray:
    """The fc columns of ``rows`` channels of a slice without a split head: (rows, 0, 0)."""
    return np.empty((rows, 0, 0), np.float32)
