"""16-bit wire formats (``hetconv train --wire-format``): the formats themselves, the calls that
use them, real workers and masters speaking them, and the cost model counting them.

What each format does to a value is documented in :mod:`hetconv.formats`; these tests hold it
to that: exact where the value is representable, within half a unit in the last place
otherwise, and NaN, infinities, subnormals and overflow as the docstring says.
"""

from __future__ import annotations

import io
import json
import math

import grpc
import numpy as np
import pytest

from hetconv import calls, formats, wire
from hetconv.backends import get_backend
from hetconv.calls import SERVICE_NAME
from hetconv.errors import MalformedHeader, MalformedMessage, UnsupportedFormat
from hetconv.formats import BFLOAT16, FLOAT16, FLOAT32
from hetconv.master.client import WorkerClient
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.proto import worker_pb2 as pb
from hetconv.training import TrainConfig, train
from hetconv.workload import BACKWARD, FORWARD, PHASES, call_bytes, network_layers

HALF = (FLOAT16, BFLOAT16)
ALL = (FLOAT32, FLOAT16, BFLOAT16)
#: Significant bits of each format (the implicit one included): unit roundoff 2^-bits.
BITS = {FLOAT32: 24, FLOAT16: 11, BFLOAT16: 8}


def _round_trip(fmt, a: np.ndarray) -> np.ndarray:
    return fmt.decode(b"".join(fmt.encode(a)), a.shape)


# -- the formats ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.label)
def test_registry_and_labels(fmt):
    assert formats.FORMATS[fmt.dtype] is fmt
    assert formats.format_named(fmt.label) is fmt
    assert fmt.itemsize == (4 if fmt is FLOAT32 else 2)
    assert fmt.nbytes((3, 5)) == 15 * fmt.itemsize
    with pytest.raises(ValueError, match="float32, float16, bfloat16"):
        formats.format_named("float8")


def test_the_command_lines_offer_every_format():
    from hetconv.simulations import cli as simulate_cli

    assert tuple(formats.FORMAT_LABELS) == simulate_cli.WIRE_FORMATS
    from hetconv.cli import build_parser

    train_parser = build_parser()._subparsers._group_actions[0].choices["train"]
    (action,) = [a for a in train_parser._actions if a.dest == "wire_format"]
    assert tuple(action.choices) == tuple(formats.FORMAT_LABELS) and action.default == "float32"


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.label)
def test_representable_values_round_trip_exactly(fmt):
    # Small integers and dyadic fractions with few significant bits, of both signs, ±0.
    ints = np.arange(-256, 257, dtype=np.float32)
    fractions = np.array([0.5, 0.25, 0.375, -0.75, 1.5, 2**-10, 3 * 2**-12, 96.0], np.float32)
    a = np.concatenate([ints, fractions, np.array([0.0, -0.0, np.inf, -np.inf], np.float32)])
    back = _round_trip(fmt, a)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, a)
    assert np.array_equal(np.signbit(back), np.signbit(a))  # -0.0 stays -0.0


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.label)
def test_rounding_error_is_at_most_half_an_ulp(fmt, rng):
    # Normal values of the format's range: relative error <= 2^-bits (round to nearest).
    top = 60000.0 if fmt is FLOAT16 else 1e30
    bottom = 1e-4 if fmt is FLOAT16 else 1e-30
    mag = np.exp(rng.uniform(np.log(bottom), np.log(top), 20000)).astype(np.float32)
    a = mag * rng.choice(np.array([-1, 1], np.float32), mag.size)
    back = _round_trip(fmt, a)
    rel = np.abs(back.astype(np.float64) - a) / np.abs(a)
    assert rel.max() <= 2.0 ** -BITS[fmt]
    if fmt is not FLOAT32:
        assert rel.max() > 2.0 ** -(BITS[fmt] + 2)  # it does round: not secretly exact


@pytest.mark.parametrize("fmt", HALF, ids=lambda f: f.label)
def test_ties_round_to_even(fmt):
    drop = 24 - BITS[fmt]  # float32 mantissa bits the format drops
    one = np.float32(1.0).view(np.uint32)
    # 1 + half an ulp (a tie) goes down to 1 (even); 1 + 1.5 ulp goes up to 1 + 2 ulp (even).
    ties = np.array([one + (1 << (drop - 1)), one + (3 << (drop - 1))], np.uint32)
    back = _round_trip(fmt, ties.view(np.float32))
    ulp = 2.0 ** -(BITS[fmt] - 1)
    np.testing.assert_array_equal(back, np.array([1.0, 1.0 + 2 * ulp], np.float32))


