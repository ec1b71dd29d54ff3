"""Tests for hetconv.wire: the ConvMessage codec, header checks and the tensor receiver."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetconv.errors import WireError
from hetconv.proto import worker_pb2 as pb
from hetconv.wire import (
    CHUNK_BYTES,
    WIRE_DTYPE,
    TensorReceiver,
    check_headers,
    data_chunks,
    deserialize_message,
    receive_stream,
    serialize_message,
    tensor_header,
    tensor_stream,
    wire_array,
)

# Payload sizes at the edges of the varint length prefix (1, 2 and 3 bytes) and one chunk.
PAYLOAD_SIZES = [0, 1, 127, 128, 16383, 16384, 1 << 20]


def _payload(size: int) -> bytes:
    return ((np.arange(size) * 7 + 3) % 256).astype(np.uint8).tobytes()


def _header(name: str, shape, nbytes=None, dtype=pb.FLOAT32) -> pb.TensorHeader:
    if nbytes is None:
        nbytes = math.prod(shape) * 4
    return pb.TensorHeader(name=name, shape=shape, dtype=dtype, nbytes=nbytes)


def _split(data: bytes, cuts) -> list[memoryview]:
    """``data`` cut at the given positions into read-only views, as deserialize_message gives."""
    bounds = [0, *sorted(cuts), len(data)]
    view = memoryview(data)
    return [view[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# -- serialize_message / deserialize_message ------------------------------------------------------


@pytest.mark.parametrize("size", PAYLOAD_SIZES)
def test_serialize_data_chunk_is_what_protobuf_parses(size):
    payload = _payload(size)
    encoded = serialize_message(memoryview(payload))
    assert isinstance(encoded, bytes)
    parsed = pb.ConvMessage.FromString(encoded)
    assert parsed.WhichOneof("kind") == "data"
    assert parsed.data == payload
    # Byte-identical to protobuf's own encoding, not merely parseable.
    assert encoded == pb.ConvMessage(data=payload).SerializeToString()


@pytest.mark.parametrize("size", PAYLOAD_SIZES)
def test_deserialize_own_data_chunk_is_a_view_of_the_payload(size):
    payload = _payload(size)
    encoded = serialize_message(memoryview(payload))
    view = deserialize_message(encoded)
    assert isinstance(view, memoryview)
    assert view.nbytes == size
    assert view == memoryview(payload)
    assert view.obj is encoded  # zero-copy: a view into the received buffer
    assert view.readonly


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(max_size=4096))
def test_data_chunk_round_trip_any_payload(payload):
    encoded = serialize_message(memoryview(payload))
    assert pb.ConvMessage.FromString(encoded).data == payload
    view = deserialize_message(encoded)
    assert isinstance(view, memoryview)
    assert view.tobytes() == payload


def test_serialize_data_chunk_from_float32_array_bytes():
    array = np.arange(12, dtype=WIRE_DTYPE).reshape(3, 4)
    encoded = serialize_message(memoryview(array).cast("B"))
    assert pb.ConvMessage.FromString(encoded).data == array.tobytes()


@pytest.mark.parametrize(
    "message",
    [
        pb.ConvMessage(
            header=pb.ConvRequest(
                phase=pb.FORWARD,
                session=0xDEADBEEFCAFEF00D,
                step=7,
                layer="conv2",
                padding=[1, 1, 2, 2],
                kernel_offset=16,
                tensors=[_header("x", [2, 3, 4, 4]), _header("w", [8, 3, 3, 3])],
            )
        ),
        pb.ConvMessage(
            result=pb.ConvResult(
                compute_seconds=0.25, receive_seconds=0.5, tensors=[_header("y", [2, 8, 4, 4])]
            )
        ),
        # An empty header: its encoding starts with 0x0a, never mistaken for data.
        pb.ConvMessage(header=pb.ConvRequest()),
    ],
    ids=["header", "result", "empty-header"],
)
def test_deserialize_header_and_result_messages(message):
    encoded = message.SerializeToString()
    assert serialize_message(message) == encoded
    decoded = deserialize_message(encoded)
    assert isinstance(decoded, pb.ConvMessage)
    assert decoded == message
    assert decoded.WhichOneof("kind") == message.WhichOneof("kind")


@pytest.mark.parametrize("size", PAYLOAD_SIZES)
def test_deserialize_data_chunk_encoded_by_protobuf(size):
    payload = _payload(size)
    view = deserialize_message(pb.ConvMessage(data=payload).SerializeToString())
    assert isinstance(view, memoryview)
    assert view == memoryview(payload)


@pytest.mark.parametrize(
    ("encoded", "payload"),
    [
        # The data field twice: protobuf keeps the last one.
        (b"\x12\x03abc\x12\x02xy", b"xy"),
        # An unknown varint field (5) before the data field.
        (b"\x28\x01\x12\x03abc", b"abc"),
        # A header, then data: the oneof's last member wins.
        (pb.ConvMessage(header=pb.ConvRequest(step=1)).SerializeToString() + b"\x12\x01z", b"z"),
    ],
    ids=["repeated-field", "unknown-field-first", "header-then-data"],
)
def test_deserialize_data_chunk_encoded_differently_goes_through_the_parser(encoded, payload):
    view = deserialize_message(encoded)
    assert isinstance(view, memoryview)
    assert view.tobytes() == payload


def test_deserialize_empty_buffer_is_an_empty_message_not_data():
    decoded = deserialize_message(b"")
    assert isinstance(decoded, pb.ConvMessage)
    assert decoded.WhichOneof("kind") is None


# -- check_headers --------------------------------------------------------------------------------


def test_check_headers_accepts_good_headers_and_returns_shapes(rng):
    x = rng.standard_normal((2, 3, 5, 5)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = np.zeros(4, np.float32)
    headers = [tensor_header("x", x), tensor_header("w", w), tensor_header("b", b)]
    shapes = check_headers(headers, ("x", "w", "b"))
    assert shapes == [(2, 3, 5, 5), (4, 3, 3, 3), (4,)]
    assert all(type(d) is int for s in shapes for d in s)


def test_check_headers_accepts_zero_size_and_scalar_tensors():
    headers = [_header("x", [0, 3, 4, 4]), _header("s", [])]
    assert check_headers(headers, ["x", "s"]) == [(0, 3, 4, 4), ()]


def test_check_headers_max_bytes_is_inclusive():
    headers = [_header("x", [2, 3]), _header("w", [4])]  # 24 + 16 bytes
    assert check_headers(headers, ["x", "w"], max_bytes=40) == [(2, 3), (4,)]
    with pytest.raises(WireError, match=r"more than 39 bytes.*limit of this worker"):
        check_headers(headers, ["x", "w"], max_bytes=39)


def test_check_headers_max_bytes_counts_the_total_not_each_tensor():
    headers = [_header("x", [10]), _header("w", [10])]  # 40 bytes each, 80 in all
    with pytest.raises(WireError, match="more than 60 bytes"):
        check_headers(headers, ["x", "w"], max_bytes=60)


@pytest.mark.parametrize(
    ("sent", "expected"),
    [
        (["x", "w", "b"], ["x", "w"]),  # one too many
        (["x", "w"], ["x", "w", "b"]),  # one missing
        (["w", "x", "b"], ["x", "w", "b"]),  # right names, wrong order
        (["x", "dw", "b"], ["x", "w", "b"]),  # wrong name
        ([], ["x"]),
    ],
)
def test_check_headers_rejects_wrong_names_or_order(sent, expected):
    headers = [_header(name, [2]) for name in sent]
    with pytest.raises(WireError, match="expected") as info:
        check_headers(headers, expected)
    assert str(sent) in str(info.value)
    assert str(expected) in str(info.value)


@pytest.mark.parametrize(
    ("dtype", "shown"), [(pb.DTYPE_UNSPECIFIED, "DTYPE_UNSPECIFIED"), (7, "7")]
)
def test_check_headers_rejects_other_dtypes(dtype, shown):
    headers = [_header("x", [2]), _header("w", [3], dtype=dtype)]
    with pytest.raises(WireError, match=rf"tensor w has dtype {shown}, expected FLOAT32"):
        check_headers(headers, ["x", "w"])


@pytest.mark.parametrize("shape", [[-1], [2, -3], [-2, -3]])
def test_check_headers_rejects_negative_dimensions(shape):
    # [-2, -3] has a positive product: the nbytes check alone would let it through.
    headers = [_header("x", shape, nbytes=abs(math.prod(shape)) * 4)]
    with pytest.raises(WireError, match="tensor x has a negative dimension"):
        check_headers(headers, ["x"])


@pytest.mark.parametrize(
    ("shape", "nbytes"), [([2, 3], 23), ([2, 3], 25), ([2, 3], 6), ([0, 5], 4), ([], 0)]
)
def test_check_headers_rejects_nbytes_inconsistent_with_shape(shape, nbytes):
    headers = [_header("x", shape, nbytes=nbytes)]
    with pytest.raises(WireError, match=rf"tensor x declares {nbytes} bytes"):
        check_headers(headers, ["x"])


def test_absurd_dimension_of_an_empty_tensor_is_a_wire_error():
    headers = [_header("x", [0, 2**63 - 1], nbytes=0)]
    with pytest.raises(WireError):
        TensorReceiver(check_headers(headers, ["x"]))


# -- TensorReceiver -------------------------------------------------------------------------------

_shapes = st.lists(
    st.one_of(
        st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple),
        st.just((0,)),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), shapes=_shapes)
def test_receiver_fills_arrays_from_chunks_of_any_size(data, shapes):
    sources = []
    start = 0
    for shape in shapes:
        n = math.prod(shape)
        sources.append(np.arange(start, start + n, dtype=WIRE_DTYPE).reshape(shape) + 0.5)
        start += n
    stream = b"".join(a.tobytes() for a in sources)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12), label="cuts")
    receiver = TensorReceiver(shapes)
    for chunk in _split(stream, cuts):
        receiver.feed(chunk)
    assert receiver.received == len(stream)
    arrays = receiver.finish()
    assert len(arrays) == len(shapes)
    for got, want in zip(arrays, sources, strict=True):
        assert got.shape == want.shape
        assert got.dtype == WIRE_DTYPE
        np.testing.assert_array_equal(got, want)


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, 2 * 3 * 3 * 4 * 4), max_size=10))
def test_receiver_writes_only_the_channel_slice(cuts):
    big = np.full((2, 6, 3, 4), -7.0, dtype=np.float32)
    dest = big[:, 2:5]
    assert not dest.flags.c_contiguous
    src = np.arange(dest.size, dtype=np.float32).reshape(dest.shape)
    receiver = TensorReceiver([dest.shape], [dest])
    for chunk in _split(src.tobytes(), cuts):
        receiver.feed(chunk)
    (out,) = receiver.finish()
    assert out is dest
    np.testing.assert_array_equal(big[:, 2:5], src)
    assert (big[:, :2] == -7.0).all()
    assert (big[:, 5:] == -7.0).all()


def test_receiver_into_slice_of_an_array_and_a_fresh_tensor(rng):
    big = np.zeros((3, 5, 2, 2), dtype=np.float32)
    dest = big[:, 1:4]
    extra = np.empty((4,), dtype=np.float32)
    a = rng.standard_normal(dest.shape).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    receiver = TensorReceiver([dest.shape, (4,)], [dest, extra])
    stream = a.tobytes() + b.tobytes()
    for chunk in _split(stream, range(5, len(stream), 13)):  # 13: splits floats and images
        receiver.feed(chunk)
    receiver.finish()
    np.testing.assert_array_equal(big[:, 1:4], a)
    np.testing.assert_array_equal(extra, b)
    assert not big[:, [0, 4]].any()


@pytest.mark.parametrize("chunk_bytes", [CHUNK_BYTES, 65_537])
def test_receiver_with_megabyte_tensors_and_real_chunk_sizes(rng, chunk_bytes):
    """Sizes as on the wire: >1 MiB tensors, into a channel slice, in (odd) large chunks."""
    x = rng.standard_normal((3, 8, 96, 96)).astype(np.float32)  # 864 KiB
    w = rng.standard_normal((16, 8, 3, 3, 64)).astype(np.float32)  # 288 KiB
    big = np.zeros((3, 12, 96, 96), np.float32)
    receiver = TensorReceiver([x.shape, w.shape], [big[:, 2:10], np.empty_like(w)])
    stream = x.tobytes() + w.tobytes()
    for chunk in _split(stream, range(chunk_bytes, len(stream), chunk_bytes)):
        receiver.feed(chunk)
    got_x, got_w = receiver.finish()
    np.testing.assert_array_equal(big[:, 2:10], x)
    np.testing.assert_array_equal(got_w, w)
    assert not big[:, :2].any() and not big[:, 10:].any()


def test_receiver_rejects_too_many_bytes():
    receiver = TensorReceiver([(2,), (1,)])  # 12 bytes
    receiver.feed(memoryview(bytes(8)))
    with pytest.raises(WireError, match="received 16 bytes of tensor data, the header declared 12"):
        receiver.feed(memoryview(bytes(8)))
    # The rejected chunk was not counted: the 4 missing bytes still complete the stream.
    receiver.feed(memoryview(bytes(4)))
    receiver.finish()


def test_receiver_rejects_any_bytes_for_empty_tensors():
    receiver = TensorReceiver([(0,), (0,)])
    with pytest.raises(WireError, match="header declared 0"):
        receiver.feed(memoryview(b"\x00"))


@pytest.mark.parametrize("sent", [0, 4, 11])
def test_receiver_rejects_too_few_bytes_on_finish(sent):
    receiver = TensorReceiver([(2,), (1,)])
    if sent:
        receiver.feed(memoryview(bytes(sent)))
    with pytest.raises(WireError, match=rf"stream ended after {sent} bytes.*declared 12"):
        receiver.finish()


@pytest.mark.parametrize(
    "dest",
    [
        np.empty((3, 2), np.float32),  # transposed shape
        np.empty((6,), np.float32),  # same size, other shape
        np.empty((2, 3), np.float64),
        np.empty((2, 3), np.float16),
        np.empty((2, 3), np.int32),
        np.empty((2, 3), ">f4"),  # float32, but big-endian: the wire is little-endian
    ],
    ids=["transposed", "flat", "float64", "float16", "int32", "big-endian"],
)
def test_receiver_rejects_a_destination_of_the_wrong_shape_or_dtype(dest):
    with pytest.raises(WireError, match="cannot be received into"):
        TensorReceiver([(4,), (2, 3)], [np.empty(4, np.float32), dest])


def test_receiver_with_zero_size_tensors_between_others():
    shapes = [(0,), (2,), (0,), (1,), (0,)]
    receiver = TensorReceiver(shapes)
    assert receiver.expected == 12
    stream = np.array([1.0, 2.0, 3.0], dtype=np.float32).tobytes()
    receiver.feed(memoryview(stream[:8]))
    receiver.feed(memoryview(b""))
    receiver.feed(memoryview(stream[8:]))
    arrays = receiver.finish()
    assert [a.shape for a in arrays] == shapes
    np.testing.assert_array_equal(arrays[1], [1.0, 2.0])
    np.testing.assert_array_equal(arrays[3], [3.0])


def test_receiver_with_only_zero_size_tensors_needs_no_data():
    arrays = TensorReceiver([(0,), (0,)]).finish()
    assert [a.shape for a in arrays] == [(0,), (0,)]


@pytest.mark.parametrize("empty", [(3, 0), (0, 3, 4, 4), (2, 0, 3)])
def test_receiver_with_multidimensional_zero_size_tensors(empty):
    receiver = TensorReceiver([empty, (2,)])
    receiver.feed(memoryview(np.array([1.0, 2.0], np.float32).tobytes()))
    arrays = receiver.finish()
    assert arrays[0].shape == empty
    np.testing.assert_array_equal(arrays[1], [1.0, 2.0])


def test_data_chunks_of_a_multidimensional_zero_size_tensor():
    assert list(data_chunks([np.empty((0, 3, 4, 4), np.float32)])) == []


# -- data_chunks / tensor_stream ------------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [1, 3, 16, 60, 61, 10_000])
def test_data_chunks_over_a_channel_slice(rng, chunk_bytes):
    big = rng.standard_normal((2, 6, 3, 5)).astype(np.float32)
    part = big[:, 1:4]
    assert not part.flags.c_contiguous
    chunks = list(data_chunks([part], chunk_bytes))
    assert all(isinstance(c, memoryview) for c in chunks)
    assert all(0 < c.nbytes <= chunk_bytes for c in chunks)
    assert b"".join(chunks) == np.ascontiguousarray(part).tobytes()


@pytest.mark.parametrize(("nbytes", "chunk_bytes"), [(100, 32), (96, 32), (4, 32), (0, 32)])
def test_data_chunks_of_a_contiguous_array_are_full_but_the_last(nbytes, chunk_bytes):
    array = np.arange(nbytes // 4, dtype=np.float32)
    sizes = [c.nbytes for c in data_chunks([array], chunk_bytes)]
    full, rest = divmod(nbytes, chunk_bytes)
    assert sizes == [chunk_bytes] * full + ([rest] if rest else [])


def test_data_chunks_of_several_arrays_in_order(rng):
    a = rng.standard_normal((3, 4)).astype(np.float32)
    big = rng.standard_normal((2, 5, 2, 2)).astype(np.float32)
    empty = np.empty((0,), np.float32)
    c = rng.standard_normal(7).astype(np.float32)
    arrays = [a, big[:, 2:4], empty, c]
    got = b"".join(data_chunks(arrays, 20))
    assert got == b"".join(np.ascontiguousarray(x).tobytes() for x in arrays)


def test_stream_round_trip_through_the_codec_into_a_channel_slice(rng):
    """Sender slice -> serialize -> deserialize -> receive_stream into a receiver's slice."""
    src_big = rng.standard_normal((2, 8, 3, 3)).astype(np.float32)
    x = src_big[:, 3:6]
    b = rng.standard_normal(3).astype(np.float32)
    head = pb.ConvMessage(
        result=pb.ConvResult(tensors=[tensor_header("y", x), tensor_header("b", b)])
    )
    wire = [serialize_message(m) for m in tensor_stream(head, [x, b], chunk_bytes=50)]
    dest_big = np.zeros((2, 8, 3, 3), np.float32)

    def receiver_for(first):
        shapes = check_headers(first.result.tensors, ["y", "b"])
        return TensorReceiver(shapes, [dest_big[:, 3:6], np.empty(3, np.float32)])

    first, (y, bb) = receive_stream(map(deserialize_message, wire), receiver_for)
    assert first == head
    np.testing.assert_array_equal(dest_big[:, 3:6], x)
    assert not dest_big[:, :3].any() and not dest_big[:, 6:].any()
    np.testing.assert_array_equal(bb, b)


