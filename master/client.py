"""The master's connection to one worker: describe, probe, forward, backward, echo.

Each call streams its tensors with the codec in :mod:`hetconv.wire` and returns what it moved
and how long each part took (:class:`CallStats`), which the cluster sums into the trace.

With a token every call carries it as ``authorization: Bearer <token>`` metadata; with a CA
certificate the channel is TLS and the worker must present a certificate that CA signed, for
the host name or IP address in ``address`` (see :mod:`hetconv.security`). Which tensors each
call sends and expects back, and every RPC's codec, come from :mod:`hetconv.calls`.

With a 16-bit ``wire_format`` the activations this client sends (``x``, ``dy``) go in it and
every request asks the worker to answer its activations (``y``, ``dx``) in it too; kernels and
their gradients always travel as float32 (:mod:`hetconv.formats`).

The channel, its errors, describe and probe are :mod:`hetconv.master.client_connection`'s; the
calls of replicated and split blocks :mod:`hetconv.master.client_blocks`'s; those of resident
kernels :mod:`hetconv.master.client_resident`'s. Every name is importable from here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc
import numpy as np

from hetconv.calls import (
    BACKWARD,
    ECHO,
    FORWARD,
    STAGE_BACKWARD,
    STAGE_FORWARD,
    ConvCall,
    StageShape,
    call_shape,
)
from hetconv.errors import MalformedHeader, MalformedMessage, WireError
from hetconv.formats import FLOAT32, TensorFormat, answer_dtype
from hetconv.master.client_blocks import BlockCalls
from hetconv.master.client_connection import (
    CLOSED,
    CONNECT_GRACE_S,
    CONNECT_POLL_S,
    NOT_GRPC,
    REFUSED,
    CallStats,
    WorkerAuthError,
    WorkerConnection,
    WorkerError,
    WorkerTLSError,
    WorkerUnavailable,
)
from hetconv.master.client_resident import ResidentCalls
from hetconv.proto import worker_pb2 as pb
from hetconv.replica import ReplicaBlock
from hetconv.stages import BatchNormSlice, StageSpec, ops_to_proto, pack_batchnorm
from hetconv.wire import (
    BUNDLE_BYTES,
    Bundle,
    TensorReceiver,
    check_tensors,
    chunks,
    encode_tensors,
    receive_stream,
)

__all__ = [
    "CLOSED",
    "CONNECT_GRACE_S",
    "CONNECT_POLL_S",
    "NOT_GRPC",
    "REFUSED",
    "CallStats",
    "WorkerAuthError",
    "WorkerClient",
    "WorkerError",
    "WorkerTLSError",
    "WorkerUnavailable",
]


class WorkerClient(ResidentCalls, BlockCalls, WorkerConnection):
    """One worker, reached over a reusable gRPC channel.

    Args:
        address: ``HOST:PORT``.
        connect_timeout: seconds to wait for the worker to answer :meth:`describe`.
        token: the shared secret the worker was started with; sent with every call.
        tls_ca: PEM file of the CA (or the self-signed certificate) that signed the worker's
            certificate; given, the channel is TLS, else plain gRPC.
        wire_format: the format of activations and their gradients on the wire, both ways
            (float32, or a 16-bit one: smaller, not exact); kernels always go as float32.

    Raises:
        OSError, ValueError: ``tls_ca`` cannot be read or is not PEM; ``token`` cannot travel
            as metadata (each a one-line message naming it).
    """

    def _call(
        self,
        call: ConvCall,
        what: str,
        request: pb.ConvRequest,
        arrays: Sequence[tuple[str, np.ndarray]],
        expect: Sequence[str],
        destinations: dict[str, np.ndarray],
        timeout: float,
        answer_bytes: int,
        formats: Sequence[TensorFormat] | TensorFormat = FLOAT32,
        stream: bool = False,
    ) -> tuple[dict[str, np.ndarray], CallStats]:
        stats = CallStats()
        out = encode_tensors(arrays, formats)
        request.tensors.extend(out.headers)
        head = pb.ConvMessage(header=request)
        payload = out.nbytes
        stats.bytes_sent = head.ByteSize() + payload
        # An overlapped call streams whatever its size: its image groups move as they are
        # made or needed (hetconv.overlap); one message would wait for the last.
        stats.bundled = not stream and payload + answer_bytes <= BUNDLE_BYTES
        start = time.perf_counter()

        def messages():
            yield head
            yield from chunks(out.segments)
            stats.send_seconds = time.perf_counter() - start

        first_at = 0.0

        def receiver_for(first: pb.ConvMessage) -> TensorReceiver:
            nonlocal first_at
            first_at = time.perf_counter()
            kind = first.WhichOneof("kind")
            if kind != "result":
                raise MalformedMessage(f"answer started with {kind}, not a result")
            tensors = check_tensors(first.result.tensors, expect)
            dests = []
            for t in tensors:
                dest = destinations.get(t.name)
                if dest is None:
                    dest = np.empty(t.shape, t.format.host)
                elif dest.shape != t.shape:
                    raise MalformedHeader(
                        f"{t.name} came back with shape {t.shape}, expected {dest.shape}"
                    )
                dests.append(dest)
            return TensorReceiver.of(tensors, dests)

        try:
            if stats.bundled:
                # Small: one message each way (a unary call costs a sixth of a stream here).
                bundle = self._stubs[call.bundle.name]
                message = Bundle(head, out.segments)
                answer = bundle(message, timeout=timeout, metadata=self._metadata)
                stats.send_seconds = time.perf_counter() - start
                responses = iter([answer])
            else:
                stream = self._stubs[call.stream.name]
                responses = iter(stream(messages(), timeout=timeout, metadata=self._metadata))
            first, arrays_back = receive_stream(responses, receiver_for)
        except grpc.RpcError as e:
            raise self._error(e, what) from None
        except WireError as e:
            raise WorkerError(self.address, f"{what}: bad answer: {e}") from None
        end = time.perf_counter()
        stats.receive_seconds = end - first_at
        stats.wall_seconds = end - start
        stats.compute_seconds = first.result.compute_seconds
        stats.bytes_received = first.ByteSize() + sum(h.nbytes for h in first.result.tensors)
        return dict(zip(expect, arrays_back, strict=True)), stats

    def forward(
        self,
        session: int,
        step: int,
        layer: str,
        x: np.ndarray,
        w: np.ndarray,
        b: np.ndarray,
        padding: tuple[int, int, int, int],
        out: np.ndarray | None = None,
        timeout: float = 600.0,
        kernel_offset: int = 0,
    ) -> tuple[np.ndarray, CallStats]:
        """Feature maps of kernels ``w`` (k, C, kh, kw) over ``x`` (N, C, H, W).

        Args:
            out: where to write them, (N, k, Ho, Wo); may be a channel slice of a larger array.
        """
        request = pb.ConvRequest(
            phase=FORWARD.phase, session=session, step=step, layer=layer, padding=padding,
            kernel_offset=kernel_offset, answer_dtype=answer_dtype(self.wire_format),
        )  # fmt: skip
        fmt = self.wire_format
        answer = FORWARD.answer_bytes(call_shape(x.shape, w.shape, padding), fmt=fmt)
        (y,) = FORWARD.answer_names()
        got, stats = self._call(
            FORWARD, f"forward {layer}", request,
            list(zip(FORWARD.request_names, (x, w, b), strict=True)), [y],
            {y: out} if out is not None else {}, timeout, answer,
            list(FORWARD.request_formats(fmt).values()),
        )  # fmt: skip
        return got[y], stats

    def backward(
        self,
        session: int,
        step: int,
        layer: str,
        dy: np.ndarray,
        need_input_grad: bool,
        dw_out: np.ndarray | None = None,
        db_out: np.ndarray | None = None,
        timeout: float = 600.0,
        kernel_offset: int = 0,
        answer_bytes: int | None = None,
    ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, CallStats]:
        """(input-gradient part or None, dw, db) for the output-gradient slice ``dy``.

        The worker uses the inputs and kernels of its Forward call of the same step.
        ``answer_bytes`` (the size of dw, db and dx on the wire, dx in :attr:`wire_format`) lets
        a small call go as one message; without it the call streams.
        """
        request = pb.ConvRequest(
            phase=BACKWARD.phase, session=session, step=step, layer=layer,
            need_input_grad=need_input_grad, kernel_offset=kernel_offset,
            answer_dtype=answer_dtype(self.wire_format),
        )  # fmt: skip
        expect = BACKWARD.answer_names(need_input_grad)  # dw, db and, when asked for, dx
        dests = {n: a for n, a in zip(expect[:2], (dw_out, db_out), strict=True) if a is not None}
        answer = answer_bytes if answer_bytes is not None else BUNDLE_BYTES + 1
        got, stats = self._call(
            BACKWARD, f"backward {layer}", request,
            list(zip(BACKWARD.request_names, (dy,), strict=True)), expect, dests, timeout, answer,
            list(BACKWARD.request_formats(self.wire_format).values()),
        )  # fmt: skip
        dw, db, *dx = (got[name] for name in expect)
        return (dx[0] if dx else None), dw, db, stats

    def stage_forward(
        self,
        session: int,
        step: int,
        layer: str,
        x: np.ndarray,
        w: np.ndarray,
        b: np.ndarray,
        padding: tuple[int, int, int, int],
        stage: StageSpec,
        own: slice,
        out: np.ndarray | None = None,
        timeout: float = 600.0,
        kernel_offset: int = 0,
        batchnorm: Sequence[BatchNormSlice] = (),
        replica: ReplicaBlock | None = None,
        overlap_images: int = 0,
    ) -> tuple[np.ndarray, np.ndarray, CallStats]:
        """A fused stage (:mod:`hetconv.stages`): the output of ``stage`` on the kernels ``own``
        (offsets into ``w``) of the widened kernel slice ``w`` (k, C, kh, kw) over ``x``, and
        float32 (2 per training batch norm, owned) the batch mean and biased variance of the
        owned channels of each of the stage's batch norms (none in evaluation).

        Args:
            out: where to write it, (N, owned, Ho', Wo'); may be a channel slice.
            kernel_offset: the widened slice's first kernel in the layer (keys what the worker
                keeps for :meth:`stage_backward`).
            batchnorm: one :class:`~hetconv.stages.BatchNormSlice` of the widened slice per
                batch norm of ``stage``, all in the same mode.
            replica: the replicated block whose output ``x`` is (:mod:`hetconv.replica`): sent
                first (:meth:`replica_forward`), then ``x`` does not travel.
            overlap_images: the worker runs the stage on groups of this many images and sends
                each group's output as soon as it is computed (its backward then starts on each
                group as its gradient arrives); 0: the whole batch at once.
        """
        training = all(bn.training for bn in batchnorm)
        if any(bn.training != training for bn in batchnorm):
            raise ValueError(f"{layer}: the stage's batch norms are not all in one mode")
        request = pb.ConvRequest(
            phase=STAGE_FORWARD.phase, session=session, step=step, layer=layer,
            padding=padding, kernel_offset=kernel_offset,
            answer_dtype=answer_dtype(self.wire_format),
            stage=pb.StageDescription(
                ops=ops_to_proto(stage), own_start=own.start, own_count=own.stop - own.start,
                batchnorm_eval=bool(batchnorm) and not training,
            ),
            overlap_images=overlap_images,
        )  # fmt: skip
        fmt = self.wire_format
        conv = call_shape(x.shape, w.shape, padding)
        shape = StageShape(
            conv, own.stop - own.start, 0, stage.output_hw(conv.out_hw), len(batchnorm), training
        )
        bn = pack_batchnorm(batchnorm, w.shape[0])
        before, x = self._replicate(request, session, step, x, replica, timeout)
        y, stats_name = STAGE_FORWARD.answer_names()
        got, stats = self._call(
            STAGE_FORWARD, f"stage forward {layer}", request,
            list(zip(STAGE_FORWARD.request_names, (x, w, b, bn), strict=True)), [y, stats_name],
            {y: out} if out is not None else {}, timeout,
            STAGE_FORWARD.answer_bytes(shape, fmt=fmt),
            list(STAGE_FORWARD.request_formats(fmt).values()), stream=overlap_images > 0,
        )  # fmt: skip
        return got[y], got[stats_name], stats.add(before)

    def stage_backward(
        self,
        session: int,
        step: int,
        layer: str,
        dy: np.ndarray,
        grad_start: int,
        need_input_grad: bool,
        dw_out: np.ndarray | None = None,
        db_out: np.ndarray | None = None,
        timeout: float = 600.0,
        kernel_offset: int = 0,
        answer_bytes: int | None = None,
        replica: tuple[str, np.ndarray, np.ndarray] | None = None,
        grouped: bool = False,
    ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray, CallStats]:
        """(input-gradient part or None, dw, db, dbn) of the owned kernels of the stage the
        :meth:`stage_forward` of the same step and ``kernel_offset`` ran, for the gradient
        ``dy`` of its output over channels ``grad_start ..`` of the widened slice; ``dbn``
        float32 (2 per batch norm, owned): each batch norm's weight and bias gradients.

        ``replica``: (block, rw_out, rb_out) when the forward's input was the replicated
        ``block``'s output: the worker then answers no input-gradient part but the block's
        kernel and bias gradient parts, written into ``rw_out``, ``rb_out``.

        ``grouped``: the forward ran in image groups (``overlap_images``): the call streams,
        so the worker starts each group's backward as its rows of ``dy`` arrive."""
        request = pb.ConvRequest(
            phase=STAGE_BACKWARD.phase, session=session, step=step, layer=layer,
            need_input_grad=need_input_grad and replica is None, kernel_offset=kernel_offset,
            answer_dtype=answer_dtype(self.wire_format),
            stage=pb.StageDescription(grad_start=grad_start),
            replica_layer=replica[0] if replica is not None else "",
        )  # fmt: skip
        expect = STAGE_BACKWARD.answer_names(request.need_input_grad, replica is not None)
        dests = {n: a for n, a in zip(expect[:2], (dw_out, db_out), strict=True) if a is not None}
        if replica is not None:
            dests.update(rw=replica[1], rb=replica[2])
        answer = answer_bytes if answer_bytes is not None else BUNDLE_BYTES + 1
        got, stats = self._call(
            STAGE_BACKWARD, f"stage backward {layer}", request,
            list(zip(STAGE_BACKWARD.request_names, (dy,), strict=True)), expect, dests, timeout,
            answer, list(STAGE_BACKWARD.request_formats(self.wire_format).values()),
            stream=grouped,
        )  # fmt: skip
        dw, db, dbn = (got[name] for name in expect[:3])
        return got.get("dx"), dw, db, dbn, stats

    def echo(
        self,
        arrays: Sequence[tuple[str, np.ndarray]],
        timeout: float = 600.0,
        stream: bool = False,
        fmt: TensorFormat = FLOAT32,
    ) -> tuple[list[np.ndarray], CallStats]:
        """Send tensors and get them back: a round trip over this worker's link.

        ``stream`` forces the streaming call even for small tensors (to measure it); ``fmt``
        is the format the tensors travel in, both ways.
        """
        request = pb.ConvRequest(phase=ECHO.phase)
        names = [name for name, _ in arrays]
        size = BUNDLE_BYTES + 1 if stream else sum(fmt.nbytes(a.shape) for _, a in arrays)
        got, stats = self._call(ECHO, "echo", request, arrays, names, {}, timeout, size, fmt)
        return [got[n] for n in names], stats
