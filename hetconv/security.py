"""What a master and its workers share about security: the token and how it travels, PEM files.

A worker started with a token refuses every call that does not carry it as the call metadata
``authorization: Bearer <token>`` (the worker's side, the check itself and TLS serving, is
:mod:`hetconv.worker.auth`). The master sends it with every call (:func:`bearer_metadata`).

Where the token comes from, on both sides: the ``--token`` flag, else the environment variable
:data:`TOKEN_ENV`; the flag wins (:func:`resolve_token`). The variable is the better place on a
shared machine: any user can read another's command line with ``ps``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The environment variable a worker and a master read their token from when ``--token`` is
#: not given.
TOKEN_ENV = "HETCONV_TOKEN"
#: The call metadata key that carries ``Bearer <token>`` (lowercase: gRPC metadata keys are).
AUTH_METADATA = "authorization"
#: What precedes the token in the metadata value.
BEARER = "Bearer "


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
    return ((AUTH_METADATA, BEARER + check_token(token, "token")),)


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


__all__ = [
    "AUTH_METADATA",
    "BEARER",
    "TOKEN_ENV",
    "bearer_metadata",
    "check_token",
    "read_pem",
    "resolve_token",
]