# -- receive_stream -------------------------------------------------------------------------------


def _no_receiver(first):
    raise AssertionError(f"receiver_for must not be called, got {first}")


def _header_message(*shapes) -> pb.ConvMessage:
    return pb.ConvMessage(
        header=pb.ConvRequest(tensors=[_header(f"t{i}", s) for i, s in enumerate(shapes)])
    )


def _receiver_for(first: pb.ConvMessage) -> TensorReceiver:
    names = [h.name for h in first.header.tensors]
    return TensorReceiver(check_headers(first.header.tensors, names))


def test_receive_stream_reads_header_then_data():
    head = _header_message((2,), (1,))
    data = np.array([1.0, 2.0, 3.0], np.float32).tobytes()
    first, arrays = receive_stream(iter([head, *_split(data, [3, 9])]), _receiver_for)
    assert first == head
    np.testing.assert_array_equal(arrays[0], [1.0, 2.0])
    np.testing.assert_array_equal(arrays[1], [3.0])


def test_receive_stream_header_only_for_empty_tensors():
    head = _header_message((0,), (0,))
    first, arrays = receive_stream(iter([head]), _receiver_for)
    assert first == head
    assert [a.shape for a in arrays] == [(0,), (0,)]


def test_receive_stream_rejects_stream_starting_with_data():
    with pytest.raises(WireError, match="started with tensor data"):
        receive_stream(iter([memoryview(bytes(8)), _header_message((2,))]), _no_receiver)