@pytest.mark.parametrize("fmt", HALF, ids=lambda f: f.label)
def test_nan_and_infinities_survive(fmt):
    nan_payloads = np.array([0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF], np.uint32)
    a = np.concatenate([nan_payloads.view(np.float32), np.array([np.inf, -np.inf], np.float32)])
    back = _round_trip(fmt, a)
    assert np.isnan(back[:4]).all()
    np.testing.assert_array_equal(back[4:], [np.inf, -np.inf])


def test_float16_overflows_to_infinity_and_flushes_tiny_values_to_zero():
    a = np.array([65504, 65519, 65520, -70000, 1e30, 2.0**-24, 2.0**-26, -(2.0**-26)], np.float32)
    back = _round_trip(FLOAT16, a)
    np.testing.assert_array_equal(back[:5], [65504, 65504, np.inf, -np.inf, np.inf])
    assert back[5] == 2.0**-24  # the smallest subnormal is kept
    np.testing.assert_array_equal(back[6:], [0.0, -0.0])
    assert np.signbit(back[7])


def test_float16_subnormals_have_absolute_error_at_most_2_to_the_minus_25(rng):
    a = rng.uniform(-(2.0**-14), 2.0**-14, 10000).astype(np.float32)
    assert np.abs(_round_trip(FLOAT16, a) - a).max() <= 2.0**-25


def test_bfloat16_keeps_float32_range_and_rounds_subnormals_in_steps_of_2_to_the_minus_133(rng):
    big = np.finfo(np.float32).max
    a = np.array([3e38, -3e38, 1.2e-38, -1.2e-38, big], np.float32)
    back = _round_trip(BFLOAT16, a)
    np.testing.assert_allclose(back[:4], a[:4], rtol=2.0**-8)
    assert back[4] == np.inf  # within half a bfloat16 ulp of float32's max: rounds up, to inf
    tiny = rng.uniform(-(2.0**-126), 2.0**-126, 10000).astype(np.float32)  # float32 subnormals
    assert np.abs(_round_trip(BFLOAT16, tiny) - tiny).max() <= 2.0**-134
    assert _round_trip(BFLOAT16, np.array([2.0**-133], np.float32))[0] == 2.0**-133
    np.testing.assert_array_equal(_round_trip(BFLOAT16, np.array([2.0**-135], np.float32)), [0])


def test_bfloat16_is_what_torch_rounds_to(rng):
    torch = pytest.importorskip("torch", reason="PyTorch (dev extra) is the bfloat16 reference")
    bits = rng.integers(0, 2**32, 200000, dtype=np.uint64).astype(np.uint32)
    a = bits.view(np.float32)
    want = torch.from_numpy(a.copy()).to(torch.bfloat16).to(torch.float32).numpy()
    got = _round_trip(BFLOAT16, a)
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.isnan(got[~finite]).all()


@pytest.mark.parametrize("fmt", HALF, ids=lambda f: f.label)
def test_encode_a_channel_slice_and_decode_into_one(fmt, rng):
    big = rng.standard_normal((2, 6, 3, 3)).astype(np.float32)
    data = b"".join(fmt.encode(big[:, 2:4]))
    assert len(data) == 2 * 2 * 2 * 9
    dest = np.zeros((2, 6, 3, 3), np.float32)
    fmt.decode_into(dest[:, 1:3], data)
    np.testing.assert_array_equal(dest[:, 1:3], _round_trip(fmt, big[:, 2:4].copy()))
    assert not dest[:, [0, 3, 4, 5]].any()
    assert big.base is None and fmt.encode(big)  # the source is left as it was


@pytest.mark.parametrize("fmt", HALF, ids=lambda f: f.label)
def test_an_odd_byte_count_is_refused(fmt):
    with pytest.raises(MalformedMessage, match=f"7 bytes of {fmt.label} data"):
        fmt.decode(b"\x00" * 7, (4,))
    with pytest.raises(MalformedMessage):
        fmt.decode_into(np.empty(4, np.float32), b"\x00" * 9)
    header = pb.TensorHeader(name="x", shape=[4], dtype=fmt.dtype, nbytes=7)
    with pytest.raises(
        MalformedHeader, match=f"declares 7 bytes but shape \\(4,\\) of {fmt.label}"
    ):
        wire.check_tensors([header], ["x"])
    # A header that is right, then data one byte short: the stream ends short.
    good = pb.TensorHeader(name="x", shape=[4], dtype=fmt.dtype, nbytes=8)
    receiver = wire.TensorReceiver.of(wire.check_tensors([good], ["x"]))
    receiver.feed(memoryview(b"\x00" * 7))
    with pytest.raises(MalformedMessage, match="after 7 bytes"):
        receiver.finish()


