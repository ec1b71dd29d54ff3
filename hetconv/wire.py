"""Tensors on the wire: the codec both ends of a convolution stream share.

A convolution call is a stream of ``ConvMessage`` (see ``protos/hetconv/proto/worker.proto``):
one header naming every tensor (shape, dtype, byte count), then the tensors' raw little-endian
bytes in chunks of :data:`CHUNK_BYTES`. The receiver preallocates the arrays from the header and
copies each chunk straight into them (:class:`TensorReceiver`), so a tensor costs one copy on
each side of the socket beyond what gRPC itself does.

Data chunks skip the protobuf object model on both ends: a ``ConvMessage{data: bytes}`` is, on
the wire, the byte ``0x12``, a varint length and the payload, so :func:`serialize_message`
writes that prefix in front of an array's memory (one copy, which gRPC needs as ``bytes``
anyway) and :func:`deserialize_message` returns a zero-copy view of the payload. The bytes are
exactly what protobuf would produce, and anything else that arrives (headers, or a data chunk
encoded differently by another protobuf implementation) goes through the generated parser.
Measured on loopback this is ~2x the throughput of building ``ConvMessage`` objects
(``benchmarks/transport.py``).

What the bytes of each element type are lives in :mod:`hetconv.formats`, which tensors each
call carries in :mod:`hetconv.calls`, and what can be wrong (one exception type per fault, each
with its gRPC status) in :mod:`hetconv.errors`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hetconv.errors import MalformedHeader, MalformedMessage, RequestTooLarge
from hetconv.formats import FLOAT32, TensorFormat, byte_segments, format_of
from hetconv.proto import worker_pb2 as pb

#: Bytes of tensor data per stream message. 1 MiB streamed ~4x faster than one large message here.
CHUNK_BYTES = 1 << 20
#: gRPC message-size limit set on both ends: a chunk plus its header with ample headroom; a
#: request's total size is bounded separately by the worker (``max_request_bytes``).
MAX_MESSAGE_BYTES = 16 << 20
#: The element type of the arrays on both ends (and of the wire's only format so far).
WIRE_DTYPE = FLOAT32.wire

_MAX_DIMENSION = 1 << 31  # no real tensor axis is longer; bounds empty tensors' shapes too
_MAX_RANK = 8
_MAX_ELEMENTS = 1 << 40
_DATA_TAG = 0x12  # field 2 (data), wire type 2 (length-delimited)


@dataclass(frozen=True)
class Undecodable:
    """What the deserializers return for bytes that are no valid message. gRPC would turn an
    exception raised there into INTERNAL before any handler runs; returned instead, it reaches
    :func:`receive_stream`, which raises :class:`MalformedMessage` (INVALID_ARGUMENT) naming it."""

    reason: str


def channel_options() -> list[tuple[str, int]]:
    """gRPC options for the master's channels to its workers.

    The 4 MiB default message limit is raised deliberately (to :data:`MAX_MESSAGE_BYTES`);
    keepalive pings every 30 s keep idle Wi-Fi links and NAT entries from being dropped
    silently between steps, and notice a vanished worker within 40 s.
    """
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


#: Concurrent calls one connection may have open on a worker by default (HTTP/2
#: ``SETTINGS_MAX_CONCURRENT_STREAMS``): a master has a few at once; more wait in the client.
STREAMS_PER_CONNECTION = 8


def server_options(streams_per_connection: int = STREAMS_PER_CONNECTION) -> list[tuple[str, int]]:
    """gRPC options for a worker's server: the same message limits, acceptance of the
    master's 30 s keepalive pings (by default a server treats pings more often than every
    5 minutes as abuse and drops the connection), and at most ``streams_per_connection``
    concurrent calls per connection (so one client cannot take every handler thread)."""
    return [
        ("grpc.max_concurrent_streams", streams_per_connection),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 20_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def encode_varint(value: int) -> bytes:
    """``value`` (non-negative) as a protobuf varint."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def read_varint(buffer: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The protobuf varint at ``buffer[pos]``: (its value, the position after it).

    Raises:
        MalformedMessage: the buffer ends inside it, or it runs past 10 bytes (64 bits).
    """
    value, shift = 0, 0
    while pos < len(buffer) and shift < 64:
        byte = buffer[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise MalformedMessage("truncated or overlong varint")


def serialize_message(message: pb.ConvMessage | memoryview) -> bytes:
    """gRPC request/response serializer for ConvMessage streams.

    Args:
        message: a ``ConvMessage`` (header or result), or a contiguous byte view that is sent as
            ``ConvMessage{data: view}``.
    """
    if isinstance(message, memoryview):
        return b"".join((bytes((_DATA_TAG,)), encode_varint(message.nbytes), message))
    return message.SerializeToString()


def deserialize_message(buffer: bytes) -> pb.ConvMessage | memoryview:
    """gRPC deserializer: a data chunk comes back as a read-only view into ``buffer``."""
    if buffer and buffer[0] == _DATA_TAG:
        try:
            length, pos = read_varint(buffer, 1)
        except MalformedMessage:
            pass  # not our encoding: protobuf says what it is
        else:
            if pos + length == len(buffer):
                return memoryview(buffer)[pos:]
    try:
        message = pb.ConvMessage.FromString(buffer)
    except Exception as e:  # protobuf's DecodeError
        return Undecodable(f"undecodable message ({len(buffer)} bytes): {e}")
    if message.WhichOneof("kind") == "data":
        return memoryview(message.data)
    return message


#: Calls whose tensors (request and answer together) total at most this go as one message each
#: way (``ConvBundle``, a unary call): 0.5 ms per call here where a stream costs ~3 ms, while
#: above ~1 MiB chunked streaming moves bytes faster.
BUNDLE_BYTES = 1 << 20


@dataclass
class Bundle:
    """A whole call direction in one message: its header (or result) and all tensor bytes.

    ``message`` is a ``ConvMessage`` holding the header or result, so stream and bundle share
    one receiving path (:func:`receive_stream`); ``data`` is a byte view (receiving) or the
    list of views to concatenate (sending).
    """

    message: pb.ConvMessage
    data: memoryview | list[memoryview]


def serialize_bundle(bundle: Bundle) -> bytes:
    """Serializer of ``ConvBundle``: the header/result, then ``data`` written straight behind
    it (one copy of the tensors, the same bytes protobuf would produce)."""
    kind = bundle.message.WhichOneof("kind")
    if kind == "header":
        head = pb.ConvBundle(header=bundle.message.header)
    elif kind == "result":
        head = pb.ConvBundle(result=bundle.message.result)
    else:
        raise MalformedMessage(f"a bundle needs a header or result, got {kind}")
    views = bundle.data if isinstance(bundle.data, list) else [bundle.data]
    size = sum(v.nbytes for v in views)
    return b"".join((head.SerializeToString(), bytes((_DATA_TAG,)), encode_varint(size), *views))


def deserialize_bundle(buffer: bytes) -> Bundle:
    """Deserializer of ``ConvBundle``: ``data`` comes back as a view into ``buffer``."""
    fields: dict[int, tuple[int, int]] = {}
    pos, simple = 0, True
    while pos < len(buffer):
        tag = buffer[pos]
        if tag not in (0x0A, _DATA_TAG, 0x1A) or tag >> 3 in fields:
            simple = False  # unknown or repeated fields: let protobuf apply its merge rules
            break
        try:
            length, start = read_varint(buffer, pos + 1)
        except MalformedMessage:
            simple = False
            break
        if start + length > len(buffer):
            simple = False
            break
        fields[tag >> 3] = (start, start + length)
        pos = start + length
    if simple:
        view = memoryview(buffer)
        data = view[slice(*fields[2])] if 2 in fields else view[:0]
        try:
            if 1 in fields:
                head = pb.ConvRequest.FromString(view[slice(*fields[1])])
                message = pb.ConvMessage(header=head)
            elif 3 in fields:
                message = pb.ConvMessage(result=pb.ConvResult.FromString(view[slice(*fields[3])]))
            else:
                message = pb.ConvMessage()
        except Exception as e:  # protobuf's DecodeError
            return Undecodable(f"undecodable bundle header ({len(buffer)} bytes): {e}")
        return Bundle(message, data)
    try:
        parsed = pb.ConvBundle.FromString(buffer)
    except Exception as e:  # protobuf's DecodeError
        return Undecodable(f"undecodable bundle ({len(buffer)} bytes): {e}")
    if parsed.HasField("header"):
        message = pb.ConvMessage(header=parsed.header)
    elif parsed.HasField("result"):
        message = pb.ConvMessage(result=parsed.result)
    else:
        message = pb.ConvMessage()
    return Bundle(message, memoryview(parsed.data))


def tensor_header(name: str, array: np.ndarray, fmt: TensorFormat = FLOAT32) -> pb.TensorHeader:
    """The header that describes ``array`` (float32, C-contiguous) on the wire."""
    return fmt.header(name, array.shape)


def wire_array(name: str, array: np.ndarray, fmt: TensorFormat = FLOAT32) -> np.ndarray:
    """``array`` in the format's wire type (little-endian float32), C-contiguous: checked, never
    silently converted from another type."""
    if array.dtype != fmt.host:
        raise TypeError(f"{name} must be {fmt.host} for the wire, got {array.dtype}")
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array.astype(fmt.wire, copy=False)


@dataclass(frozen=True)
class Outgoing:
    """Tensors ready to send: their headers and their wire bytes as views, in order."""

    headers: list[pb.TensorHeader]
    segments: list[memoryview]

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.segments)


def encode_tensors(
    tensors: Sequence[tuple[str, np.ndarray]],
    fmt: TensorFormat | Sequence[TensorFormat] = FLOAT32,
) -> Outgoing:
    """Headers and wire bytes of named arrays (views of their memory where the format allows).

    Args:
        fmt: the format of every tensor, or one per tensor in order.

    Raises:
        TypeError: an array whose elements are not the format's host type (float32).
    """
    fmts = [fmt] * len(tensors) if isinstance(fmt, TensorFormat) else list(fmt)
    if len(fmts) != len(tensors):
        raise ValueError(f"{len(fmts)} formats for {len(tensors)} tensors")
    pairs = list(zip(tensors, fmts, strict=True))
    headers = [f.header(name, array.shape) for (name, array), f in pairs]
    segments = [v for (name, array), f in pairs for v in f.encode(array, name)]
    return Outgoing(headers, segments)


def chunks(segments: Iterable[memoryview], chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """Consecutive views of at most ``chunk_bytes`` over each byte view, in order."""
    for segment in segments:
        for start in range(0, segment.nbytes, chunk_bytes):
            yield segment[start : start + chunk_bytes]


def data_chunks(
    arrays: Iterable[np.ndarray], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[memoryview]:
    """Consecutive views of at most ``chunk_bytes`` over each array's memory, in order."""
    return chunks((v for array in arrays for v in byte_segments(array)), chunk_bytes)


