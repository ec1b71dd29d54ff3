"""What every worker handler checks of a request the same way: reading a call's request
(:class:`RequestReader`: its tensors, the worker's limits, the memory it will hold) and its
padding."""

from __future__ import annotations

import time
from collections.abc import Iterator

from hetconv.backends import conv_shape
from hetconv.calls import BACKWARD, ECHO, FORWARD, IMAGES_STEP, ConvCall
from hetconv.errors import InvalidCall, MalformedMessage, RequestTooLarge
from hetconv.formats import FLOAT32, answer_format
from hetconv.proto import worker_pb2 as pb
from hetconv.wire import TensorReceiver, WireTensor, check_tensors, receive_stream
from hetconv.worker.activity import Activity
from hetconv.worker.budget import MemoryBudget
from hetconv.worker.imagesplit import check_request as check_images_request


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


class RequestReader:
    """Reads a call's request and checks it before any work is done.

    Args:
        max_request_bytes: the largest request (all tensors together) accepted.
        budget: reserves what the call will hold before any array is allocated.
        activity: counts the bytes received, per session.
    """

    def __init__(
        self,
        max_request_bytes: int,
        budget: MemoryBudget,
        activity: Activity,
        device_bytes: int | None = None,
    ):
        self.max_request_bytes = max_request_bytes
        self.budget = budget
        self.activity = activity
        self.device_bytes = device_bytes  # a device backend's memory per call (None: host)

    def receive(
        self, messages: Iterator, call: ConvCall, progress=None
    ) -> tuple[pb.ConvRequest, list, float]:
        """Read and check a call's request; ``progress`` as :func:`~hetconv.wire.receive_stream`'s
        (given the request and the receiver)."""
        start = time.perf_counter()

        def receiver_for(first: pb.ConvMessage) -> TensorReceiver:
            kind = first.WhichOneof("kind")
            if kind != "header":
                raise MalformedMessage(f"stream started with {kind}, not a header")
            request = first.header
            if request.phase != call.phase:
                known = request.phase in pb.Phase.values()
                phase = pb.Phase.Name(request.phase) if known else request.phase
                raise InvalidCall(
                    f"request phase {phase} sent to the {pb.Phase.Name(call.phase)} call"
                )
            names = call.request_names
            if names is None:  # any tensors, as the header names them
                names = [h.name for h in request.tensors]
            tensors = check_tensors(request.tensors, names, self.max_request_bytes)
            if call is not ECHO:
                answer_format(request.answer_dtype)  # one it knows, before any data is read
            if call is FORWARD:
                self._check_forward(request, tensors)
            elif call is BACKWARD and len(tensors[0].shape) != 4:
                raise InvalidCall(
                    f"dy has shape {tensors[0].shape}, expected 4 dimensions (N, k, Ho, Wo)"
                )
            passes = 0
            if call is IMAGES_STEP:  # what the model and the images imply, before any data
                passes = check_images_request(
                    request, tensors, self.max_request_bytes, self.device_bytes
                )
            self._admit(call, request, tensors, passes)  # before any array is allocated
            return TensorReceiver.of(tensors)

        def advanced(first: pb.ConvMessage, receiver: TensorReceiver) -> None:
            progress(first.header, receiver)

        first, arrays = receive_stream(messages, receiver_for, advanced if progress else None)
        self.activity.received(first.header.session, sum(h.nbytes for h in first.header.tensors))
        return first.header, arrays, time.perf_counter() - start

    def _admit(
        self, call: ConvCall, request: pb.ConvRequest, tensors: list[WireTensor], passes: int = 0
    ) -> None:
        """Reserve what the call will hold: its request arrays (and staging buffers for a format
        that converts on arrival), its answer, twice (the arrays and their encoded bytes), and
        ``passes`` bytes its computation holds besides (an ImagesStep's forward and backward).
        A call whose answer size is not known here is covered once it is computed (the
        service's ``_run``).

        Raises:
            OverBudget: it does not fit the memory budget, or a Forward's saved state could
                never fit a session's share.
        """
        memory = self.budget.current()
        if memory is None:  # a core called outside a handler: nothing to meter
            return
        memory.session = request.session
        need = passes
        for t in tensors:
            need += FLOAT32.nbytes(t.shape)
            if t.format is not FLOAT32:
                need += t.format.nbytes(t.shape)
        fmt = answer_format(request.answer_dtype) if call is not ECHO else FLOAT32
        if call is FORWARD:
            x, w, _ = (t.shape for t in tensors)
            self.budget.check_state(FLOAT32.nbytes(x) + FLOAT32.nbytes(w), "this Forward")
            shape = conv_shape(x, w, request_padding(request))
            need += FORWARD.answer_bytes(shape) + FORWARD.answer_bytes(shape, fmt=fmt)
        elif call is BACKWARD:
            saved = self.budget.saved(request.session, (request.layer, request.kernel_offset))
            if saved is not None:
                shape = conv_shape(saved.x.shape, saved.w.shape, saved.padding)
                grad = request.need_input_grad
                need += BACKWARD.answer_bytes(shape, grad) + BACKWARD.answer_bytes(shape, grad, fmt)
        elif call is ECHO:
            need *= 2
        memory.reserve(need, f"this {call.name}", request.session)

    def _check_forward(self, request: pb.ConvRequest, tensors: list[WireTensor]) -> None:
        request_padding(request)
        x, w, b = (t.shape for t in tensors)
        if len(x) != 4 or len(w) != 4:
            raise InvalidCall(f"x {x} and w {w} must both have 4 dimensions (NCHW, KCHW)")
        if b != (w[0],):
            raise InvalidCall(f"b has shape {b}, expected ({w[0]},) for {w[0]} kernels")
        try:
            shape = conv_shape(x, w, tuple(request.padding))
        except ValueError as e:
            raise InvalidCall(str(e)) from None
        # The request's size is bounded on arrival; what it implies must be too: a few bytes
        # with a huge padding would otherwise ask for gigabytes of output.
        answer = FORWARD.answer_bytes(shape, fmt=answer_format(request.answer_dtype))
        if answer + tensors[0].format.nbytes(x) > self.max_request_bytes:
            raise RequestTooLarge(
                f"the feature maps would hold {answer} bytes: beyond this worker's limit "
                f"of {self.max_request_bytes} bytes per request"
            )


__all__ = ["RequestReader", "request_padding"]
