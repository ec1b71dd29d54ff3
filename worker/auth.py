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

Where the token comes from: the ``--token`` flag, else the environment variable
:data:`TOKEN_ENV`; the flag wins. The variable is the better place on a shared machine: any
user can read another's command line with ``ps``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

#: The environment variable a worker and a master read their token from when ``--token`` is
#: not given.
TOKEN_ENV = "HETCONV_TOKEN"
#: The call metadata key that carries ``Bearer <token>`` (lowercase: gRPC metadata keys are).
AUTH_METADATA = "authorization"

_BEARER = "Bearer "


def check_token(token: str, where: str = "--token") -> str:
    """``token`` if it can travel as a metadata value; raises ValueError naming ``where``.

    A token travels as an HTTP/2 header, so it must be non-empty visible ASCII (no spaces).
    """
    if not token:
        raise ValueError(f"{where} is empty; give a shared secret, or leave it out for no token")
    bad = sorted({c for c in token if not 33 <= ord(c) <= 126})
    if bad:
        raise ValueError(
            f"{where} contains {', '.join(repr(c) for c in bad)}; a token must be visible ASCII "
            "without spaces (it travels as an HTTP header), e.g. "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return token


def resolve_token(flag: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The token to use: ``flag`` (``--token``) if given, else ``$HETCONV_TOKEN`` if set and
    non-empty, else None (no token).

    Raises:
        ValueError: the chosen token is empty (an explicit ``--token ''``) or not visible ASCII.
    """
    if flag is not None:
        return check_token(flag, "--token")
    value = (os.environ if environ is None else environ).get(TOKEN_ENV)
    return check_token(value, TOKEN_ENV) if value else None


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token``."""
    return ((AUTH_METADATA, _BEARER + check_token(token, "token")),)


def read_pem(path: str | os.PathLike, what: str) -> bytes:
    """The bytes of a PEM file; raises OSError or ValueError with one line naming ``what`` and
    the file (gRPC itself would only say that a handshake failed, much later)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise OSError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path} is not a PEM file (no '-----BEGIN' line)")
    return data


def _digest(value: str | bytes) -> bytes:
    return hashlib.sha256(value.encode() if isinstance(value, str) else value).digest()


_HANDLER_FACTORIES: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _refusals(detail: str) -> dict[tuple[bool, bool], grpc.RpcMethodHandler]:
    """Per (request streaming, response streaming): a handler that only aborts."""

    def refuse(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, detail)

    # No request deserializer: the bytes a stranger sent are never parsed, and a streamed
    # request is never read at all.
    return {kinds: factory(refuse) for kinds, factory in _HANDLER_FACTORIES.items()}


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call whose metadata lacks ``Bearer <token>``.

    The refusal has the streaming kinds of the method it stands in for, so the client sees a
    clean status on any call type; an unknown method is refused the same way (a stranger does
    not learn which methods exist).
    """

    def __init__(self, token: str):
        self._expected = _digest(_BEARER + check_token(token, "token"))
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
    "AUTH_METADATA",
    "TOKEN_ENV",
    "TokenInterceptor",
    "WorkerSecurity",
    "bearer_metadata",
    "check_token",
    "is_loopback",
    "open_worker_warning",
    "read_pem",
    "resolve_token",
]