def tensor_stream(
    head: pb.ConvMessage, arrays: Sequence[np.ndarray], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.ConvMessage | memoryview]:
    """The messages of one stream direction: the header, then every array's bytes."""
    yield head
    yield from data_chunks(arrays, chunk_bytes)


@dataclass(frozen=True)
class WireTensor:
    """A tensor header that passed :func:`check_tensors`: its name, shape and format."""

    name: str
    shape: tuple[int, ...]
    format: TensorFormat


def _check_shape(h: pb.TensorHeader, fmt: TensorFormat) -> tuple[int, ...]:
    shape = tuple(int(d) for d in h.shape)
    if any(d < 0 for d in shape):
        raise MalformedHeader(f"tensor {h.name} has a negative dimension in shape {shape}")
    if any(d > _MAX_DIMENSION for d in shape):
        raise MalformedHeader(f"tensor {h.name} has an absurd dimension in shape {shape}")
    if len(shape) > _MAX_RANK or math.prod(max(d, 1) for d in shape) > _MAX_ELEMENTS:
        raise MalformedHeader(
            f"tensor {h.name} has shape {shape}: more than {_MAX_RANK} dimensions or "
            "too many elements to hold, even when empty"
        )
    expected = fmt.nbytes(shape)
    if h.nbytes != expected:
        raise MalformedHeader(
            f"tensor {h.name} declares {h.nbytes} bytes but shape {shape} of {fmt.label} "
            f"holds {expected}"
        )
    return shape


