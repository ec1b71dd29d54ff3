"""Tensor formats: how each ``DType`` of the proto turns arrays into wire bytes and back.

A format is a small class that names its ``DType`` value and its element type on the wire;
the shared base does the rest: byte counts, headers, encoding (views of the array's memory, no
copy when the array already holds the wire's element type) and decoding (``np.frombuffer``,
zero-copy when the wire's element type is the array's). The registry :data:`FORMATS` is keyed
by the proto's enum, so a 16-bit wire format later is one class and one entry here::

    class Float16(TensorFormat):
        dtype = pb.FLOAT16
        wire = np.dtype("<f2")
        label = "float16"

Arrays on both ends stay float32 (:attr:`TensorFormat.host`); a format whose wire type differs
converts once on each side. Every value of the enum is either in :data:`FORMATS` or in
:data:`UNSUPPORTED` with the reason (``tests/test_wire.py`` checks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hetconv.errors import UnsupportedFormat
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

    def encode(self, array: np.ndarray, name: str = "tensor") -> list[memoryview]:
        """The wire bytes of ``array``, as views in order: of its own memory (no copy) when its
        element type is the wire's and it is contiguous per leading index (a channel slice is).

        Raises:
            TypeError: ``array`` does not hold :attr:`host` elements (never silently converted).
        """
        if array.dtype != self.host:
            raise TypeError(f"{name} must be {self.host} for the wire, got {array.dtype}")
        if self.wire != self.host:
            array = array.astype(self.wire)
        return byte_segments(array)

    def decode(self, data: bytes | memoryview, shape: Sequence[int]) -> np.ndarray:
        """An array of ``shape`` over the wire bytes ``data``: zero-copy (``np.frombuffer``,
        read-only when ``data`` is) when the wire's element type is the host's."""
        array = np.frombuffer(data, self.wire).reshape(shape)
        return array if self.wire == self.host else array.astype(self.host)

    def receive_buffer(self, dest: np.ndarray) -> np.ndarray:
        """The array whose memory the wire bytes for ``dest`` are written into: ``dest`` itself
        when the wire's element type is its own (no copy at all), else a staging array that
        :meth:`decode_into` converts into ``dest`` once every byte has come."""
        return dest if self.wire == dest.dtype else np.empty(dest.shape, self.wire)

    def decode_into(self, dest: np.ndarray, data: bytes | memoryview | np.ndarray) -> None:
        """Write the tensor whose wire bytes are ``data`` into ``dest``; nothing to do when
        ``data`` is ``dest`` (from :meth:`receive_buffer`)."""
        if data is dest:
            return
        dest[...] = np.frombuffer(data, self.wire).reshape(dest.shape)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}: {self.label}, {self.itemsize} bytes>"


class Float32(TensorFormat):
    """IEEE 754 binary32, little-endian: the wire's only format so far."""

    dtype = pb.FLOAT32
    wire = np.dtype("<f4")
    label = "float32"


FLOAT32 = Float32()

#: Every format this side of the wire reads and writes, by ``DType`` value.
FORMATS: dict[int, TensorFormat] = {fmt.dtype: fmt for fmt in (FLOAT32,)}

#: ``DType`` values with no format, and why.
UNSUPPORTED: dict[int, str] = {
    pb.DTYPE_UNSPECIFIED: "proto3's default: a header that names no dtype says nothing",
}


def format_of(header: pb.TensorHeader) -> TensorFormat:
    """The format of a tensor header's dtype.

    Raises:
        UnsupportedFormat: no format here for that value (unspecified, or unknown: proto3 enums
            are open, so any number can arrive).
    """
    fmt = FORMATS.get(header.dtype)
    if fmt is None:
        known = header.dtype in pb.DType.values()
        shown = pb.DType.Name(header.dtype) if known else header.dtype
        expected = " or ".join(f.name for f in FORMATS.values())
        raise UnsupportedFormat(f"tensor {header.name} has dtype {shown}, expected {expected}")
    return fmt


__all__ = [
    "FLOAT32",
    "FORMATS",
    "UNSUPPORTED",
    "Float32",
    "TensorFormat",
    "byte_segments",
    "format_of",
]