def test_receive_stream_rejects_empty_stream():
    with pytest.raises(WireError, match="ended before its header"):
        receive_stream(iter([]), _no_receiver)


@pytest.mark.parametrize(
    ("intruder", "kind"),
    [
        (_header_message((2,)), "header"),
        (pb.ConvMessage(result=pb.ConvResult()), "result"),
        (pb.ConvMessage(), "empty"),
    ],
)
def test_receive_stream_rejects_a_message_in_the_middle_of_data(intruder, kind):
    stream = [_header_message((4,)), memoryview(bytes(8)), intruder, memoryview(bytes(8))]
    with pytest.raises(WireError, match=rf"second {kind} message .* middle of tensor data"):
        receive_stream(iter(stream), _receiver_for)


def test_receive_stream_checks_the_byte_count():
    with pytest.raises(WireError, match="stream ended after 8 bytes"):
        receive_stream(iter([_header_message((4,)), memoryview(bytes(8))]), _receiver_for)
    with pytest.raises(WireError, match="header declared 16"):
        receive_stream(
            iter([_header_message((4,)), memoryview(bytes(12)), memoryview(bytes(8))]),
            _receiver_for,
        )


# -- wire_array -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32])
def test_wire_array_rejects_other_dtypes(dtype):
    with pytest.raises(TypeError, match=r"w must be float32 for the wire"):
        wire_array("w", np.zeros((2, 2), dtype))


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a[:, 1:3],  # channel slice
        lambda a: a.transpose(0, 2, 3, 1),  # NHWC view
        lambda a: a[..., ::2],  # strided
    ],
    ids=["channel-slice", "transposed", "strided"],
)
def test_wire_array_makes_non_contiguous_float32_contiguous(rng, make):
    base = rng.standard_normal((2, 4, 3, 4)).astype(np.float32)
    view = make(base)
    assert not view.flags.c_contiguous
    out = wire_array("x", view)
    assert out.flags.c_contiguous
    assert out.dtype == WIRE_DTYPE
    np.testing.assert_array_equal(out, view)
    assert out.tobytes() == np.ascontiguousarray(view).tobytes()


def test_wire_array_keeps_a_contiguous_float32_array_without_copying(rng):
    a = rng.standard_normal((3, 4)).astype(np.float32)
    out = wire_array("x", a)
    assert np.shares_memory(out, a)
    np.testing.assert_array_equal(out, a)