def check_tensors(
    headers: Sequence[pb.TensorHeader],
    names: Sequence[str],
    max_bytes: int | None = None,
) -> list[WireTensor]:
    """Validate tensor headers against the names expected, in order.

    Raises:
        MalformedHeader: wrong names or count, a negative or absurd dimension, or an ``nbytes``
            that disagrees with the shape.
        UnsupportedFormat: a dtype with no format here (:func:`hetconv.formats.format_of`).
        RequestTooLarge: more than ``max_bytes`` in total.
    """
    got = [h.name for h in headers]
    if got != list(names):
        raise MalformedHeader(f"tensors {got} sent, expected {list(names)}")
    tensors, total = [], 0
    for h in headers:
        fmt = format_of(h)
        shape = _check_shape(h, fmt)
        total += h.nbytes
        if max_bytes is not None and total > max_bytes:
            raise RequestTooLarge(
                f"request holds more than {max_bytes} bytes of tensors (limit of this worker)"
            )
        tensors.append(WireTensor(h.name, shape, fmt))
    return tensors


def check_headers(
    headers: Sequence[pb.TensorHeader],
    names: Sequence[str],
    max_bytes: int | None = None,
) -> list[tuple[int, ...]]:
    """:func:`check_tensors`, returning only the shapes."""
    return [t.shape for t in check_tensors(headers, names, max_bytes)]


