"""What every worker handler checks of a request the same way."""

from __future__ import annotations

from hetconv.errors import InvalidCall
from hetconv.proto import worker_pb2 as pb


def request_padding(request: pb.ConvRequest) -> tuple[int, int, int, int]:
    """The request's padding (top, bottom, left, right); InvalidCall unless four sides >= 0."""
    if len(request.padding) != 4:
        raise InvalidCall(
            f"padding must have 4 sides (top, bottom, left, right), got {list(request.padding)}"
        )
    sides = tuple(int(v) for v in request.padding)
    if min(sides) < 0:
        raise InvalidCall(f"padding {sides} has a negative side")
    return sides  # type: ignore[return-value]
