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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hetconv.proto import worker_pb2 as pb

#: Bytes of tensor data per stream message. 1 MiB streamed ~4x faster than one large message here.
CHUNK_BYTES = 1 << 20
#: gRPC message-size limit set on both ends: a chunk plus its header with ample headroom; a
#: request's total size is bounded separately by the worker (``max_request_bytes``).
MAX_MESSAGE_BYTES = 16 << 20
#: The one dtype on the wire: IEEE binary32, little-endian.
WIRE_DTYPE = np.dtype("<f4")

_MAX_DIMENSION = 1 << 31  # no real tensor axis is longer; bounds empty tensors' shapes too
_MAX_RANK = 8
_MAX_ELEMENTS = 1 << 40
_DATA_TAG = 0x12  # field 2 (data), wire type 2 (length-delimited)


class WireError(ValueError):
    """A message that does not match its header or the protocol: the sender's fault."""


@dataclass(frozen=True)
class Undecodable:
    """What the deserializers return for bytes that are no valid message. gRPC would turn an
    exception raised there into INTERNAL before any handler runs; returned instead, it reaches
    :func:`receive_stream`, which raises :class:`WireError` (INVALID_ARGUMENT) naming it."""

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


def server_options() -> list[tuple[str, int]]:
    """gRPC options for a worker's server: the same message limits, and acceptance of the
    master's 30 s keepalive pings (by default a server treats pings more often than every
    5 minutes as abuse and drops the connection)."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 20_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def serialize_message(message: pb.ConvMessage | memoryview) -> bytes:
    """gRPC request/response serializer for ConvMessage streams.

    Args:
        message: a ``ConvMessage`` (header or result), or a contiguous byte view that is sent as
            ``ConvMessage{data: view}``.
    """
    if isinstance(message, memoryview):
        return b"".join((bytes((_DATA_TAG,)), _varint(message.nbytes), message))
    return message.SerializeToString()


def deserialize_message(buffer: bytes) -> pb.ConvMessage | memoryview:
    """gRPC deserializer: a data chunk comes back as a read-only view into ``buffer``."""
    if buffer and buffer[0] == _DATA_TAG:
        length, shift, pos = 0, 0, 1
        while pos < len(buffer) and pos < 11:
            byte = buffer[pos]
            length |= (byte & 0x7F) << shift
            pos += 1
            if not byte & 0x80:
                if pos + length == len(buffer):
                    return memoryview(buffer)[pos:]
                break
            shift += 7
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
        raise WireError(f"a bundle needs a header or result, got {kind}")
    views = bundle.data if isinstance(bundle.data, list) else [bundle.data]
    size = sum(v.nbytes for v in views)
    return b"".join((head.SerializeToString(), bytes((_DATA_TAG,)), _varint(size), *views))


def _read_varint(buffer: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while pos < len(buffer) and shift < 64:
        byte = buffer[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise WireError("truncated or overlong varint in a bundle")


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
            length, start = _read_varint(buffer, pos + 1)
        except WireError:
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


def tensor_header(name: str, array: np.ndarray) -> pb.TensorHeader:
    """The header that describes ``array`` (float32, C-contiguous) on the wire."""
    return pb.TensorHeader(
        name=name, shape=array.shape, dtype=pb.FLOAT32, nbytes=array.size * WIRE_DTYPE.itemsize
    )


def wire_array(name: str, array: np.ndarray) -> np.ndarray:
    """``array`` as little-endian float32, C-contiguous: checked, never silently converted."""
    if array.dtype != np.float32:
        raise TypeError(f"{name} must be float32 for the wire, got {array.dtype}")
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array.astype(WIRE_DTYPE, copy=False)


def byte_segments(array: np.ndarray) -> list[memoryview]:
    """Byte views covering ``array`` in C order: one when contiguous, else one per leading index.

    A channel slice ``y[:, a:b]`` of an NCHW array is contiguous within each image, which is all
    the wire needs: tensors are sent from, and received into, such slices without a copy.
    """
    if array.size == 0:
        return []
    if array.flags.c_contiguous:
        return [memoryview(array).cast("B")]
    if array.ndim > 1 and array[0].flags.c_contiguous:
        return [memoryview(array[i]).cast("B") for i in range(array.shape[0])]
    raise ValueError(f"array of shape {array.shape} is not contiguous per leading index")


def data_chunks(
    arrays: Iterable[np.ndarray], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[memoryview]:
    """Consecutive views of at most ``chunk_bytes`` over each array's memory, in order."""
    for array in arrays:
        for segment in byte_segments(array):
            for start in range(0, segment.nbytes, chunk_bytes):
                yield segment[start : start + chunk_bytes]


def tensor_stream(
    head: pb.ConvMessage, arrays: Sequence[np.ndarray], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.ConvMessage | memoryview]:
    """The messages of one stream direction: the header, then every array's bytes."""
    yield head
    yield from data_chunks(arrays, chunk_bytes)