class TensorReceiver:
    """Fills preallocated arrays from data chunks as they arrive.

    Args:
        shapes: the shape of each tensor, in stream order (from :func:`check_headers`).
        arrays: optional preallocated destinations (of the formats' host type, float32, and
            matching shapes), each C-contiguous or contiguous per leading index (a channel slice
            of a larger NCHW array).
        formats: each tensor's format on the wire (default: all float32).
    """

    def __init__(
        self,
        shapes: Sequence[tuple[int, ...]],
        arrays: Sequence[np.ndarray] | None = None,
        formats: Sequence[TensorFormat] | None = None,
    ):
        formats = [FLOAT32] * len(shapes) if formats is None else list(formats)
        if arrays is None:
            arrays = [np.empty(shape, fmt.host) for shape, fmt in zip(shapes, formats, strict=True)]
        for shape, array, fmt in zip(shapes, arrays, formats, strict=True):
            if tuple(array.shape) != tuple(shape) or array.dtype != fmt.host:
                raise MalformedHeader(
                    f"tensor of shape {tuple(shape)} cannot be received into a "
                    f"{array.dtype} array of shape {array.shape}"
                )
        self.arrays = list(arrays)
        self._formats = formats
        # Where the bytes land: the arrays themselves, unless a format converts on arrival.
        self._buffers = [fmt.receive_buffer(a) for a, fmt in zip(self.arrays, formats, strict=True)]
        self._views = [v for a in self._buffers for v in byte_segments(a)]
        self.expected = sum(v.nbytes for v in self._views)
        self._decoded = [0] * len(self.arrays)  # leading rows of each already decoded
        self.received = 0
        self._index = 0  # tensor being filled
        self._offset = 0  # bytes of it filled so far

    @classmethod
    def of(
        cls, tensors: Sequence[WireTensor], arrays: Sequence[np.ndarray] | None = None
    ) -> TensorReceiver:
        """The receiver of tensors checked by :func:`check_tensors`."""
        return cls([t.shape for t in tensors], arrays, [t.format for t in tensors])

    def feed(self, chunk: memoryview) -> None:
        """Copy one chunk's bytes into the arrays; raises MalformedMessage on bytes beyond the
        header."""
        size = chunk.nbytes
        if self.received + size > self.expected:
            raise MalformedMessage(
                f"received {self.received + size} bytes of tensor data, the header declared "
                f"{self.expected}"
            )
        pos = 0
        while pos < size:
            while self._offset == self._views[self._index].nbytes:
                self._index, self._offset = self._index + 1, 0
            view = self._views[self._index]
            n = min(size - pos, view.nbytes - self._offset)
            view[self._offset : self._offset + n] = chunk[pos : pos + n]
            self._offset += n
            pos += n
        self.received += size

    def rows_in(self, index: int = 0) -> int:
        """Rows (along the first axis) of tensor ``index`` whose bytes have all arrived."""
        before = sum(b.nbytes for b in self._buffers[:index])
        buffer = self._buffers[index]
        if not buffer.shape or not buffer.shape[0]:
            return 0
        row = buffer.nbytes // buffer.shape[0]
        got = min(max(self.received - before, 0), buffer.nbytes)
        return got // row if row else buffer.shape[0]

    def decode_rows(self, index: int, rows: slice) -> None:
        """Make the next ``rows`` of tensor ``index`` (they follow those made readable before)
        readable in its array before :meth:`finish`: a format that converts on arrival
        converts them now, and :meth:`finish` only the rows after them."""
        if rows.start != self._decoded[index] or rows.stop > self.rows_in(index):
            raise ValueError(
                f"rows {rows.start}..{rows.stop - 1} of tensor {index}: the next are from row "
                f"{self._decoded[index]}, and only {self.rows_in(index)} are in"
            )
        buffer = self._buffers[index]
        if buffer is not self.arrays[index]:
            self._formats[index].decode_into(self.arrays[index][rows], buffer[rows])
        self._decoded[index] = rows.stop

    def finish(self) -> list[np.ndarray]:
        """The filled arrays; raises MalformedMessage when fewer bytes came than the header
        declared."""
        if self.received != self.expected:
            raise MalformedMessage(
                f"stream ended after {self.received} bytes of tensor data, the header declared "
                f"{self.expected}"
            )
        for array, buffer, fmt, done in zip(
            self.arrays, self._buffers, self._formats, self._decoded, strict=True
        ):
            if buffer is array:  # the bytes landed in place: nothing to convert
                continue
            if done:  # its first rows were decoded already (decode_rows)
                fmt.decode_into(array[done:], buffer[done:])
            else:
                fmt.decode_into(array, buffer)
        return self.arrays


