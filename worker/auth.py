"""Who may talk to a worker: a shared token, TLS, and the warning for an open worker.

A worker started with a token refuses every call that does not carry it, as the call metadata
``authorization: Bearer <token>``, with UNAUTHENTICATED before any handler runs: the request is
not even parsed. That holds for every RPC of the server, grpc.health.v1 included (a health
answer tells a stranger that a worker is there and whether it is busy shutting down; whoever
checks health on a LAN can send the token as easily as the master). The token is compared in
constant time (:func:`hmac.compare_digest` on SHA-256 digests, so not even its length leaks).

The token authenticates the master; TLS (``--tls-cert``/``--tls-key`` on the worker,
``--tls-ca`` on the master) encrypts the link and authenticates the worker. Without TLS the
token and the tensors cross the network in the clear, so a token alone keeps out strangers who
cannot read the traffic, not ones who can.

Where the token comes from (``--token``, else :data:`~hetconv.security.TOKEN_ENV`), how it
travels and the PEM files: :mod:`hetconv.security`, which the master shares.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from hetconv.calls import HANDLER_FACTORIES
from hetconv.security import (
    AUTH_METADATA,
    BEARER,
    TOKEN_ENV,
    check_token,
    read_pem,
)


def _digest(value: str | bytes) -> bytes:
    return hashlib.sha256(value.encode() if isinstance(value, str) else value).digest()


def _refusals(detail: str) -> dict[tuple[bool, bool], grpc.RpcMethodHandler]:
    """Per (request streaming, response streaming): a handler that only aborts."""

    def refuse(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, detail)

    # No request deserializer: the bytes a stranger sent are never parsed, and a streamed
    # request is never read at all.
    return {kinds: factory(refuse) for kinds, factory in HANDLER_FACTORIES.items()}


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call whose metadata lacks ``Bearer <token>``.

    The refusal has the streaming kinds of the method it stands in for, so the client sees a
    clean status on any call type; an unknown method is refused the same way (a stranger does
    not learn which methods exist).
    """

    def __init__(self, token: str):
        self._expected = _digest(BEARER + check_token(token, "token"))
        self._missing = _refusals(
            "this worker requires a token: send the call metadata 'authorization: Bearer TOKEN' "
            f"(hetconv train --token, or {TOKEN_ENV})"
        )
        self._wrong = _refusals("wrong token")

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool | None:
        """True for exactly one matching ``authorization`` entry, None when there is none,
        False otherwise."""
        values = [value for key, value in metadata or () if key == AUTH_METADATA]
        if not values:
            return None
        # Every entry is compared (no early exit) and exactly one must be sent.
        matches = [hmac.compare_digest(_digest(value), self._expected) for value in values]
        return len(values) == 1 and matches[0]

    def intercept_service(self, continuation, handler_call_details):
        verdict = self.authorized(handler_call_details.invocation_metadata)
        if verdict:
            return continuation(handler_call_details)
        # Looking the handler up runs nothing of it; it only tells the streaming kinds.
        handler = continuation(handler_call_details)
        kinds = (
            (handler.request_streaming, handler.response_streaming)
            if handler is not None
            else (False, False)
        )
        return (self._missing if verdict is None else self._wrong)[kinds]


@dataclass(frozen=True)
class WorkerSecurity:
    """Who may use a worker and how its link is protected.

    Args:
        token: the shared secret every call must carry; None: anyone who can connect may call.
        tls_cert: PEM certificate chain the worker presents; with ``tls_key``, the worker
            serves TLS only.
        tls_key: PEM private key of ``tls_cert``.
    """

    # Secrets stay out of repr(), so a logged config does not leak them.
    token: str | None = field(default=None, repr=False)
    tls_cert: bytes | None = field(default=None, repr=False)
    tls_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.token is not None:
            check_token(self.token, "token")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")

    @classmethod
    def from_files(
        cls,
        token: str | None = None,
        tls_cert: str | os.PathLike | None = None,
        tls_key: str | os.PathLike | None = None,
    ) -> WorkerSecurity:
        """Read the PEM files; raises OSError/ValueError with one line naming a bad one."""
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key (or neither)")
        return cls(
            token,
            read_pem(tls_cert, "TLS certificate (--tls-cert)") if tls_cert else None,
            read_pem(tls_key, "TLS private key (--tls-key)") if tls_key else None,
        )

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [TokenInterceptor(self.token)] if self.token is not None else []

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for ``add_secure_port``, or None for plain gRPC."""
        if not self.tls:
            return None
        return grpc.ssl_server_credentials([(self.tls_key, self.tls_cert)])

    def credentials_usable(self) -> bool:
        """Whether gRPC accepts the TLS key and certificate: a throwaway server binds a free
        loopback port with them (gRPC reports a bad pair only as a failure to bind)."""
        credentials = self.server_credentials()
        if credentials is None:
            return True
        probe = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        try:
            return probe.add_secure_port("127.0.0.1:0", credentials) != 0
        except RuntimeError:
            return False
        finally:
            probe.stop(None)

    def describe(self) -> str:
        """One line for the worker's start-up output."""
        token = "token required" if self.token is not None else "no token (anyone may call)"
        tls = "TLS" if self.tls else "no TLS (plain text on the wire)"
        return f"security: {token}, {tls}"


def is_loopback(listen: str) -> bool:
    """Whether ``HOST:PORT`` (``[V6]:PORT`` too) only accepts connections from this machine:
    127.0.0.0/8, ::1 or ``localhost``. Anything else (0.0.0.0, ::, a LAN address, a host
    name) counts as reachable from the network."""
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def open_worker_warning(listen: str, security: WorkerSecurity) -> str | None:
    """The warning a worker prints at start when the network can reach it and no token
    guards it (multi-line, every line starting ``WARNING:``); None when there is nothing to
    warn about."""
    if is_loopback(listen) or security.token is not None:
        return None
    lines = [
        f"this worker listens on {listen} WITHOUT A TOKEN: anyone on the network who can",
        "reach this machine can use it (send it work, make it compute, see its device).",
        "Set a shared token on the worker and on the master, e.g.:",
        f"  export {TOKEN_ENV}=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')",
        "  then `hetconv worker ...` here and `hetconv train --worker HOST:PORT ...` on the",
        f"  master with the same {TOKEN_ENV} (or --token TOKEN on both; the flag wins, but",
        "  others can read flags with `ps`). Add --tls-cert/--tls-key here and --tls-ca on the",
        "  master to encrypt the link. Listen on 127.0.0.1 to serve this machine only.",
    ]
    return "\n".join(f"WARNING: {line}" for line in lines)


__all__ = [
    "TokenInterceptor",
    "WorkerSecurity",
    "is_loopback",
    "open_worker_warning",
]
