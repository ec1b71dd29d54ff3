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
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from hetconv.backends import ConvShape
from hetconv.calls import (
    BACKWARD,
    DESCRIBE,
    ECHO,
    FETCH_KERNELS,
    FETCH_PART,
    FORWARD,
    METHODS,
    PLACE_KERNELS,
    PROBE,
    PUT_PART,
    REPLICA_FORWARD,
    RESIDENT_STAGE_BACKWARD,
    RESIDENT_STAGE_FORWARD,
    STAGE_BACKWARD,
    STAGE_FORWARD,
    ConvCall,
    ResidentStageShape,
    StageShape,
    call_shape,
)
from hetconv.errors import MalformedHeader, MalformedMessage, WireError
from hetconv.formats import FLOAT32, TensorFormat, answer_dtype
from hetconv.optim import SGDConfig
from hetconv.proto import worker_pb2 as pb
from hetconv.replica import ReplicaBlock
from hetconv.security import bearer_metadata, read_pem
from hetconv.split import SplitPlan
from hetconv.stages import BatchNormSlice, StageSpec, ops_to_proto, pack_batchnorm
from hetconv.wire import (
    BUNDLE_BYTES,
    Bundle,
    TensorReceiver,
    channel_options,
    check_tensors,
    chunks,
    encode_tensors,
    receive_stream,
)


class WorkerError(RuntimeError):
    """A worker call failed. ``address`` names the worker, ``code`` the gRPC status if any."""

    def __init__(self, address: str, message: str, code: grpc.StatusCode | None = None):
        super().__init__(f"worker {address}: {message}")
        self.address = address
        self.code = code


class WorkerUnavailable(WorkerError):
    """The worker cannot be reached, went away, or missed its deadline."""


class WorkerTLSError(WorkerUnavailable):
    """The TLS handshake failed: a certificate or configuration problem that no retry fixes."""


class WorkerAuthError(WorkerError):
    """The worker refused this master's token (UNAUTHENTICATED): a configuration error to
    report, not a worker to retry or work around."""

    def __init__(self, address: str, had_token: bool):
        RuntimeError.__init__(
            self,
            f"worker {address} refused the token (UNAUTHENTICATED)"
            if had_token
            else f"worker {address} requires a token (UNAUTHENTICATED); give the master the "
            "worker's: --token TOKEN or HETCONV_TOKEN",
        )
        self.address = address
        self.code = grpc.StatusCode.UNAUTHENTICATED


def _no_head(rows: int) -> np.ndarray:
    """The fc columns of ``rows`` channels of a slice without a split head: (rows, 0, 0)."""
    return np.empty((rows, 0, 0), np.float32)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text and text.strip() else ""


def _handshake_failed(e: grpc.RpcError) -> bool:
    """Whether an UNAVAILABLE came from a TLS handshake (which no retry fixes)."""
    detail = (e.details() or "").lower() if hasattr(e, "details") else ""
    return any(
        word in detail for word in ("ssl", "handshake", "certificate", "tls", "verification")
    )


#: How long :meth:`WorkerClient.describe` keeps trying a port that refuses or closes the
#: connection (a worker that is starting), and how often it tries again meanwhile.
CONNECT_GRACE_S = 1.5
CONNECT_POLL_S = 0.2

REFUSED, NOT_GRPC, CLOSED = "refused", "not gRPC", "closed"


def _connect_failure(detail: str) -> str | None:
    """Why gRPC says a connection failed (REFUSED, NOT_GRPC, CLOSED), or None when it did not
    say (still connecting, timed out, or an error of another kind)."""
    text = detail.lower()
    if "connection refused" in text:
        return REFUSED
    if "http/2" in text or "settings frame" in text:
        return NOT_GRPC
    if "socket closed" in text or "connection reset" in text or "end of file" in text:
        return CLOSED
    return None


def _cause_text(detail: str) -> str:
    """gRPC's own reason without its prefixes: ``Failed parsing HTTP/2 (...)``."""
    return detail.rsplit(": ", 1)[-1] if ": " in detail else detail