def receive_stream(
    messages: Iterator[pb.ConvMessage | memoryview | Bundle],
    receiver_for: Callable[[pb.ConvMessage], TensorReceiver],
    progress: Callable[[pb.ConvMessage, TensorReceiver], None] | None = None,
) -> tuple[pb.ConvMessage, list[np.ndarray]]:
    """Read one call direction: its first message, then data chunks into arrays.

    A :class:`Bundle` (a unary call's whole message) is read the same way, its data fed at once.
    An answer whose result says ``timings_follow`` ends with one more result message after its
    data (the timings, known only once every byte was computed): they are copied into the
    first message's result.

    Args:
        messages: the incoming stream (deserialized by :func:`deserialize_message`).
        receiver_for: called with the first message; returns the :class:`TensorReceiver` (after
            validating the header, raising a :class:`~hetconv.errors.WireError` when it is wrong).
        progress: called with the first message and the receiver after each chunk is written
            (work can start on the bytes that are in while the rest arrives).

    Returns:
        (first message, filled arrays).

    Raises:
        MalformedMessage: undecodable bytes, no header first, a second header or result among
            the data, a missing or misplaced timings message, or tensor bytes that disagree
            with the header.
    """
    first = next(messages, None)
    if first is None:
        raise MalformedMessage("stream ended before its header")
    if isinstance(first, Undecodable):
        raise MalformedMessage(first.reason)
    if isinstance(first, memoryview):
        raise MalformedMessage("stream started with tensor data instead of a header")
    if isinstance(first, Bundle):
        if first.message.result.timings_follow:
            raise MalformedMessage("a one-message answer cannot say timings_follow")
        receiver = receiver_for(first.message)
        receiver.feed(first.data)
        if progress is not None:
            progress(first.message, receiver)
        return first.message, receiver.finish()
    receiver = receiver_for(first)
    trailer = first.WhichOneof("kind") == "result" and first.result.timings_follow
    timed = False  # the timings came: nothing may follow
    for message in messages:
        if isinstance(message, Undecodable):
            raise MalformedMessage(message.reason)
        if timed:
            raise MalformedMessage("a message arrived after the closing timings")
        if not isinstance(message, memoryview):
            kind = message.WhichOneof("kind") or "empty"
            if trailer and kind == "result" and receiver.received == receiver.expected:
                _take_timings(first, message)
                trailer, timed = False, True
                continue
            raise MalformedMessage(f"a second {kind} message arrived in the middle of tensor data")
        receiver.feed(message)
        if progress is not None:
            progress(first, receiver)
    if trailer:
        raise MalformedMessage("the answer said timings_follow but ended without them")
    return first, receiver.finish()


def _take_timings(first: pb.ConvMessage, last: pb.ConvMessage) -> None:
    """Copy the closing timings of a ``timings_follow`` answer into its first result."""
    if last.result.tensors or last.result.timings_follow:
        raise MalformedMessage("the closing timings message carries more than timings")
    first.result.compute_seconds = last.result.compute_seconds
    first.result.receive_seconds = last.result.receive_seconds
    first.result.timings_follow = False