def test_answer_dtype_unset_means_float32_and_unknown_is_named():
    assert formats.answer_format(pb.DTYPE_UNSPECIFIED) is FLOAT32
    assert formats.answer_dtype(FLOAT32) == pb.DTYPE_UNSPECIFIED  # float32 requests unchanged
    for fmt in HALF:
        assert formats.answer_format(formats.answer_dtype(fmt)) is fmt
    with pytest.raises(UnsupportedFormat, match="answer dtype 42 is not a format"):
        formats.answer_format(42)


# -- the table of calls --------------------------------------------------------------------------

SHAPE = calls.call_shape((2, 3, 8, 8), (4, 3, 3, 3), (1, 1, 1, 1))


@pytest.mark.parametrize("fmt", HALF, ids=lambda f: f.label)
def test_activations_follow_the_format_and_kernels_stay_float32(fmt):
    assert calls.FORWARD.request_formats(fmt) == {"x": fmt, "w": FLOAT32, "b": FLOAT32}
    assert calls.FORWARD.answer_formats(fmt=fmt) == {"y": fmt}
    assert calls.BACKWARD.request_formats(fmt) == {"dy": fmt}
    assert calls.BACKWARD.answer_formats(True, fmt) == {"dw": FLOAT32, "db": FLOAT32, "dx": fmt}
    dtypes = {h.name: h.dtype for h in calls.BACKWARD.answer_headers(SHAPE, True, fmt)}
    assert dtypes == {"dw": pb.FLOAT32, "db": pb.FLOAT32, "dx": fmt.dtype}
    half = calls.BACKWARD.answer_bytes(SHAPE, True, fmt)
    assert half == 4 * (4 * 3 * 9 + 4) + 2 * (2 * 3 * 8 * 8)


@pytest.mark.parametrize("fmt", HALF, ids=lambda f: f.label)
def test_call_bytes_halve_the_activations(fmt):
    layers = network_layers("paper-50-500", 16)
    for layer in layers:
        for phase in PHASES:
            full, half = call_bytes(layer, phase, 10), call_bytes(layer, phase, 10, fmt=fmt)
            s = layer.shape
            maps = 10 * layer.map_bytes
            x = layer.x_bytes
            if phase == FORWARD:
                assert full.tensors_sent - half.tensors_sent == x // 2
                assert full.tensors_received - half.tensors_received == maps // 2
                assert half.sent - half.tensors_sent == full.sent - full.tensors_sent + 2
            else:
                assert full.tensors_sent - half.tensors_sent == maps // 2
                dx = x // 2 if layer.need_input_grad else 0
                assert full.tensors_received - half.tensors_received == dx
            assert s.k >= 10


# -- real workers --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(2) as launched:
        yield launched.addresses


def _reference(x, w, b, padding, dy):
    cpu = get_backend("cpu")
    y = cpu.conv_forward(x, w, b, padding)
    dw, db = cpu.conv_grad_kernels(x, dy, w.shape[2:], padding)
    dx = cpu.conv_grad_input(dy, w, x.shape[2:], padding)
    return y, dw, db, dx


