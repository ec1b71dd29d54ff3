"""Tensor formats: how each ``DType`` of the proto turns arrays into wire bytes and back.

A format is a small class that names its ``DType`` value and its element type on the wire;
the shared base does the rest: byte counts, headers, encoding (views of the array's memory, no
copy when the array already holds the wire's element type) and decoding (``np.frombuffer``,
zero-copy when the wire's element type is the array's). The registry :data:`FORMATS` is keyed
by the proto's enum, so a wire format is one class and one entry here::

    class Float16(TensorFormat):
        dtype = pb.FLOAT16
        wire = np.dtype("<f2")
        label = "float16"

Arrays on both ends stay float32 (:attr:`TensorFormat.host`); a format whose wire type differs
converts once on each side (:meth:`TensorFormat.to_wire`, :meth:`TensorFormat.to_host`). Every
value of the enum is either in :data:`FORMATS` or in :data:`UNSUPPORTED` with the reason
(``tests/test_calls.py`` checks).

The formats, and what each does to a float32 value (decoding is always exact):

* ``float32``: nothing; the wire carries the array's own bytes.
* ``float16`` (IEEE binary16): 11 significant bits (relative error at most 2^-11 ≈ 4.9e-4 for
  normal values), rounded to nearest even. Normal range 6.1e-5 .. 65504; below, subnormals in
  steps of 2^-24 ≈ 6e-8 (absolute error at most 2^-25), and magnitudes under 2^-25 become ±0;
  magnitudes that round beyond 65504 become ±inf. NaN stays NaN, ±inf stays ±inf.
* ``bfloat16``: float32's upper 16 bits, rounded to nearest even: float32's range, 8
  significant bits (relative error at most 2^-8 ≈ 3.9e-3 for normal values, 1.2e-38 and up);
  float32's subnormals in steps of 2^-133 (absolute error at most 2^-134), magnitudes under
  2^-134 become ±0; values within half a bfloat16 unit of float32's maximum round to ±inf.
  NaN stays NaN (quiet, sign kept), ±inf stays ±inf. Implemented on the bits with numpy.

Which tensors may travel in a 16-bit format (activations, never kernels) is the table of
calls' business (:mod:`hetconv.calls`).

One more format is not a wire format of activations but an exact encoding of images:

* ``palette8``: a tensor whose every channel (axis 1) holds at most 256 distinct values travels
  as each channel's values (a palette of 256 float32 entries: its distinct values in the order
  of their bits, then zeros) and one uint8 index per element, about a quarter of float32's
  bytes, and decodes to the very same bits. Normalised 8-bit pixels always fit (a channel's
  values are ``(p / 255 - mean) / std`` for at most 256 pixel values ``p``), so the images of a
  replicated first block travel so (:class:`~hetconv.replica.ReplicaBlock`); a tensor that does
  not fit cannot be sent in it (:meth:`Palette8.fits`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hetconv.errors import MalformedMessage, UnsupportedFormat
from hetconv.proto import worker_pb2 as pb


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


class TensorFormat:
    """One ``DType`` of the proto. Subclasses set the three class attributes; nothing else.

    Attributes:
        dtype: the ``DType`` enum value headers carry.
        wire: the element type of the bytes on the wire (little-endian).
        label: the element type's name in messages (``float32``).
        host: what arrays hold on both ends: the sender's, and those the receiver fills.
    """

    dtype: int
    wire: np.dtype
    label: str
    host: np.dtype = np.dtype(np.float32)

    @property
    def name(self) -> str:
        """The enum value's name, ``FLOAT32``."""
        return pb.DType.Name(self.dtype)

    @property
    def itemsize(self) -> int:
        """Bytes per element on the wire."""
        return self.wire.itemsize

    def nbytes(self, shape: Sequence[int]) -> int:
        """Bytes of a tensor of ``shape`` on the wire."""
        return math.prod(shape) * self.itemsize

    def header(self, name: str, shape: Sequence[int]) -> pb.TensorHeader:
        """The header of tensor ``name`` of ``shape`` in this format."""
        return pb.TensorHeader(name=name, shape=shape, dtype=self.dtype, nbytes=self.nbytes(shape))

    @property
    def exact(self) -> bool:
        """Whether a host array survives the wire unchanged (its element type is the wire's)."""
        return self.wire == self.host

    def to_wire(self, array: np.ndarray) -> np.ndarray:
        """``array`` (of :attr:`host` elements) converted to the wire's element type: a new
        C-contiguous array. Overflow is not an error: it gives ±inf, as documented above."""
        with np.errstate(over="ignore"):
            return np.ascontiguousarray(array).astype(self.wire)

    def to_host(self, wire: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Wire elements ``wire`` as :attr:`host` elements: into ``out`` when given (which may
        be a channel slice), else a new array."""
        if out is None:
            return wire.astype(self.host)
        out[...] = wire
        return out

    def encode(self, array: np.ndarray, name: str = "tensor") -> list[memoryview]:
        """The wire bytes of ``array``, as views in order: of its own memory (no copy) when its
        element type is the wire's and it is contiguous per leading index (a channel slice is).

        Raises:
            TypeError: ``array`` does not hold :attr:`host` elements (never silently converted).
        """
        if array.dtype != self.host:
            raise TypeError(f"{name} must be {self.host} for the wire, got {array.dtype}")
        if not self.exact:
            array = self.to_wire(array)
        return byte_segments(array)

    def _wire_view(self, data: bytes | memoryview | np.ndarray, shape: Sequence[int]) -> np.ndarray:
        expected = self.nbytes(shape)
        size = data.nbytes if isinstance(data, (memoryview, np.ndarray)) else len(data)
        if size != expected:
            raise MalformedMessage(
                f"{size} bytes of {self.label} data for shape {tuple(shape)}, which holds "
                f"{expected}"
            )
        if isinstance(data, np.ndarray):
            return data.reshape(shape).view(self.wire) if data.dtype != self.wire else data
        return np.frombuffer(data, self.wire).reshape(shape)

    def decode(self, data: bytes | memoryview, shape: Sequence[int]) -> np.ndarray:
        """An array of ``shape`` over the wire bytes ``data``: zero-copy (``np.frombuffer``,
        read-only when ``data`` is) when the wire's element type is the host's.

        Raises:
            MalformedMessage: ``data`` is not exactly the bytes of ``shape`` (an odd byte count
                for a 16-bit format, say).
        """
        array = self._wire_view(data, shape)
        return array if self.exact else self.to_host(array)

    def receive_buffer(self, dest: np.ndarray) -> np.ndarray:
        """The array whose memory the wire bytes for ``dest`` are written into: ``dest`` itself
        when the wire's element type is its own (no copy at all), else a staging array that
        :meth:`decode_into` converts into ``dest`` once every byte has come."""
        return dest if self.wire == dest.dtype else np.empty(dest.shape, self.wire)

    def decode_into(self, dest: np.ndarray, data: bytes | memoryview | np.ndarray) -> None:
        """Write the tensor whose wire bytes are ``data`` into ``dest``; nothing to do when
        ``data`` is ``dest`` (from :meth:`receive_buffer`).

        Raises:
            MalformedMessage: ``data`` is not exactly the bytes of ``dest``'s shape.
        """
        if data is dest:
            return
        self.to_host(self._wire_view(data, dest.shape), out=dest)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}: {self.label}, {self.itemsize} bytes>"


class Float32(TensorFormat):
    """IEEE 754 binary32, little-endian: the default, exact."""

    dtype = pb.FLOAT32
    wire = np.dtype("<f4")
    label = "float32"


class Float16(TensorFormat):
    """IEEE 754 binary16, little-endian: numpy's own conversion (round to nearest even)."""

    dtype = pb.FLOAT16
    wire = np.dtype("<f2")
    label = "float16"


class BFloat16(TensorFormat):
    """bfloat16, little-endian: the upper half of each float32's bits, rounded to nearest even.

    On the wire an element is a ``uint16`` holding those bits (numpy has no bfloat16 type);
    decoding shifts them back into place, so it is exact.
    """

    dtype = pb.BFLOAT16
    wire = np.dtype("<u2")
    label = "bfloat16"

    def to_wire(self, array: np.ndarray) -> np.ndarray:
        bits = np.ascontiguousarray(array).view(np.uint32)
        # Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then truncate.
        # A carry out of the mantissa bumps the exponent, which is exactly right (up to inf).
        rounded = (bits >> 16) & 1
        rounded += 0x7FFF
        rounded += bits
        rounded >>= 16
        out = rounded.astype(self.wire)
        nan = np.isnan(array)
        if nan.any():  # rounding could carry a NaN's payload into the sign: keep it a NaN
            out[nan.reshape(out.shape)] = ((bits[nan] >> 16) | 0x0040).astype(self.wire)
        return out

    def to_host(self, wire: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        host = (wire.astype(np.uint32) << 16).view(np.float32)
        if out is None:
            return host
        out[...] = host
        return out


class Palette8(TensorFormat):
    """At most 256 distinct values per channel (axis 1): per channel a palette of 256 float32
    entries (its distinct values in the order of their bits as uint32, then zeros), then one
    uint8 index per element, in C order. Exact both ways; only arrays that :meth:`fits` can be
    encoded.

    A tensor of fewer than two dimensions counts as one channel.
    """

    dtype = pb.PALETTE8
    wire = np.dtype("u1")
    label = "palette8"
    ENTRIES = 256

    @staticmethod
    def channels(shape: Sequence[int]) -> int:
        return int(shape[1]) if len(shape) >= 2 else 1

    def nbytes(self, shape: Sequence[int]) -> int:
        return self.channels(shape) * self.ENTRIES * 4 + math.prod(shape)

    def codes(self, array: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(palette float32 (channels, 256), uint8 indices of ``array``'s shape), or None when
        some channel holds more than 256 distinct values (NaNs count one each) or the array is
        not float32."""
        if array.dtype != self.host:
            return None
        shape = array.shape
        if array.ndim >= 2:  # (rows, channels, values): sizes given, as any may be 0
            lanes = array.reshape(shape[0], shape[1], math.prod(shape[2:]))
        else:
            lanes = array.reshape(1, 1, array.size)
        channels = lanes.shape[1]
        palette = np.zeros((channels, self.ENTRIES), np.float32)
        codes = np.empty(lanes.shape, np.uint8)
        for c in range(channels):
            # bits, not values: -0.0 and 0.0 stay apart and every NaN keeps its payload
            values, index = np.unique(lanes[:, c].view(np.uint32), return_inverse=True)
            if len(values) > self.ENTRIES:
                return None
            palette[c, : len(values)] = values.view(np.float32)
            codes[:, c] = index.reshape(lanes.shape[0], lanes.shape[2])
        return palette, codes.reshape(shape)

    def fits(self, array: np.ndarray) -> bool:
        """Whether ``array`` can be sent in this format."""
        return self.codes(array) is not None

    def prepared(self, array: np.ndarray) -> Palette8 | None:
        """This format with ``array``'s encoding made once, for an array sent to several
        workers: its :meth:`encode` of ``array`` (the same object) returns those bytes again.
        None when ``array`` does not fit."""
        coded = self.codes(np.ascontiguousarray(array))
        return None if coded is None else _Prepared(array, coded)

    def encode(self, array: np.ndarray, name: str = "tensor") -> list[memoryview]:
        """The palette's bytes, then the indices' (new arrays: this format always converts).

        Raises:
            TypeError: ``array`` is not float32.
            ValueError: some channel of ``array`` holds more than 256 distinct values.
        """
        if array.dtype != self.host:
            raise TypeError(f"{name} must be {self.host} for the wire, got {array.dtype}")
        coded = self.codes(np.ascontiguousarray(array))
        if coded is None:
            raise ValueError(
                f"{name} has more than {self.ENTRIES} distinct values in a channel: it cannot "
                f"travel as {self.label}"
            )
        return _palette_segments(coded)

    def _parts(self, data, shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        expected = self.nbytes(shape)
        raw = data.reshape(-1) if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
        if raw.nbytes != expected:
            raise MalformedMessage(
                f"{raw.nbytes} bytes of {self.label} data for shape {tuple(shape)}, which holds "
                f"{expected}"
            )
        raw = raw.view(np.uint8)
        split = self.channels(shape) * self.ENTRIES * 4
        palette = raw[:split].view("<f4").reshape(self.channels(shape), self.ENTRIES)
        return palette, raw[split:].reshape(shape)

    def to_wire(self, array: np.ndarray) -> np.ndarray:
        raise TypeError(f"{self.label} encodes whole tensors only (encode)")

    def to_host(self, wire: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        raise TypeError(f"{self.label} decodes whole tensors only (decode, decode_into)")

    def decode(self, data: bytes | memoryview, shape: Sequence[int]) -> np.ndarray:
        out = np.empty(shape, self.host)
        self.decode_into(out, data)
        return out

    def receive_buffer(self, dest: np.ndarray) -> np.ndarray:
        return np.empty(self.nbytes(dest.shape), self.wire)

    def decode_into(self, dest: np.ndarray, data: bytes | memoryview | np.ndarray) -> None:
        palette, codes = self._parts(data, dest.shape)
        if dest.ndim < 2:
            np.take(palette[0], codes, out=dest)
            return
        for c in range(dest.shape[1]):
            dest[:, c] = palette[c][codes[:, c]]


class _Prepared(Palette8):
    """:class:`Palette8` holding one array's encoding (:meth:`Palette8.prepared`)."""

    def __init__(self, array: np.ndarray, coded: tuple[np.ndarray, np.ndarray]):
        self._array, self._coded = array, coded

    def encode(self, array: np.ndarray, name: str = "tensor") -> list[memoryview]:
        if array is not self._array:
            raise ValueError(f"{name}: this palette encoding was made for another array")
        return _palette_segments(self._coded)

    def rows(self, rows: slice) -> tuple[np.ndarray, _Prepared]:
        """``array[rows]`` and its encoding from this one, made without looking at its values
        again: the same palette (it holds every value of the rows), their indices (a split
        block's images: each worker's rows of the batch, :mod:`hetconv.split`)."""
        part = self._array[rows]
        palette, codes = self._coded
        return part, _Prepared(part, (palette, np.ascontiguousarray(codes[rows])))


def _palette_segments(coded: tuple[np.ndarray, np.ndarray]) -> list[memoryview]:
    """The wire bytes of (palette, indices): one view of each, the empty indices left out."""
    return [byte_segments(part)[0] for part in coded if part.size]


FLOAT32 = Float32()
FLOAT16 = Float16()
BFLOAT16 = BFloat16()
PALETTE8 = Palette8()

#: The wire formats of activations and their gradients (``--wire-format``), by ``DType`` value.
FORMATS: dict[int, TensorFormat] = {fmt.dtype: fmt for fmt in (FLOAT32, FLOAT16, BFLOAT16)}

#: Formats of tensors that are not activations: images (:class:`Palette8`), by ``DType`` value.
IMAGE_FORMATS: dict[int, TensorFormat] = {PALETTE8.dtype: PALETTE8}

#: ``DType`` values with no format, and why.
UNSUPPORTED: dict[int, str] = {
    pb.DTYPE_UNSPECIFIED: "proto3's default: a header that names no dtype says nothing",
}

#: The formats by label (``float16``), as the command line names them.
FORMAT_LABELS: dict[str, TensorFormat] = {fmt.label: fmt for fmt in FORMATS.values()}


def format_named(label: str) -> TensorFormat:
    """The format called ``label`` (``float32``, ``float16``, ``bfloat16``).

    Raises:
        ValueError: no such format (the message lists them).
    """
    fmt = FORMAT_LABELS.get(label)
    if fmt is None:
        raise ValueError(f"wire format {label!r} is not one of {', '.join(FORMAT_LABELS)}")
    return fmt


def answer_dtype(fmt: TensorFormat) -> int:
    """What a request's ``answer_dtype`` holds to ask for answers in ``fmt``: unset (0) for
    float32, so a float32 request is byte for byte what it was before the field existed."""
    return pb.DTYPE_UNSPECIFIED if fmt is FLOAT32 else fmt.dtype


def answer_format(value: int) -> TensorFormat:
    """The format a request's ``answer_dtype`` asks for (unset: float32).

    Raises:
        UnsupportedFormat: a value with no format here, named in the message.
    """
    if value == pb.DTYPE_UNSPECIFIED:
        return FLOAT32
    fmt = FORMATS.get(value)
    if fmt is None:
        shown = pb.DType.Name(value) if value in pb.DType.values() else value
        known = ", ".join(f.name for f in FORMATS.values())
        raise UnsupportedFormat(f"answer dtype {shown} is not a format this worker knows ({known})")
    return fmt


def format_of(header: pb.TensorHeader) -> TensorFormat:
    """The format of a tensor header's dtype.

    Raises:
        UnsupportedFormat: no format here for that value (unspecified, or unknown: proto3 enums
            are open, so any number can arrive).
    """
    fmt = FORMATS.get(header.dtype) or IMAGE_FORMATS.get(header.dtype)
    if fmt is None:
        known = header.dtype in pb.DType.values()
        shown = pb.DType.Name(header.dtype) if known else header.dtype
        expected = " or ".join(f.name for f in (*FORMATS.values(), *IMAGE_FORMATS.values()))
        raise UnsupportedFormat(f"tensor {header.name} has dtype {shown}, expected {expected}")
    return fmt


__all__ = [
    "BFLOAT16",
    "FLOAT16",
    "FLOAT32",
    "FORMATS",
    "FORMAT_LABELS",
    "IMAGE_FORMATS",
    "PALETTE8",
    "Palette8",
    "UNSUPPORTED",
    "BFloat16",
    "Float16",
    "Float32",
    "answer_dtype",
    "answer_format",
    "format_named",
    "TensorFormat",
    "byte_segments",
    "format_of",
]