def _worker_shut_down(code: grpc.StatusCode | None, detail: str) -> bool:
    """Whether a call failed because the worker's server stopped (Ctrl-C, SIGTERM) and
    cancelled it, not because this master cancelled it or the link broke."""
    text = (detail or "").strip().lower()
    if code == grpc.StatusCode.UNAVAILABLE:
        return "cancelling all calls" in text  # grpc's server shutdown
    if code == grpc.StatusCode.CANCELLED:
        # Cancelled by this side: "Locally cancelled by application!", "Channel closed!".
        return "locally" not in text and "channel closed" not in text
    return False


class _Deadline(grpc.RpcError):
    """The last UNAVAILABLE of :meth:`WorkerClient.describe`, reported as its deadline."""

    def __init__(self, last: grpc.RpcError):
        self._last = last

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._last.details() or ""


_EMPTY_INPUT = np.empty((0, 0, 0, 0), np.float32)  # x of a call whose input the worker has


@dataclass
class CallStats:
    """What one call moved and where its time went (seconds, as the master saw them)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    send_seconds: float = 0.0  # call start until the last request byte was handed to gRPC
    compute_seconds: float = 0.0  # as the worker measured it
    receive_seconds: float = 0.0  # first response message until the last
    wall_seconds: float = 0.0
    # True when request and answer were each one message (tensors under BUNDLE_BYTES): then
    # send_seconds spans the whole call and receive_seconds only the unpacking of the answer.
    bundled: bool = False

    def add(self, before: CallStats) -> CallStats:
        """This call's figures with those of ``before``, a call made just ahead of it for the
        same work (a replicated block's ReplicaForward), added in."""
        self.bytes_sent += before.bytes_sent
        self.bytes_received += before.bytes_received
        self.send_seconds += before.wall_seconds
        self.compute_seconds += before.compute_seconds
        self.wall_seconds += before.wall_seconds
        return self


class WorkerClient:
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

    def __init__(
        self,
        address: str,
        connect_timeout: float = 10.0,
        *,
        token: str | None = None,
        tls_ca: str | os.PathLike | None = None,
        wire_format: TensorFormat = FLOAT32,
    ):
        self.address = address
        self.wire_format = wire_format
        self.connect_timeout = connect_timeout
        self.tls_ca = tls_ca
        self._metadata = bearer_metadata(token) if token is not None else None
        if tls_ca is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=read_pem(tls_ca, "TLS CA certificate (--tls-ca)")
            )
            self._channel = grpc.secure_channel(address, credentials, options=channel_options())
        else:
            self._channel = grpc.insecure_channel(address, options=channel_options())

        # One callable per RPC of the service, each with its codec (hetconv.calls).
        self._stubs = {name: method.stub(self._channel) for name, method in METHODS.items()}
        self._describe, self._probe = self._stubs[DESCRIBE.name], self._stubs[PROBE.name]

    def close(self) -> None:
        self._channel.close()

    def _error(self, e: grpc.RpcError, what: str) -> WorkerError:
        code = e.code() if hasattr(e, "code") else None
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return WorkerAuthError(self.address, self._metadata is not None)
        if code == grpc.StatusCode.UNAVAILABLE and _handshake_failed(e):
            return self._tls_error(e)
        detail = e.details() if hasattr(e, "details") else str(e)
        gone = code in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.CANCELLED,
        )
        name = code.name if code is not None else "error"
        cls = WorkerUnavailable if gone else WorkerError
        if _worker_shut_down(code, detail):
            return cls(
                self.address,
                f"{what} failed: the worker shut down (cancelled its calls; {name}: {detail})",
                code,
            )
        return cls(self.address, f"{what} failed: {name}: {detail}", code)

    def _tls_error(self, e: grpc.RpcError) -> WorkerTLSError:
        host = self.address.rsplit(":", 1)[0]
        detail = (e.details() or "").lower()
        if self.tls_ca is None:
            why = "the worker may serve TLS (started with --tls-cert): pass its CA with --tls-ca"
        elif "certificate_verify_failed" in detail:
            why = f"its certificate is not signed by the CA in {self.tls_ca}"
        elif "hostname" in detail:
            why = f"its certificate does not name {host}; connect by a name or IP it lists"
        elif "wrong_version_number" in detail:
            why = "the worker does not serve TLS (started without --tls-cert); drop --tls-ca"
        else:
            why = (
                f"its certificate is not signed by the CA in {self.tls_ca}, does not name "
                f"{host}, or the worker does not serve TLS"
            )
        return WorkerTLSError(
            self.address,
            f"TLS handshake failed (UNAVAILABLE): {why} [{_first_line(e.details())}]",
            grpc.StatusCode.UNAVAILABLE,
        )

    def _unreachable(self, e: grpc.RpcError) -> WorkerError:
        """The error for a worker that did not answer :meth:`describe` in time."""
        if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
            return self._error(e, "describe")
        if e.code() == grpc.StatusCode.UNAVAILABLE and _handshake_failed(e):
            return self._tls_error(e)
        last = _first_line(e.details() or "") if hasattr(e, "details") else ""
        cause = _connect_failure(last)
        if cause is not None:
            return self._connect_error(cause, last)
        # Nothing came back at all (a firewall that drops, a machine that is off): a TLS
        # worker would have accepted the connection, so no TLS hint here.
        return WorkerUnavailable(
            self.address,
            f"no answer within {self.connect_timeout:g} s; is `hetconv worker` running there "
            f"and reachable?" + (f" [{last}]" if last else ""),
            e.code(),
        )

    def _connect_error(self, cause: str, detail: str) -> WorkerUnavailable:
        """The error for a connection that gRPC knows failed, and why (:func:`_connect_failure`)."""
        if cause == REFUSED:
            why = f"nothing listens on {self.address} (connection refused); is the port right?"
        elif cause == NOT_GRPC:
            why = f"{self.address} does not speak gRPC ({_cause_text(detail)}); is the port right?"
        else:  # CLOSED: it accepted the connection, then dropped it without an answer
            why = f"{self.address} closed the connection without answering"
            if self.tls_ca is None:  # what a TLS server does to a plain-text client
                why += " (a worker started with --tls-cert needs --tls-ca here)"
            why += f" [{detail}]"
        return WorkerUnavailable(self.address, why, grpc.StatusCode.UNAVAILABLE)

    def describe(self) -> pb.DeviceDescription:
        """The worker's device; waits up to ``connect_timeout`` for it to come up.

        A connection gRPC knows failed ends the wait early: refused or closed at once for
        :data:`CONNECT_GRACE_S` (a worker that is starting gets that long), or answered by
        something that is not gRPC (at once).

        Raises:
            WorkerAuthError: the worker refused the token (or wants one).
            WorkerUnavailable: no answer in time, nothing listening, not a gRPC server, or the
                TLS handshake failed (at once: a certificate problem does not go away by
                waiting).
        """
        request, start = pb.DescribeRequest(), time.monotonic()
        deadline = start + self.connect_timeout
        grace_until = start + min(CONNECT_GRACE_S, self.connect_timeout)
        while True:
            try:
                # Never wait_for_ready: a call on a channel whose connection failed fails at
                # once, with gRPC's reason, which decides whether waiting can help.
                left = max(deadline - time.monotonic(), 0.1)
                return self._describe(request, timeout=left, metadata=self._metadata)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or _handshake_failed(e):
                    raise self._unreachable(e) from None
                cause = _connect_failure(_first_line(e.details() or ""))
                now = time.monotonic()
                if cause == NOT_GRPC or (cause is not None and now >= grace_until):
                    raise self._unreachable(e) from None
                if now >= deadline:
                    raise self._unreachable(_Deadline(e)) from None
            time.sleep(min(CONNECT_POLL_S, max(deadline - time.monotonic(), 0.0)))

    def probe(
        self,
        shape: ConvShape,
        repeats: int = 2,
        with_grad_input: bool = True,
        timeout: float = 300.0,
    ) -> float:
        """Seconds the worker takes for forward + backward of ``shape`` on random data."""
        p = shape.padding
        request = pb.ProbeRequest(
            n=shape.n, c=shape.c, h=shape.h, w=shape.w, k=shape.k, kh=shape.kh, kw=shape.kw,
            padding=(p.top, p.bottom, p.left, p.right), repeats=repeats,
            with_grad_input=with_grad_input,
        )  # fmt: skip
        try:
            return self._probe(request, timeout=timeout, metadata=self._metadata).seconds
        except grpc.RpcError as e:
            raise self._error(e, "probe") from None

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

    def replica_forward(
        self,
        session: int,
        step: int,
        block: ReplicaBlock,
        timeout: float = 600.0,
        split: SplitPlan | None = None,
    ) -> CallStats:
        """Have the worker run the replicated ``block`` on the step's images and keep its
        output for the next layer's stage calls of ``step`` (:mod:`hetconv.replica`).

        ``split``: the block split by images (:mod:`hetconv.split`): only this worker's images
        travel, and the worker exchanges its output with the plan's other peers."""
        request = pb.ConvRequest(
            phase=REPLICA_FORWARD.phase, session=session, step=step, layer=block.layer,
            padding=block.sides,
            stage=pb.StageDescription(
                ops=ops_to_proto(block.stage), own_start=0, own_count=block.w.shape[0]
            ),
        )  # fmt: skip
        x, x_format = block.x, block.x_format
        if split is not None:
            request.split.CopyFrom(split.request_for(self.address))
            images = split.images(self.address)
            rows = getattr(x_format, "rows", None)  # a prepared palette8 encoding of the batch
            if rows is not None:  # this worker's rows of it
                x, x_format = rows(images)
            else:
                x = block.x[images]
        arrays = list(zip(REPLICA_FORWARD.request_names, (x, block.w, block.b), strict=True))
        formats = [x_format, FLOAT32, FLOAT32]  # the images: palette8 where they fit
        _, stats = self._call(
            REPLICA_FORWARD, f"replica forward {block.layer}", request, arrays, [], {}, timeout, 0,
            formats,
        )  # fmt: skip
        return stats

    def _replicate(self, request, session, step, x, replica, timeout):
        """With a replicated block: run it on the worker (or wait for the ReplicaForward the
        master started ahead, ``replica.started``), name it in ``request``; returns the
        ReplicaForward's figures and the ``x`` to send (empty). A call started ahead counts
        only the wait for it as wall time: the rest ran beside the master's own work."""
        if replica is None:
            return CallStats(), x
        pending = replica.started.pop(self.address, None)
        if pending is None:
            before = self.replica_forward(session, step, replica, timeout)
        else:
            waited = time.perf_counter()
            before = pending.result()  # its WorkerError, if it failed
            before = dataclasses.replace(before, wall_seconds=time.perf_counter() - waited)
        request.replica_layer = replica.layer
        return before, _EMPTY_INPUT

    def put_part(
        self,
        session: int,
        step: int,
        block: str,
        source: int,
        part: np.ndarray,
        gradient: bool,
        timeout: float = 600.0,
        round_: int = 0,
    ) -> CallStats:
        """Put a split block's ``part`` into the worker as node ``source`` (:mod:`hetconv.split`):
        the master resends a lost worker's output (``gradient`` False) or its input-gradient
        rows of this worker's images, from what it computed itself; ``round_``: the split's
        (:attr:`~hetconv.split.SplitPlan.round`)."""
        request = pb.ConvRequest(
            phase=PUT_PART.phase, session=session, step=step, layer=block,
            part=pb.TensorPart(source=source, gradient=gradient, round=round_),
        )  # fmt: skip
        _, stats = self._call(
            PUT_PART, f"put part {block}", request, [("p", part)], [], {}, timeout, 0,
            [self.wire_format],
        )  # fmt: skip
        return stats

    def fetch_part(
        self,
        session: int,
        step: int,
        block: str,
        source: int,
        timeout: float = 600.0,
        gradient: bool = True,
        out: np.ndarray | None = None,
    ) -> tuple[np.ndarray, CallStats]:
        """The input-gradient rows of node ``source``'s images the worker computed in its
        backward of ``step`` (sent to that node: one the master lost, or the master itself as
        a peer, ``split_all``); ``gradient`` False: node ``source``'s images' block output the
        worker holds (its own, for the master as a peer), written into ``out`` when given."""
        request = pb.ConvRequest(
            phase=FETCH_PART.phase, session=session, step=step, layer=block,
            answer_dtype=answer_dtype(self.wire_format),
            part=pb.TensorPart(source=source, gradient=gradient),
        )  # fmt: skip
        into = {"p": out} if out is not None else {}
        got, stats = self._call(
            FETCH_PART, f"fetch part {block}", request, [], ["p"], into, timeout,
            out.nbytes if out is not None else 0,
        )  # fmt: skip
        return got["p"], stats

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

    # -- resident kernels (hetconv.master.resident) -------------------------------------------

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
    ) -> CallStats:
        """Put kernels ``offset ..`` of ``layer`` (``w`` (k, C, kh, kw), ``b`` (k,)) on the
        worker with their momentum buffers ``mw``, ``mb`` and the optimizer's settings, at
        ``version``; it replaces what the worker held of the layer. ``head``: a split head's
        fc columns of the slice's channels and their momentum, (f, mf), each (k, P, classes)
        (:mod:`hetconv.head`)."""
        f, mf = head if head is not None else (_no_head(w.shape[0]),) * 2
        request = pb.ConvRequest(
            phase=PLACE_KERNELS.phase, session=session, layer=layer, kernel_offset=offset,
            resident=pb.ResidentSlice(
                version=version, count=w.shape[0], momentum_started=momentum_started,
                lr=sgd.lr, momentum=sgd.momentum, weight_decay=sgd.weight_decay,
                head_classes=f.shape[2],
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
    ) -> tuple[np.ndarray, CallStats]:
        """A fused stage on the worker's resident slice (``own_count`` kernels at ``version``)
        widened by the halo kernels ``hw``, ``hb`` (``halo_before`` of them before it);
        ``replica`` and ``overlap_images`` as :meth:`stage_forward`'s. ``hf``: with a split
        head (the slice was placed with one), the halo channels' fc columns (halo, P,
        classes); the answer is then the slice's partial logits (N, classes) (into ``out``,
        when given) instead of its stage output."""
        classes = hf.shape[2] if hf is not None else 0
        if hf is None:
            hf = _no_head(hw.shape[0])
        request = pb.ConvRequest(
            phase=RESIDENT_STAGE_FORWARD.phase, session=session, step=step, layer=layer,
            padding=padding, kernel_offset=kernel_offset,
            answer_dtype=answer_dtype(self.wire_format),
            stage=pb.StageDescription(
                ops=ops_to_proto(stage), own_start=halo_before, own_count=own_count
            ),
            resident=pb.ResidentSlice(version=version, count=own_count, halo_before=halo_before),
            overlap_images=overlap_images,
        )  # fmt: skip
        fmt = self.wire_format
        widened = (own_count + hw.shape[0], *hw.shape[1:])
        conv = call_shape(x.shape, widened, padding)
        out_hw = stage.output_hw(conv.out_hw)
        shape = ResidentStageShape(StageShape(conv, own_count, 0, out_hw), 0, classes)
        before, x = self._replicate(request, session, step, x, replica, timeout)
        y, z = RESIDENT_STAGE_FORWARD.answer_names()
        want = z if classes else y
        got, stats = self._call(
            RESIDENT_STAGE_FORWARD, f"resident stage forward {layer}", request,
            list(zip(RESIDENT_STAGE_FORWARD.request_names, (x, hw, hb, hf), strict=True)),
            [y, z], {want: out} if out is not None else {}, timeout,
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
    ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, CallStats]:
        """(input-gradient part or None, ew, eb): the worker updates its resident slice (at
        ``version``; it then holds ``version + 1``) and answers its updated edge kernels;
        ``replica`` and ``grouped`` as :meth:`stage_backward`'s. ``dz``: with a split head,
        the logits' gradient (N, classes), sent instead of ``dy`` (then (N, 0, Ho', Wo'));
        ``edges_out`` may then hold a third array, for the edge channels' updated fc columns
        ``ef`` (edges, P, classes)."""
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