@pytest.mark.parametrize("big", [False, True], ids=["bundled", "streamed"])
@pytest.mark.parametrize("fmt", HALF, ids=lambda f: f.label)
def test_a_real_worker_computes_on_what_the_format_carries(workers, rng, fmt, big):
    n, size = (32, 48) if big else (2, 8)
    x = rng.standard_normal((n, 8, size, size)).astype(np.float32)
    w = rng.standard_normal((6, 8, 3, 3)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    padding = (1, 1, 1, 1)
    dy = rng.standard_normal((n, 6, size, size)).astype(np.float32)
    client = WorkerClient(workers[0], wire_format=fmt)
    try:
        session = int(rng.integers(1, 2**62))
        y, fstats = client.forward(session, 1, "conv", x, w, b, padding)
        dx, dw, db, bstats = client.backward(session, 1, "conv", dy, True)
    finally:
        client.close()
    assert fstats.bundled != big and bstats.bundled is False
    # The worker computed on x and dy as rounded to the format, with w and b exact; its y and dx
    # came back rounded once more; dw and db came back exact.
    xr, dyr = _round_trip(fmt, x), _round_trip(fmt, dy)
    want_y, want_dw, want_db, want_dx = _reference(xr, w, b, padding, dyr)
    scale = 2.0 ** -BITS[fmt]
    # (Within one unit of the format: the float32 sums may differ in their last bit, here and
    # on the worker, and a value near a rounding boundary then rounds the other way.)
    ulp = 2.0 ** -(BITS[fmt] - 1)
    np.testing.assert_allclose(y, _round_trip(fmt, want_y), rtol=ulp, atol=1e-4)
    np.testing.assert_allclose(dx, _round_trip(fmt, want_dx), rtol=ulp, atol=1e-4)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(db, want_db, rtol=1e-5, atol=1e-3)
    # Against the exact float32 computation the error is the format's rounding, no more.
    exact_y = _reference(x, w, b, padding, dy)[0]
    err = np.abs(y - exact_y).max() / np.abs(exact_y).max()
    assert err < 8 * scale
    # What moved: activations at 2 bytes, kernels and their gradients at 4.
    assert fstats.bytes_sent - (2 * x.size + 4 * (w.size + b.size)) < 200
    assert fstats.bytes_received - 2 * y.size < 200
    assert bstats.bytes_sent - 2 * dy.size < 200
    assert bstats.bytes_received - (4 * (w.size + b.size) + 2 * x.size) < 200


def _stream(channel, name):
    return channel.stream_stream(
        f"/{SERVICE_NAME}/{name}",
        request_serializer=wire.serialize_message,
        response_deserializer=wire.deserialize_message,
    )


def _forward_request(x, w, b, fmt, answer_dtype, data=None):
    out = wire.encode_tensors([("x", x), ("w", w), ("b", b)], [fmt, FLOAT32, FLOAT32])
    request = pb.ConvRequest(
        phase=pb.FORWARD, session=7, step=1, layer="conv", padding=(0, 0, 0, 0),
        tensors=out.headers, answer_dtype=answer_dtype,
    )  # fmt: skip
    payload = b"".join(out.segments) if data is None else data
    return [pb.ConvMessage(header=request), memoryview(payload)]


def _refused(channel, messages) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        list(_stream(channel, "Forward")(iter(messages), timeout=30))
    return info.value


@pytest.fixture(scope="module")
def channel(workers):
    with grpc.insecure_channel(workers[1], options=wire.channel_options()) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield ch


def test_the_worker_answers_in_the_format_asked_for(channel, rng):
    x = rng.standard_normal((1, 2, 5, 5)).astype(np.float32)
    w = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    b = np.zeros(3, np.float32)
    for fmt in ALL:
        messages = _forward_request(x, w, b, FLOAT16, formats.answer_dtype(fmt))
        head, *data = list(_stream(channel, "Forward")(iter(messages), timeout=30))
        (y,) = head.result.tensors
        assert (y.name, y.dtype, y.nbytes) == ("y", fmt.dtype, fmt.nbytes((1, 3, 3, 3)))


def test_a_worker_refuses_an_unknown_answer_format_naming_it(channel, rng):
    x, w, b = np.ones((1, 2, 5, 5), np.float32), np.ones((3, 2, 3, 3), np.float32), np.ones(3)
    error = _refused(channel, _forward_request(x, w, b.astype(np.float32), FLOAT32, 9))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "answer dtype 9 is not a format this worker knows" in error.details()


@pytest.mark.parametrize("fmt", HALF, ids=lambda f: f.label)
def test_a_worker_refuses_a_16_bit_payload_of_an_odd_byte_count(channel, fmt):
    x, w, b = np.ones((1, 2, 5, 5), np.float32), np.ones((3, 2, 3, 3), np.float32), np.ones(3)
    good = _forward_request(x, w, b.astype(np.float32), fmt, fmt.dtype)
    short = bytes(good[1])[:-1]  # the x bytes are 2 x 50; one byte less in all
    error = _refused(channel, [good[0], memoryview(short)])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stream ended after" in error.details()
    head = pb.ConvMessage()
    head.CopyFrom(good[0])
    head.header.tensors[0].nbytes = 99  # odd, for 50 float16 values
    error = _refused(channel, [head, good[1]])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"declares 99 bytes but shape (1, 2, 5, 5) of {fmt.label} holds 100" in error.details()


def test_echo_returns_each_tensor_in_the_format_it_came_in(workers, rng):
    a = rng.standard_normal((3, 100)).astype(np.float32)
    client = WorkerClient(workers[0])
    try:
        for fmt in ALL:
            (back,), stats = client.echo([("a", a)], fmt=fmt)
            np.testing.assert_array_equal(back, _round_trip(fmt, a))
            assert stats.bytes_received - fmt.nbytes(a.shape) < 100
    finally:
        client.close()


# -- training through the cluster ----------------------------------------------------------------

TRAIN = dict(preset="tiny", steps=4, batch=16, train_size=64, eval_size=16, progress=False)
SHARES = {"conv1": (3, 3, 2), "conv2": (6, 5, 5)}


@pytest.fixture(scope="module")
def runs(workers, tmp_path_factory):
    """A float32 and a bfloat16 and a float16 run of the same steps, with their traces."""
    out = {}
    for fmt in ALL:
        trace = tmp_path_factory.mktemp(fmt.label) / "steps.jsonl"
        config = ClusterConfig(shares=SHARES, wire_format=fmt)
        with Cluster(workers, config=config) as cluster:
            result = train(TrainConfig(**TRAIN, trace=str(trace)), cluster, log=io.StringIO())
        out[fmt] = result, trace
    return out


@pytest.mark.parametrize("fmt", HALF, ids=lambda f: f.label)
def test_16_bit_training_follows_float32_closely(runs, fmt):
    (want, _), (got, _) = runs[FLOAT32], runs[fmt]
    assert all(math.isfinite(v) for v in got.losses)
    np.testing.assert_allclose(got.losses, want.losses, rtol=0.02)


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.label)
def test_the_trace_records_the_format_and_call_bytes_equal_its_bytes(runs, fmt):
    from hetconv.simulations.trace import read_steps

    _, trace = runs[fmt]
    lines = trace.read_text().splitlines()
    plan = json.loads(lines[0])
    assert plan["event"] == "plan" and plan["wire_format"] == fmt.label
    layers = {layer.name: layer for layer in network_layers("tiny", TRAIN["batch"])}
    checked = 0
    for record in read_steps(str(trace)):
        assert record["wire_format"] == fmt.label
        names = list(record["nodes"])
        for layer_name, shares in SHARES.items():
            offset = shares[0]
            for node, share in zip(names[1:], shares[1:], strict=True):
                entry = record["nodes"][node][layer_name]
                for phase in (FORWARD, BACKWARD):
                    want = call_bytes(layers[layer_name], phase, share, offset, record["step"], fmt)
                    got = entry[phase]
                    assert (got["bytes_sent"], got["bytes_received"]) == (want.sent, want.received)
                    assert got["bundled"] == want.bundled
                    checked += 1
                offset += share
    assert checked == 4 * 2 * 2 * 2


