"""Model construction from specs and presets, initialisation, weight files and input checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hetconv.conv import ConvSpec
from hetconv.layers import Conv2d, Linear, LocalResponseNorm, Pool2d, ReLU
from hetconv.model import CIFAR_INPUT, PRESETS, Model, load_spec, reference_spec, walk_spec
from hetconv.workload import ConvLayer, conv_layers

SMALL_SPEC = [
    {"type": "conv", "name": "conv1", "out": 4, "kernel": 3, "padding": 1},
    {"type": "relu"},
    {"type": "lrn", "size": 3, "alpha": 0.5},
    {"type": "maxpool", "kernel": 2, "stride": 2},
    {"type": "conv", "name": "conv2", "out": 5, "kernel": (2, 3), "padding": "same"},
    {"type": "relu"},
    {"type": "maxpool", "kernel": 3, "stride": 2},
    {"type": "fc", "name": "fc", "out": 3},
]
SMALL_INPUT = (2, 8, 8)


def _expected_shapes(c1: int, c2: int) -> dict[str, tuple[int, ...]]:
    return {
        "conv1.weight": (c1, 3, 5, 5),
        "conv1.bias": (c1,),
        "conv2.weight": (c2, c1, 5, 5),
        "conv2.bias": (c2,),
        "fc.weight": (10, c2 * 8 * 8),
        "fc.bias": (10,),
    }


# ------------------------------------------------------------------------------- presets


@pytest.mark.parametrize(
    "preset, c1, c2",
    [
        ("tiny", 8, 16),
        ("paper-50-500", 50, 500),
        ("paper-150-800", 150, 800),
        ("paper-500-1500", 500, 1500),
    ],
)
def test_preset_parameter_shapes(preset, c1, c2):
    model = Model(load_spec(preset))
    params = model.parameters()
    assert {k: v.shape for k, v in params.items()} == _expected_shapes(c1, c2)
    assert all(v.dtype == np.float32 for v in params.values())
    assert model.output_shape == (10,)
    assert [type(layer) for layer in model.layers] == [
        Conv2d, ReLU, LocalResponseNorm, Pool2d,
        Conv2d, ReLU, LocalResponseNorm, Pool2d,
        Linear,
    ]  # fmt: skip
    assert [layer.name for layer in model.conv_layers()] == ["conv1", "conv2"]
    # Nothing consumes the first layer's input gradient.
    assert model.conv_layers()[0].need_input_grad is False
    assert model.conv_layers()[1].need_input_grad is True


def test_paper_preset_exact_shapes():
    shapes = {k: v.shape for k, v in Model(PRESETS["paper-500-1500"]).parameters().items()}
    assert shapes["conv1.weight"] == (500, 3, 5, 5)
    assert shapes["conv2.weight"] == (1500, 500, 5, 5)
    assert shapes["fc.weight"] == (10, 1500 * 8 * 8)


def test_all_presets_are_reference_specs():
    assert set(PRESETS) >= {"tiny", "paper-50-500", "paper-150-800", "paper-300-1000",
                            "paper-500-1500"}  # fmt: skip
    assert PRESETS["paper-300-1000"] == reference_spec(300, 1000)


def test_reference_spec_classes():
    model = Model(reference_spec(4, 6, classes=7))
    assert model.parameters()["fc.weight"].shape == (7, 6 * 8 * 8)
    assert model.output_shape == (7,)


# -------------------------------------------------------------------------- initialisation


def test_same_seed_same_weights_different_seed_different():
    a, b, c = (Model(SMALL_SPEC, SMALL_INPUT, seed=s) for s in (7, 7, 8))
    for name, value in a.parameters().items():
        np.testing.assert_array_equal(value, b.parameters()[name])
        assert not np.array_equal(value, c.parameters()[name]), name


def test_init_weights_is_pytorch_default_uniform():
    model = Model(reference_spec(16, 32), seed=1)
    for name, value in model.parameters().items():
        layer = name.split(".")[0]
        fan_in = int(np.prod(model.parameters()[f"{layer}.weight"].shape[1:]))
        bound = 1.0 / np.sqrt(fan_in)
        assert np.abs(value).max() <= bound, name
        if value.size >= 1000:
            # U(-b, b) has standard deviation b / sqrt(3) and mean 0.
            assert value.std() == pytest.approx(bound / np.sqrt(3), rel=0.05), name
            assert abs(value.mean()) < 0.05 * bound, name


def test_init_weights_reseeds_in_place():
    model = Model(SMALL_SPEC, SMALL_INPUT, seed=1)
    live = model.parameters()
    model.init_weights(2)
    fresh = Model(SMALL_SPEC, SMALL_INPUT, seed=2).parameters()
    for name, value in live.items():
        assert value is model.parameters()[name]  # the same live arrays
        np.testing.assert_array_equal(value, fresh[name])


# ------------------------------------------------------------------------------ bad specs


@pytest.mark.parametrize(
    "spec, words",
    [
        ([{"type": "conv", "name": "c1", "out": 4}, {"type": "pool"}], ["layer 1", "'pool'"]),
        ([{"out": 4}], ["layer 0", "None"]),
        ([{"type": "relu"}, {"type": "conv", "name": "convA", "kernel": 3}], ["layer 1", "out"]),
        ([{"type": "fc", "name": "fcX"}], ["layer 0", "fcX", "out"]),
        (
            [{"type": "fc", "name": "fc", "out": 10}, {"type": "conv", "name": "late", "out": 2}],
            ["layer 1", "late"],
        ),
        ([{"type": "maxpool", "kernel": 0}], ["layer 0"]),
        ([{"type": "lrn", "size": 0}], ["layer 0", "size"]),
        ([{"type": "conv", "name": "c1", "out": "many"}], ["layer 0", "c1"]),
    ],
    ids=["unknown-type", "missing-type", "conv-missing-out", "fc-missing-out", "conv-after-fc",
         "pool-kernel-0", "lrn-size-0", "out-not-int"],
)  # fmt: skip
def test_bad_spec_names_the_layer(spec, words):
    with pytest.raises(ValueError) as info:
        Model(spec, SMALL_INPUT)
    for word in words:
        assert word in str(info.value)


BAD_SPECS = [
    [{"type": "conv", "name": "c1", "out": 4}, {"type": "pool"}],
    [{"out": 4}],
    [{"type": "relu"}, {"type": "conv", "name": "convA", "kernel": 3}],
    [{"type": "fc", "name": "fcX"}],
    [{"type": "fc", "name": "fc", "out": 10}, {"type": "conv", "name": "late", "out": 2}],
    [{"type": "maxpool", "kernel": 0}],
    [{"type": "maxpool", "stride": 0}],
    [{"type": "conv", "name": "c1", "out": "many"}],
    [{"type": "conv", "name": "c1", "out": 2, "kernel": 2.5}],
    [{"type": "maxpool", "name": "bigpool", "kernel": 9}],
    [{"type": "conv", "name": "bigconv", "out": 2, "kernel": 9}],
    [{"type": "conv", "name": "c1", "out": 2, "padding": "full"}],
]


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_the_walk_refuses_what_the_model_refuses_in_the_same_words(spec):
    with pytest.raises(ValueError) as walked:
        list(walk_spec(spec, SMALL_INPUT))
    with pytest.raises(ValueError) as built:
        Model(spec, SMALL_INPUT)
    assert str(walked.value) == str(built.value)


def test_walk_spec_gives_each_layer_its_shapes():
    walked = list(walk_spec(SMALL_SPEC, SMALL_INPUT))
    model = Model(SMALL_SPEC, SMALL_INPUT)
    assert [w.name for w in walked] == [layer.name for layer in model.layers]
    assert [w.kind for w in walked] == [entry["type"] for entry in SMALL_SPEC]
    assert [w.index for w in walked] == list(range(len(SMALL_SPEC)))
    assert walked[0].input_shape == SMALL_INPUT and walked[-1].output_shape == (3,)
    for before, after in zip(walked[:-1], walked[1:], strict=True):
        assert after.input_shape == before.output_shape
    for w, layer in zip(walked, model.layers, strict=True):
        assert w.input_shape == layer.input_shape
        assert w.output_shape == layer.output_shape(layer.input_shape)
    assert [w.conv for w in walked if w.conv is not None] == model.conv_specs()
    first, second = model.conv_specs()
    assert first == ConvSpec("conv1", (2, 8, 8), 4, (3, 3), 1, need_input_grad=False)
    assert second == ConvSpec("conv2", (4, 4, 4), 5, (2, 3), "same", need_input_grad=True)


def test_the_cost_model_reads_the_models_convolutions():
    for preset in ("tiny", "paper-150-800"):
        specs = Model(PRESETS[preset]).conv_specs()
        layers = conv_layers(PRESETS[preset], batch=6)
        assert layers == [ConvLayer(s.name, s.shape(6), s.need_input_grad) for s in specs]


def test_pool_larger_than_input_names_the_layer():
    with pytest.raises(ValueError, match="bigpool"):
        Model([{"type": "maxpool", "name": "bigpool", "kernel": 9}], SMALL_INPUT)


def test_conv_kernel_larger_than_input_names_the_layer():
    # Same contract as the other bad specs: the message must say which layer is wrong.
    with pytest.raises(ValueError, match="bigconv"):
        Model([{"type": "conv", "name": "bigconv", "out": 2, "kernel": 9}], SMALL_INPUT)


# ------------------------------------------------------------------------------ load_spec


def test_load_spec_unknown_preset_lists_presets():
    with pytest.raises(ValueError, match="nonexistent") as info:
        load_spec("nonexistent")
    for name in PRESETS:
        assert name in str(info.value)


def test_load_spec_json_file(tmp_path):
    path = tmp_path / "net.json"
    path.write_text(json.dumps(SMALL_SPEC), encoding="utf-8")
    spec = load_spec(str(path))
    assert spec == json.loads(json.dumps(SMALL_SPEC))
    model = Model(spec, SMALL_INPUT, seed=4)
    assert model.parameters()["conv2.weight"].shape == (5, 4, 2, 3)
    assert model.parameters()["fc.weight"].shape == (3, 5 * 1 * 1)


def test_load_spec_bad_json_files(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("[{", encoding="utf-8")
    with pytest.raises(ValueError, match="cannot read model spec"):
        load_spec(str(broken))
    not_list = tmp_path / "dict.json"
    not_list.write_text('{"type": "relu"}', encoding="utf-8")
    with pytest.raises(ValueError, match="list"):
        load_spec(str(not_list))
    with pytest.raises(ValueError, match="unknown preset"):
        load_spec(str(tmp_path / "missing.json"))


# ------------------------------------------------------------------------------ weight files


@pytest.fixture
def model() -> Model:
    return Model(SMALL_SPEC, SMALL_INPUT, seed=1)


def _snapshot(model: Model) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in model.parameters().items()}


def _assert_unchanged(model: Model, before: dict[str, np.ndarray]) -> None:
    after = model.parameters()
    assert set(after) == set(before)
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)


def test_save_load_round_trip(model, tmp_path):
    path = tmp_path / "w.npz"
    model.save(path)
    assert sorted(np.load(path).files) == sorted(model.parameters())
    assert not (tmp_path / "w.npz.tmp").exists()
    other = Model(SMALL_SPEC, SMALL_INPUT, seed=2)
    live = other.parameters()
    other.load(path)
    _assert_unchanged(other, _snapshot(model))
    for name, value in other.parameters().items():
        assert value is live[name], "load must copy into the live arrays"


def _state(model: Model) -> dict[str, np.ndarray]:
    return {k: v + np.float32(0.5) for k, v in model.parameters().items()}


@pytest.mark.parametrize(
    "edit, word",
    [
        (lambda s: s.pop("conv2.bias"), "missing"),
        (lambda s: s.__setitem__("conv3.weight", np.zeros(3, np.float32)), "unexpected"),
        (lambda s: s.__setitem__("fc.weight", s["fc.weight"].T.copy()), "shape"),
        (lambda s: s.__setitem__("conv1.bias", np.zeros(5, np.float32)), "shape"),
        (lambda s: s["conv2.weight"].__setitem__((0, 0, 0, 0), np.nan), "non-finite"),
        (lambda s: s["fc.bias"].__setitem__(1, np.inf), "non-finite"),
    ],
    ids=["missing", "unexpected", "transposed", "wrong-length", "nan", "inf"],
)
def test_load_rejects_bad_weights_and_changes_nothing(model, tmp_path, edit, word):
    state = _state(model)  # every array differs from the model's, so a partial copy shows
    edit(state)
    path = tmp_path / "bad.npz"
    np.savez(path, **state)
    before = _snapshot(model)
    with pytest.raises(ValueError, match=word):
        model.load(path)
    _assert_unchanged(model, before)
    with pytest.raises(ValueError, match=word):
        model.load_state(state)
    _assert_unchanged(model, before)


def _write_text(path):
    path.write_text("these are not weights\n", encoding="utf-8")


def _write_npy(path):
    with open(path, "wb") as f:
        np.save(f, np.zeros(3, np.float32))


def _write_truncated_npz(path):
    buf = path.with_name("full.npz")
    Model(SMALL_SPEC, SMALL_INPUT).save(buf)
    data = buf.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _write_empty(path):
    path.write_bytes(b"")


def _write_pickled_npz(path):
    np.savez(path, **{"conv1.weight": np.array([object()], dtype=object)})


@pytest.mark.parametrize(
    "write",
    [_write_text, _write_npy, _write_truncated_npz, _write_empty, _write_pickled_npz],
    ids=["text", "npy", "truncated-npz", "empty", "pickled-objects"],
)
def test_load_rejects_files_that_are_not_weights(model, tmp_path, write):
    path = tmp_path / "weights.npz"
    write(path)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="weights"):
        model.load(path)
    _assert_unchanged(model, before)


def test_load_missing_file(model, tmp_path):
    with pytest.raises(ValueError, match="cannot read weights"):
        model.load(tmp_path / "absent.npz")


# ------------------------------------------------------------------------------ passes


def test_forward_rejects_bad_input(model):
    good = np.zeros((2, *SMALL_INPUT), np.float32)
    assert model.forward(good).shape == (2, 3)
    with pytest.raises(ValueError, match="float32"):
        model.forward(good.astype(np.float64))
    with pytest.raises(ValueError, match="shape"):
        model.forward(np.zeros((2, 3, 8, 8), np.float32))  # 3 channels for 2
    with pytest.raises(ValueError, match="shape"):
        model.forward(np.zeros((2, 2, 8, 9), np.float32))
    with pytest.raises(ValueError, match="shape"):
        model.forward(np.zeros(SMALL_INPUT, np.float32))  # no batch axis


def test_forward_cifar_default_input():
    model = Model(PRESETS["tiny"])
    assert model.input_shape == CIFAR_INPUT
    x = np.random.default_rng(0).standard_normal((3, *CIFAR_INPUT), dtype=np.float32)
    logits = model.forward(x)
    assert logits.shape == (3, 10) and logits.dtype == np.float32
    assert np.all(np.isfinite(logits))


def test_end_to_end_gradient_matches_finite_differences(model, rng):
    """Back-propagation through the whole model against central differences of the loss."""
    from hetconv.layers import softmax_cross_entropy

    x = rng.standard_normal((3, *SMALL_INPUT), dtype=np.float32)
    labels = np.array([0, 1, 2])
    _, grad, _ = softmax_cross_entropy(model.forward(x), labels)
    model.backward(grad)
    grads = {k: v.copy() for k, v in model.gradients().items()}
    assert set(grads) == set(model.parameters())

    def loss() -> float:
        return softmax_cross_entropy(model.forward(x), labels)[0]

    def central(value: np.ndarray, c, eps: float) -> float:
        old = value[c].copy()
        value[c] = old + np.float32(eps)
        hi, f_plus = float(value[c]), loss()
        value[c] = old - np.float32(eps)
        lo, f_minus = float(value[c]), loss()
        value[c] = old
        return (f_plus - f_minus) / (hi - lo)

    for name, value in model.parameters().items():
        # The largest-gradient coordinates: well above float32 noise, so the check can fail.
        checked = 0
        for i in np.argsort(np.abs(grads[name]).ravel())[::-1][:16]:
            c = np.unravel_index(i, value.shape)
            if abs(grads[name][c]) < 2e-3:
                break  # too small to check against float32 differences of the loss
            coarse, fine = central(value, c, 2e-3), central(value, c, 5e-4)
            if abs(coarse - fine) > 5e-3 * abs(fine) + 1e-4:
                continue  # a ReLU or max-pool kink lies within the step: not differentiable
            assert grads[name][c] == pytest.approx(fine, rel=1e-2, abs=2e-4), f"{name}{c}"
            checked += 1
            if checked == 6:
                break
        assert checked >= min(4, value.size - 1), f"{name}: too few coordinates checked"
