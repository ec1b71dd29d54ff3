"""The master's channel to one worker and what can go wrong on it: the errors a call raises
(:class:`WorkerError` and its kinds), the reading of gRPC's reasons for a failed connection, and
the two calls that need no tensors, describe and probe. :class:`CallStats` is what every call
reports. :class:`~hetconv.master.client.WorkerClient` builds on :class:`WorkerConnection`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import grpc

from hetconv.backends import ConvShape
from hetconv.calls import DESCRIBE, METHODS, PROBE
from hetconv.formats import FLOAT32, TensorFormat
from hetconv.proto import worker_pb2 as pb
from hetconv.security import bearer_metadata, read_pem
from hetconv.wire import channel_options


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


class WorkerConnection:
    """The reusable gRPC channel to one worker, its errors, and describe and probe; the
    arguments are :class:`~hetconv.master.client.WorkerClient`'s."""

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
