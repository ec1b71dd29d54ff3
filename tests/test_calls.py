"""The wire's single sources of truth: the table of calls (hetconv.calls), the tensor formats
(hetconv.formats), the error types and their statuses (hetconv.errors), and the layering that
keeps the core and the master off the worker's code."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import grpc
import numpy as np
import pytest

from hetconv import calls, errors, formats, wire
from hetconv.backends import ConvShape, Padding, conv_shape, get_backend
from hetconv.proto import worker_pb2 as pb
from hetconv.worker.service import ConvWorkerService

ROOT = Path(__file__).resolve().parents[1]
SERVICE = pb.DESCRIPTOR.services_by_name["ConvWorker"]
SHAPE = ConvShape(2, 3, 7, 6, 5, 3, 2, Padding(1, 0, 2, 1))  # asymmetric on purpose


# -- the table of calls --------------------------------------------------------------------------


def test_the_table_has_every_rpc_of_the_proto_and_nothing_else():
    assert set(calls.METHODS) == set(SERVICE.methods_by_name)
    assert calls.SERVICE_NAME == SERVICE.full_name


@pytest.mark.parametrize("name", sorted(SERVICE.methods_by_name))
def test_each_rpc_has_the_streaming_kinds_and_messages_of_the_proto(name):
    proto, method = SERVICE.methods_by_name[name], calls.METHODS[name]
    assert method.kinds == (proto.client_streaming, proto.server_streaming)
    assert method.path == f"/{SERVICE.full_name}/{name}"
    if name in calls.UNARY_CALLS:
        call = calls.UNARY_CALLS[name]
        assert call.request.DESCRIPTOR is proto.input_type
        assert call.response.DESCRIPTOR is proto.output_type
    else:
        expected = "ConvMessage" if name in calls.CONV_CALLS else "ConvBundle"
        assert proto.input_type.name == proto.output_type.name == expected


def test_every_conv_call_has_a_phase_of_the_proto():
    assert {c.phase for c in calls.CONV_CALLS.values()} == set(pb.Phase.values())


def test_tensor_shapes_follow_from_the_call_geometry():
    ho, wo = SHAPE.out_hw
    x, w, b, maps = (2, 3, 7, 6), (5, 3, 3, 2), (5,), (2, 5, ho, wo)
    assert calls.FORWARD.request_shapes(SHAPE) == {"x": x, "w": w, "b": b}
    assert calls.FORWARD.answer_shapes(SHAPE) == {"y": maps}
    assert calls.BACKWARD.request_shapes(SHAPE) == {"dy": maps}
    assert calls.BACKWARD.answer_shapes(SHAPE, need_input_grad=True) == {
        "dw": w,
        "db": b,
        "dx": x,
    }
    assert calls.BACKWARD.answer_names(need_input_grad=False) == ("dw", "db")
    assert calls.FORWARD.request_names == ("x", "w", "b")
    assert calls.ECHO.request_names is None


def test_answer_bytes_and_headers_count_float32():
    ho, wo = SHAPE.out_hw
    assert calls.FORWARD.answer_bytes(SHAPE) == 4 * 2 * 5 * ho * wo
    with_dx = calls.BACKWARD.answer_bytes(SHAPE, need_input_grad=True)
    assert with_dx == 4 * (5 * 3 * 3 * 2 + 5 + 2 * 3 * 7 * 6)
    for header in calls.BACKWARD.answer_headers(SHAPE, need_input_grad=True):
        assert header.dtype == pb.FLOAT32
        assert header.nbytes == 4 * math.prod(header.shape)


def test_echo_has_no_fixed_tensors():
    with pytest.raises(ValueError, match="names"):
        calls.ECHO.request_shapes(SHAPE)
    with pytest.raises(ValueError, match="request sent"):
        calls.ECHO.answer_names()


def test_call_shape_is_conv_shape_without_the_checks():
    x, w, padding = (2, 3, 7, 6), (5, 3, 3, 2), (1, 0, 2, 1)
    assert calls.call_shape(x, w, padding) == conv_shape(x, w, padding)
    # Unvalidated: the worker, not the master, refuses a kernel larger than its input.
    assert calls.call_shape((1, 1, 2, 2), (1, 1, 5, 5), (0, 0, 0, 0)).out_hw == (-2, -2)


# -- tensor formats ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", sorted(pb.DType.values()))
def test_every_dtype_of_the_proto_has_a_format_or_a_reason(value):
    known = {**formats.FORMATS, **formats.IMAGE_FORMATS}
    places = [
        value in formats.FORMATS,
        value in formats.IMAGE_FORMATS,
        value in formats.UNSUPPORTED,
    ]
    assert places.count(True) == 1, pb.DType.Name(value)
    if value in known:
        fmt = known[value]
        assert fmt.dtype == value and fmt.name == pb.DType.Name(value)
        assert fmt.itemsize == fmt.wire.itemsize and fmt.wire.byteorder in "<|="
        header = fmt.header("t", (2, 3, 4))
        assert formats.format_of(header) is fmt
    else:
        assert formats.UNSUPPORTED[value].strip()


def _pixels(rng, shape=(5, 3, 6, 7)):
    """Normalised 8-bit pixels, as ImageDataset.batch makes them."""
    x = rng.integers(0, 256, shape, dtype=np.uint8).astype(np.float32)
    x /= np.float32(255.0)
    x -= np.asarray([0.49, 0.48, 0.45], np.float32).reshape(1, 3, 1, 1)
    x /= np.asarray([0.25, 0.24, 0.26], np.float32).reshape(1, 3, 1, 1)
    return x


def test_palette8_carries_normalised_pixels_bit_for_bit_in_a_quarter_of_the_bytes(rng):
    p8 = formats.PALETTE8
    x = _pixels(rng)
    x[0, 0, 0, :2] = (-0.0, 0.0)  # bits, not values: both zeros come back as they were
    x[1, 1, 0, 0] = np.float32("nan")
    segments = p8.encode(x)
    data = b"".join(segments)
    assert len(data) == p8.nbytes(x.shape) == 3 * 1024 + x.size
    back = p8.decode(data, x.shape)
    assert back.dtype == np.float32
    assert np.array_equal(back.view(np.uint32), x.view(np.uint32))
    # as the receiver gets it: bytes into the staging buffer, then one decode into the array
    dest = np.empty_like(x)
    buffer = p8.receive_buffer(dest)
    assert buffer is not dest and buffer.nbytes == len(data)
    buffer[...] = np.frombuffer(data, np.uint8)
    p8.decode_into(dest, buffer)
    assert np.array_equal(dest.view(np.uint32), x.view(np.uint32))
    # one encoding for every worker: the prepared format sends the same bytes for that array
    prepared = p8.prepared(x)
    assert b"".join(prepared.encode(x)) == data
    with pytest.raises(ValueError, match="made for another array"):
        prepared.encode(x.copy())
    # a split block's rows of the batch: the batch's palette, their indices, exact
    part, rows = prepared.rows(slice(1, 2))
    assert np.array_equal(part.view(np.uint32), x[1:2].view(np.uint32))
    back = p8.decode(b"".join(rows.encode(part)), part.shape)
    assert np.array_equal(back.view(np.uint32), x[1:2].view(np.uint32))


def test_palette8_refuses_what_does_not_fit_and_bytes_that_do_not_match(rng):
    p8 = formats.PALETTE8
    noise = rng.standard_normal((2, 3, 20, 20)).astype(np.float32)  # 800 values a channel
    assert not p8.fits(noise) and p8.prepared(noise) is None
    with pytest.raises(ValueError, match="more than 256 distinct values in a channel"):
        p8.encode(noise, "x")
    with pytest.raises(TypeError, match="x must be float32"):
        p8.encode(noise.astype(np.float64), "x")
    data = b"".join(p8.encode(_pixels(rng)))
    with pytest.raises(errors.MalformedMessage, match="bytes of palette8 data"):
        p8.decode(data[:-1], (5, 3, 6, 7))
    # empty tensors, however their zeros fall
    for shape in [(0, 0), (0, 3, 2), (4, 0, 5), (2, 3, 0), (0,)]:
        empty = np.zeros(shape, np.float32)
        data = b"".join(p8.encode(empty))
        assert len(data) == p8.nbytes(shape)
        assert p8.decode(data, shape).shape == shape
    # a one-channel tensor of any rank
    flat = np.repeat(np.arange(7, dtype=np.float32), 3)
    back = p8.decode(b"".join(p8.encode(flat)), flat.shape)
    np.testing.assert_array_equal(back, flat)


def test_palette8_is_no_wire_format_of_activations():
    assert "palette8" not in formats.FORMAT_LABELS
    with pytest.raises(errors.UnsupportedFormat, match="answer dtype PALETTE8"):
        formats.answer_format(pb.PALETTE8)


def test_float32_encodes_without_copying_and_decodes_without_copying(rng):
    a = rng.standard_normal((3, 4, 5)).astype(np.float32)
    (segment,) = formats.FLOAT32.encode(a)
    assert np.shares_memory(np.frombuffer(segment, np.uint8), a)
    data = bytes(segment)
    back = formats.FLOAT32.decode(data, a.shape)
    np.testing.assert_array_equal(back, a)
    assert back.base is not None and not back.flags.writeable  # a view of `data`
    dest = np.empty_like(a)
    assert formats.FLOAT32.receive_buffer(dest) is dest  # bytes land in the array itself
    formats.FLOAT32.decode_into(dest, data)
    np.testing.assert_array_equal(dest, a)


def test_float32_encodes_a_channel_slice_per_image_without_copying(rng):
    big = rng.standard_normal((2, 6, 3, 3)).astype(np.float32)
    segments = formats.FLOAT32.encode(big[:, 2:4])
    assert len(segments) == 2
    assert all(np.shares_memory(np.frombuffer(s, np.uint8), big) for s in segments)
    assert b"".join(segments) == np.ascontiguousarray(big[:, 2:4]).tobytes()


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32, ">f4"])
def test_float32_never_converts_silently(dtype):
    with pytest.raises(TypeError, match="w must be float32 for the wire"):
        formats.FLOAT32.encode(np.zeros(3, dtype), "w")


def test_unknown_and_unspecified_dtypes_are_unsupported():
    for value, shown in ((pb.DTYPE_UNSPECIFIED, "DTYPE_UNSPECIFIED"), (7, "7")):
        header = pb.TensorHeader(name="t", shape=[2], dtype=value, nbytes=8)
        with pytest.raises(errors.UnsupportedFormat, match=f"dtype {shown}, expected FLOAT32"):
            formats.format_of(header)


class _Half(formats.TensorFormat):
    """A 16-bit format as a later one would be added: three attributes, one registry entry."""

    dtype = 99  # no such value in the proto yet: the registry is keyed by the number
    wire = np.dtype("<f2")
    label = "float16"

    @property
    def name(self) -> str:
        return "HALF"


def test_a_new_format_is_one_entry_and_the_wire_path_takes_it(monkeypatch, rng):
    half = _Half()
    monkeypatch.setitem(formats.FORMATS, half.dtype, half)
    a = rng.standard_normal((2, 3, 4)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    out = wire.encode_tensors([("a", a)], half)
    plain = wire.encode_tensors([("b", b)])
    headers = out.headers + plain.headers
    assert headers[0].nbytes == 2 * a.size and out.nbytes == 2 * a.size

    tensors = wire.check_tensors(headers, ["a", "b"])
    assert [t.format for t in tensors] == [half, formats.FLOAT32]
    receiver = wire.TensorReceiver.of(tensors)
    data = b"".join([*out.segments, *plain.segments])
    for start in range(0, len(data), 7):  # chunk boundaries mean nothing
        receiver.feed(memoryview(data)[start : start + 7])
    got_a, got_b = receiver.finish()
    assert got_a.dtype == got_b.dtype == np.float32
    np.testing.assert_array_equal(got_a, a.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(got_b, b)
    np.testing.assert_array_equal(half.decode(b"".join(out.segments), a.shape), got_a)


# -- varints -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 16383, 16384, 1 << 35, (1 << 64) - 1])
def test_varint_round_trip(value):
    encoded = wire.encode_varint(value)
    assert wire.read_varint(b"\xff" + encoded + b"\x00", 1) == (value, 1 + len(encoded))


@pytest.mark.parametrize("buffer", [b"", b"\x80", b"\xff\xff", b"\x80" * 10 + b"\x01"])
def test_truncated_or_overlong_varint_is_malformed(buffer):
    with pytest.raises(errors.MalformedMessage, match="varint"):
        wire.read_varint(buffer, 0)


# -- error types and statuses --------------------------------------------------------------------

STATUSES = {
    errors.WireError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.MalformedMessage: grpc.StatusCode.INVALID_ARGUMENT,
    errors.MalformedHeader: grpc.StatusCode.INVALID_ARGUMENT,
    errors.UnsupportedFormat: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidCall: grpc.StatusCode.INVALID_ARGUMENT,
    errors.RequestTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.MissingForward: grpc.StatusCode.FAILED_PRECONDITION,
}


def test_every_error_type_carries_its_status():
    assert set(STATUSES) == {getattr(errors, name) for name in errors.__all__}
    for error, status in STATUSES.items():
        assert issubclass(error, errors.WireError) and issubclass(error, ValueError)
        assert error.status == status


def test_codec_errors_are_raised_as_their_type():
    headers = [pb.TensorHeader(name="x", shape=[10], dtype=pb.FLOAT32, nbytes=40)]
    with pytest.raises(errors.RequestTooLarge):
        wire.check_tensors(headers, ["x"], max_bytes=39)
    with pytest.raises(errors.MalformedHeader):
        wire.check_tensors(headers, ["w"])
    with pytest.raises(errors.MalformedMessage):
        wire.receive_stream(iter([]), lambda first: None)


class _Aborted(Exception):
    pass


class _Context:
    def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted


@pytest.mark.parametrize("error", list(STATUSES))
def test_the_service_answers_with_the_status_of_the_error_type_not_its_text(error):
    # The text names another status's situation: only the type may decide.
    message = "request holds more than 1 bytes of tensors (limit of this worker); send Forward"

    def core(messages):
        raise error(message)

    context = _Context()
    handler = ConvWorkerService(get_backend("cpu")).streamed(calls.FORWARD, core)
    with pytest.raises(_Aborted):
        list(handler(iter([]), context))
    assert context.code == STATUSES[error]
    assert context.details == f"Forward: {message}"


# -- layering ------------------------------------------------------------------------------------


def _imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


def _offending(paths, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in paths:
        bad = sorted(m for m in _imports(path) if m.startswith(forbidden))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_the_master_does_not_import_the_worker():
    assert _offending((ROOT / "master").glob("*.py"), ("hetconv.worker",)) == {}


def test_the_core_imports_neither_master_worker_simulator_nor_cli():
    # hetconv/__main__.py runs the command line (cli/, above every room); nothing else may.
    paths = [
        p
        for p in (ROOT / "hetconv").rglob("*.py")
        if p.name != "__main__.py" and "proto" not in p.parts
    ]
    forbidden = (
        "hetconv.master", "hetconv.worker", "hetconv.simulations", "hetconv.cli",
        "hetconv.training",
    )  # fmt: skip
    assert _offending(paths, forbidden) == {}
