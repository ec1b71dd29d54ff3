"""What can be wrong with a convolution call, one exception type per kind of fault.

Each type carries the gRPC status a worker answers with (:attr:`WireError.status`), and the
code that finds a fault raises the type that names it: the worker's service maps the exception's
type to its status (``context.abort(e.status, ...)``) and never reads an error's text. The master
raises the same types for a bad answer from a worker (and reports them as that worker's error).

    WireError                  INVALID_ARGUMENT     the base: the sender's fault
    ├── MalformedMessage       INVALID_ARGUMENT     undecodable bytes, messages in the wrong
    │                                               order, tensor bytes other than declared
    ├── MalformedHeader        INVALID_ARGUMENT     tensor names, shapes or byte counts wrong
    │   └── UnsupportedFormat  INVALID_ARGUMENT     a dtype with no tensor format here
    ├── InvalidCall            INVALID_ARGUMENT     a well-formed request the call cannot run:
    │                                               phase, padding, shapes that disagree
    ├── RequestTooLarge        RESOURCE_EXHAUSTED   over the worker's request limit (its
    │                                               tensors, or the answer they would produce)
    └── MissingForward         FAILED_PRECONDITION  a Backward whose Forward the worker lacks

:class:`WireError` is a :class:`ValueError`, as it always was.
"""

from __future__ import annotations

import grpc


class WireError(ValueError):
    """A message that does not match its header or the protocol: the sender's fault.

    ``status`` is the gRPC status a worker refuses the call with.
    """

    status: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT


class MalformedMessage(WireError):
    """Bytes that are no valid message, messages in the wrong order or of the wrong kind, or
    tensor data that does not add up to what the header declared."""


class MalformedHeader(WireError):
    """Tensor headers that break the rules: names, order, shape or byte count."""


class UnsupportedFormat(MalformedHeader):
    """A tensor whose dtype has no format on this side of the wire."""


class InvalidCall(WireError):
    """A well-formed request that the call cannot run (its phase, padding or shapes)."""


class RequestTooLarge(WireError):
    """A request over the worker's limit: its tensors, or the answer they would produce."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class MissingForward(WireError):
    """A Backward call whose Forward (same session, layer and step) the worker does not hold."""

    status = grpc.StatusCode.FAILED_PRECONDITION


__all__ = [
    "InvalidCall",
    "MalformedHeader",
    "MalformedMessage",
    "MissingForward",
    "RequestTooLarge",
    "UnsupportedFormat",
    "WireError",
]