def test_a_16_bit_trace_calibrates_the_simulator(runs):
    from hetconv.simulations.calibrate import calibrate

    _, trace = runs[FLOAT16]
    cal = calibrate(str(trace))
    assert cal.network == "tiny" and cal.wire.format is FLOAT16


# -- the simulator -------------------------------------------------------------------------------


def test_a_scenario_names_its_wire_format_and_the_flag_replaces_it(tmp_path, capsys):
    from hetconv.cli.simulate import main
    from hetconv.simulations.scenario import load_scenario

    base = load_scenario("gigabit-lan")
    assert base.wire.format is FLOAT32
    path = tmp_path / "half.toml"
    text = (
        'name = "half"\n[network]\nkind = "switched"\nbandwidth_mbps = 100\n'
        '[sweep]\nnodes = [1, 3]\nnetworks = ["paper-50-500"]\nbatches = [16]\n'
        '[master]\nname = "m"\ngflops = 50\n[[workers]]\nname = "a"\ngflops = 50\n'
        '[[workers]]\nname = "b"\ngflops = 50\n[wire]\nformat = "bfloat16"\n'
    )
    path.write_text(text)
    assert load_scenario(str(path)).wire.format is BFLOAT16
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace('"bfloat16"', '"float8"'))
    with pytest.raises(ValueError, match=r"\[wire\] format must be one of float32"):
        load_scenario(str(bad))
    rows = {}
    for flag in ("float32", "float16"):
        json_path = tmp_path / f"{flag}.json"
        args = [str(path), "--wire-format", flag, "--policy", "compute", "--quiet", "--paper-modes"]
        assert main([*args, "--json", str(json_path)]) == 0
        rows[flag] = json.loads(json_path.read_text())
    capsys.readouterr()
    for full, half in zip(rows["float32"], rows["float16"], strict=True):
        assert half["shares"] == full["shares"]
        if full["policy"].startswith("dp-"):  # data parallelism moves float32 gradients
            assert half["mbytes_per_step"] == full["mbytes_per_step"]
        elif full["nodes"] > 1:  # activations halve; kernels (a fifth of the bytes here) do not
            assert half["mbytes_per_step"] < 0.65 * full["mbytes_per_step"]