def check_headers(
    headers: Sequence[pb.TensorHeader],
    names: Sequence[str],
    max_bytes: int | None = None,
) -> list[tuple[int, ...]]:
    """Validate tensor headers against the names expected, in order; returns their shapes.

    Raises:
        WireError: wrong names or count, a dtype other than float32, a negative or absurd
            dimension, an ``nbytes`` that disagrees with the shape, or more than ``max_bytes``
            in total.
    """
    got = [h.name for h in headers]
    if got != list(names):
        raise WireError(f"tensors {got} sent, expected {list(names)}")
    shapes, total = [], 0
    for h in headers:
        if h.dtype != pb.FLOAT32:
            dtype = pb.DType.Name(h.dtype) if h.dtype in pb.DType.values() else h.dtype
            raise WireError(f"tensor {h.name} has dtype {dtype}, expected FLOAT32")
        shape = tuple(int(d) for d in h.shape)
        if any(d < 0 for d in shape):
            raise WireError(f"tensor {h.name} has a negative dimension in shape {shape}")
        if any(d > _MAX_DIMENSION for d in shape):
            raise WireError(f"tensor {h.name} has an absurd dimension in shape {shape}")
        if len(shape) > _MAX_RANK or math.prod(max(d, 1) for d in shape) > _MAX_ELEMENTS:
            raise WireError(
                f"tensor {h.name} has shape {shape}: more than {_MAX_RANK} dimensions or "
                "too many elements to hold, even when empty"
            )
        expected = math.prod(shape) * WIRE_DTYPE.itemsize
        if h.nbytes != expected:
            raise WireError(
                f"tensor {h.name} declares {h.nbytes} bytes but shape {shape} of float32 "
                f"holds {expected}"
            )
        total += expected
        if max_bytes is not None and total > max_bytes:
            raise WireError(
                f"request holds more than {max_bytes} bytes of tensors (limit of this worker)"
            )
        shapes.append(shape)
    return shapes


class TensorReceiver:
    """Fills preallocated arrays from data chunks as they arrive.

    Args:
        shapes: the shape of each tensor, in stream order (from :func:`check_headers`).
        arrays: optional preallocated destinations (float32, matching shapes), each C-contiguous
            or contiguous per leading index (a channel slice of a larger NCHW array).
    """

    def __init__(
        self, shapes: Sequence[tuple[int, ...]], arrays: Sequence[np.ndarray] | None = None
    ):
        if arrays is None:
            arrays = [np.empty(shape, WIRE_DTYPE) for shape in shapes]
        for shape, array in zip(shapes, arrays, strict=True):
            if tuple(array.shape) != tuple(shape) or array.dtype != WIRE_DTYPE:
                raise WireError(
                    f"tensor of shape {tuple(shape)} cannot be received into a "
                    f"{array.dtype} array of shape {array.shape}"
                )
        self.arrays = list(arrays)
        self._views = [v for a in self.arrays for v in byte_segments(a)]
        self.expected = sum(v.nbytes for v in self._views)
        self.received = 0
        self._index = 0  # tensor being filled
        self._offset = 0  # bytes of it filled so far

    def feed(self, chunk: memoryview) -> None:
        """Copy one chunk's bytes into the arrays; raises WireError on bytes beyond the header."""
        size = chunk.nbytes
        if self.received + size > self.expected:
            raise WireError(
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

    def finish(self) -> list[np.ndarray]:
        """The filled arrays; raises WireError when fewer bytes came than the header declared."""
        if self.received != self.expected:
            raise WireError(
                f"stream ended after {self.received} bytes of tensor data, the header declared "
                f"{self.expected}"
            )
        return self.arrays


def receive_stream(
    messages: Iterator[pb.ConvMessage | memoryview | Bundle],
    receiver_for: Callable[[pb.ConvMessage], TensorReceiver],
) -> tuple[pb.ConvMessage, list[np.ndarray]]:
    """Read one call direction: its first message, then data chunks into arrays.

    A :class:`Bundle` (a unary call's whole message) is read the same way, its data fed at once.

    Args:
        messages: the incoming stream (deserialized by :func:`deserialize_message`).
        receiver_for: called with the first message; returns the :class:`TensorReceiver` (after
            validating the header, raising WireError when it is wrong).

    Returns:
        (first message, filled arrays).
    """
    first = next(messages, None)
    if first is None:
        raise WireError("stream ended before its header")
    if isinstance(first, Undecodable):
        raise WireError(first.reason)
    if isinstance(first, memoryview):
        raise WireError("stream started with tensor data instead of a header")
    if isinstance(first, Bundle):
        receiver = receiver_for(first.message)
        receiver.feed(first.data)
        return first.message, receiver.finish()
    receiver = receiver_for(first)
    for message in messages:
        if isinstance(message, Undecodable):
            raise WireError(message.reason)
        if not isinstance(message, memoryview):
            raise WireError(
                f"a second {message.WhichOneof('kind') or 'empty'} message arrived in the "
                "middle of tensor data"
            )
        receiver.feed(message)
    return first, receiver.finish()
