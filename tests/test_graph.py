"""Layers as a graph: what a spec's ``inputs`` may say, the refusals, the graph's passes
(gradients summed where a tensor feeds several layers) and the stage chains found on it.

No layer type reads two tensors yet, so a spec cannot fan a tensor out (both branches would
have to meet again, and only a layer of two inputs can join them). The summation is checked on
the graph's passes directly and through :class:`Model` with a two-input layer defined here,
registered for these tests only.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import hetconv.model as model_module
import hetconv.spec as spec_module
from hetconv.conv import LocalConv
from hetconv.graph import NETWORK_INPUT, Layer, LayerGraph, graph_backward, graph_forward
from hetconv.layers import Linear, MaxPool2d, Pool2d
from hetconv.model import PRESETS, ConvStage, Model, load_spec, walk_spec
from hetconv.spec import accepted_keys, check_spec


class Add2(Layer):
    """Test only: the sum of two tensors of one shape."""

    arity = 2

    def forward(self, a, b):
        return a + b

    def backward(self, dy):
        return dy, dy


class Mul2(Layer):
    """Test only: the elementwise product of two tensors (each input's gradient needs the
    other's value, so a wrong sum shows)."""

    arity = 2

    def forward(self, a, b):
        self._a, self._b = a, b
        return a * b

    def backward(self, dy):
        return dy * self._b, dy * self._a


class Fixed(Layer):
    """Test only: the identity forward, a fixed gradient back."""

    def __init__(self, name, grad):
        super().__init__(name)
        self.grad = grad

    def forward(self, x):
        return x

    def backward(self, dy):
        return self.grad


@pytest.fixture
def add_type(monkeypatch):
    """An ``add`` layer type of two inputs, for this test only."""
    monkeypatch.setitem(spec_module.LAYER_OPTIONS, "add", {})
    monkeypatch.setitem(spec_module.LAYER_ARITY, "add", (2, 2))
    monkeypatch.setitem(model_module.BUILDERS, "add", lambda model, item: Add2(item.name))


class Staged(LocalConv):
    supports_stages = True
    supports_head = True


# ------------------------------------------------------------------------- the spec's inputs


def _sequential():
    return [
        {"type": "conv", "name": "c1", "out": 4, "kernel": 3, "padding": 1},
        {"type": "relu"},
        {"type": "maxpool", "kernel": 2},
        {"type": "conv", "name": "c2", "out": 6, "kernel": 3, "padding": 1},
        {"type": "batchnorm"},
        {"type": "dropout", "p": 0.25},
        {"type": "fc", "name": "fc", "out": 3},
    ]


def test_inputs_default_to_the_layer_before():
    spec = _sequential()
    named = [dict(entry) for entry in spec]
    names = [item.name for item in walk_spec(spec, (3, 8, 8))]
    for entry, before in zip(named[1:], names, strict=False):
        entry["inputs"] = [before]
    default, explicit = Model(spec, (3, 8, 8), seed=4), Model(named, (3, 8, 8), seed=4)
    assert default.graph.inputs == explicit.graph.inputs == (
        (NETWORK_INPUT,), (0,), (1,), (2,), (3,), (4,), (5,)
    )  # fmt: skip
    walked = [(i.name, i.inputs, i.input_shape, i.output_shape) for i in walk_spec(spec, (3, 8, 8))]
    assert walked == [
        (i.name, i.inputs, i.input_shape, i.output_shape) for i in walk_spec(named, (3, 8, 8))
    ]
    assert walked[0][1] == () and walked[1][1] == ("c1",)
    for a, b in zip(default.state().values(), explicit.state().values(), strict=True):
        assert np.array_equal(a, b)
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    for m in (default, explicit):
        m.backward(np.ones_like(m.forward(x, step=0)))
    assert np.array_equal(default.forward(x, step=1), explicit.forward(x, step=1))
    for (k, a), b in zip(default.gradients().items(), explicit.gradients().values(), strict=True):
        assert np.array_equal(a, b), k


def test_every_preset_but_the_residual_ones_is_a_chain_of_default_inputs():
    for spec in [spec for name, spec in PRESETS.items() if not name.startswith("resnet")]:
        graph = spec_module.spec_graph(spec)
        assert graph.inputs == ((NETWORK_INPUT,), *((i,) for i in range(len(spec) - 1)))


@pytest.mark.parametrize(
    "inputs, words",
    [
        (["conv9"], r"layer 2 \(maxpool 'maxpool1'\): input 'conv9' names no layer"),
        (["maxpool1"], r"layer 2 \(maxpool 'maxpool1'\): input 'maxpool1' is the layer itself"),
        (["fc"], r"layer 2 \(maxpool 'maxpool1'\): input 'fc' is layer 3, after it"),
        (
            ["relu1", "c1"],
            r"layer 2 \(maxpool 'maxpool1'\) reads 2 inputs \('relu1', 'c1'\); maxpool takes 1",
        ),
        ("relu1", r"layer 2 \(maxpool 'maxpool1'\): inputs is 'relu1'; expected a list"),
        ([], r"inputs is \[\]; expected a list of the names of earlier layers"),
        ([1], r"inputs is \[1\]; expected a list"),
    ],
)
def test_bad_inputs_are_refused_naming_the_layer_and_the_input(inputs, words):
    spec = _sequential()[:3] + [{"type": "fc", "name": "fc", "out": 2}]
    spec[2] = {**spec[2], "inputs": inputs}
    with pytest.raises(ValueError, match=words):
        check_spec(spec)
    with pytest.raises(ValueError, match=words):
        Model(spec, (3, 8, 8))


def test_a_layer_whose_output_reaches_nothing_is_refused():
    # maxpool reads c1, not relu1: nothing reads relu1, whose work would be wasted
    spec = _sequential()[:3] + [{"type": "fc", "name": "fc", "out": 2}]
    spec[2] = {**spec[2], "inputs": ["c1"]}
    with pytest.raises(ValueError, match=r"layer 1 \(relu 'relu1'\) feeds nothing: no path from"):
        walk_spec(spec, (3, 8, 8)).__next__()
    with pytest.raises(ValueError, match=r"reaches the output, the last layer \('fc'\)"):
        Model(spec, (3, 8, 8))


def test_a_spec_file_names_the_file_and_the_bad_input(tmp_path):
    spec = _sequential()
    spec[1]["inputs"] = ["c2"]
    path = tmp_path / "net.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"net.json: layer 1 \(relu 'relu1'\): input 'c2' is"):
        load_spec(str(path))


def test_inputs_are_a_key_of_every_type():
    assert "inputs (list of earlier layers' names)" in accepted_keys("gap")
    with pytest.raises(ValueError, match="gap accepts type, name"):
        check_spec([{"type": "gap", "input": ["x"]}])


def test_a_layer_of_two_inputs_needs_them_named(add_type):
    spec = [{"type": "conv", "out": 2, "kernel": 1}, {"type": "add"}, {"type": "fc", "out": 2}]
    with pytest.raises(ValueError, match=r"layer 1 \(add 'add1'\): add reads 2 layers: name"):
        check_spec(spec)
    spec[1]["inputs"] = ["conv1"]
    with pytest.raises(ValueError, match=r"add 'add1'\) reads 1 input \('conv1'\); add takes 2$"):
        check_spec(spec)


# ---------------------------------------------------------------------------- the graph


def test_the_graph_knows_consumers_followers_and_chains():
    # 0 -> 1 -> 2, 0 -> 3, (2, 3) -> 4 -> 5
    graph = LayerGraph(tuple("abcdef"), ((NETWORK_INPUT,), (0,), (1,), (0,), (2, 3), (4,)))
    assert graph.consumers == ((1, 3), (2,), (4,), (4,), (5,), ())
    assert [graph.follower(i) for i in range(6)] == [None, 2, None, None, 5, None]
    assert graph.chain(1, lambda j: True) == [2]
    assert graph.chain(4, lambda j: True) == [5]
    assert graph.chain(4, lambda j: False) == []
    groups = [[0], [1, 2], [3], [4, 5]]
    assert graph.step_inputs(groups) == [(NETWORK_INPUT,), (0,), (0,), (1, 2)]


def _linear(name, n_in, n_out, rng):
    layer = Linear(name, n_in, n_out)
    layer.params = {k: rng.standard_normal(v.shape) for k, v in layer.params.items()}
    return layer


def test_gradients_are_summed_where_a_tensor_feeds_two_steps(rng):
    # x -> a; a feeds b and the product; b feeds the product; the input feeds c too:
    # y = d(c(x) + a(x) * b(a(x))), in float64 for a tight check
    a, b, c, d = (_linear(n, 5, 5, rng) for n in "abcd")
    mul, add = Mul2("mul"), Add2("add")
    steps = [a, b, mul, c, add, d]
    inputs = [(NETWORK_INPUT,), (0,), (0, 1), (NETWORK_INPUT,), (3, 2), (4,)]
    x = rng.standard_normal((3, 5))
    r = rng.standard_normal((3, 5))

    def f(x):
        return float(np.sum(graph_forward(steps, inputs, x) * r))

    f(x)
    dx = graph_backward(steps, inputs, r)
    analytic = {"x": dx, **{f"{n.name}.weight": n.grads["weight"] for n in (a, b, c)}}
    targets = {"x": x, **{f"{n.name}.weight": n.params["weight"] for n in (a, b, c)}}
    for name, array in targets.items():
        numeric = np.zeros_like(array)
        for i in np.ndindex(array.shape):
            old = array[i]
            array[i] = old + 1e-6
            up = f(x)
            array[i] = old - 1e-6
            down = f(x)
            array[i] = old
            numeric[i] = (up - down) / 2e-6
        np.testing.assert_allclose(analytic[name], numeric, rtol=1e-5, atol=1e-6, err_msg=name)
        assert np.abs(analytic[name]).max() > 1e-2, name


def test_the_sum_is_in_a_fixed_order_the_later_reader_first():
    g = [np.float32(v) * np.ones(4, np.float32) for v in (1e8, -1e8, 3.0)]
    g[2][1:] = (0.1, 0.7, 1.3)
    fixed = [Fixed(f"f{i}", g[i]) for i in range(3)]

    class Sum3(Layer):
        arity = 3

        def forward(self, *xs):
            return sum(xs)

        def backward(self, dy):
            return dy, dy, dy

    class Identity(Layer):
        def forward(self, x):
            return x

        def backward(self, dy):
            return dy

    steps = [Identity("i"), *fixed, Sum3("s")]
    inputs = [(NETWORK_INPUT,), (0,), (0,), (0,), (1, 2, 3)]
    graph_forward(steps, inputs, np.ones((1, 4), np.float32))
    out = graph_backward(steps, inputs, np.ones((1, 4), np.float32))
    np.testing.assert_array_equal(out, (g[2] + g[1]) + g[0])
    assert not np.array_equal(out, (g[0] + g[1]) + g[2])  # the order shows


def test_a_step_with_no_gradient_is_skipped_unless_pending():
    ran = []

    class Step(Layer):
        def forward(self, x):
            return x

        def backward(self, dy):
            ran.append(self.name)
            return None

    steps = [Step("a"), Step("b"), Step("c")]
    inputs = [(NETWORK_INPUT,), (0,), (1,)]
    graph_forward(steps, inputs, np.zeros(2))
    graph_backward(steps, inputs, np.ones(2))
    assert ran == ["c"]
    ran.clear()
    graph_backward(steps, inputs, np.ones(2), pending=lambda step: step.name == "a")
    assert ran == ["c", "a"]


# ------------------------------------------------------------- the model on a graph


def _residual():
    """c1 -> r1; r1 feeds ca and cb; ca -> ra; cb -> rb (listed between ca and ra); the sum
    of ra and rb -> pool -> fc."""
    return [
        {"type": "conv", "name": "c1", "out": 4, "kernel": 3, "padding": 1},
        {"type": "relu", "name": "r1"},
        {"type": "conv", "name": "ca", "out": 4, "kernel": 3, "padding": 1},
        {"type": "conv", "name": "cb", "out": 4, "kernel": 1, "inputs": ["r1"]},
        {"type": "relu", "name": "rb"},
        {"type": "relu", "name": "ra", "inputs": ["ca"]},
        {"type": "add", "name": "sum", "inputs": ["ra", "rb"]},
        {"type": "maxpool", "kernel": 2},
        {"type": "fc", "name": "fc", "out": 3},
    ]


def test_a_residual_graph_walks_and_fuses_only_along_chains(add_type):
    walked = {i.name: i for i in walk_spec(_residual(), (3, 6, 6))}
    assert walked["sum"].inputs == ("ra", "rb")
    assert walked["sum"].input_shapes == ((4, 6, 6), (4, 6, 6))
    assert walked["fc"].input_shape == (4, 3, 3)
    convs = {name: item.conv for name, item in walked.items() if item.conv is not None}
    # c1's stage stops at r1, which two layers read; ca's chain is ra, listed after cb
    assert [op.kind for op in convs["c1"].stage.ops] == ["relu"]
    assert [op.kind for op in convs["ca"].stage.ops] == ["relu"]
    assert [op.kind for op in convs["cb"].stage.ops] == ["relu"]
    assert [(c.feeds, c.head) for c in convs.values()] == [(None, None)] * 3
    assert [c.need_input_grad for c in convs.values()] == [False, True, True]
    model = Model(_residual(), (3, 6, 6), executor=Staged())
    assert [type(b).__name__ for b in model.blocks] == [
        "ConvStage", "ConvStage", "ConvStage", "Add2", "Pool2d", "Linear",
    ]  # fmt: skip
    assert [b.chain[0].name for b in model.blocks if isinstance(b, ConvStage)] == [
        "r1", "ra", "rb"
    ]  # fmt: skip
    assert model.block_inputs == [(NETWORK_INPUT,), (0,), (0,), (1, 2), (3,), (4,)]
    assert [s.name for s in model.conv_specs()] == ["c1", "ca", "cb"]


def test_a_residual_model_sums_its_gradients(add_type, rng):
    spec = [  # linear in c1's weights, so central differences are exact but for rounding
        {"type": "conv", "name": "c1", "out": 4, "kernel": 3, "padding": 1},
        {"type": "conv", "name": "ca", "out": 4, "kernel": 3, "padding": 1},
        {"type": "conv", "name": "cb", "out": 4, "kernel": 1, "inputs": ["c1"]},
        {"type": "add", "name": "sum", "inputs": ["ca", "cb"]},
        {"type": "gap"},
        {"type": "fc", "name": "fc", "out": 3},
    ]
    model = Model(spec, (2, 4, 4), seed=1)
    assert model.graph.consumers[0] == (1, 2)  # c1 feeds both convolutions
    x = rng.standard_normal((2, 2, 4, 4)).astype(np.float32)
    r = rng.standard_normal((2, 3)).astype(np.float32)
    model.forward(x)
    model.backward(r)
    weight = model.parameters()["c1.weight"]
    analytic = model.gradients()["c1.weight"]
    numeric = np.zeros(weight.shape)
    for i in np.ndindex(weight.shape):
        old = weight[i]
        sums = []
        for step in (1e-2, -1e-2):
            weight[i] = old + np.float32(step)
            sums.append(float(np.sum(model.forward(x).astype(np.float64) * r)))
        weight[i] = old
        numeric[i] = (sums[0] - sums[1]) / 2e-2
    np.testing.assert_allclose(analytic, numeric, rtol=1e-2, atol=1e-3)
    assert np.abs(analytic).max() > 0.1


def test_a_staged_residual_model_computes_what_a_plain_one_does(add_type, rng):
    x = rng.standard_normal((3, 3, 6, 6)).astype(np.float32)
    out = []
    for executor in (None, Staged()):
        model = Model(_residual(), (3, 6, 6), seed=2, executor=executor)
        y = model.forward(x)
        model.backward(np.ones_like(y))
        out.append((y, model.gradients()))
    assert np.array_equal(out[0][0], out[1][0])
    for key, grad in out[0][1].items():
        assert np.array_equal(grad, out[1][1][key]), key


def test_a_sequential_spec_keeps_its_stages_feeds_and_head():
    specs = Model(PRESETS["tiny"], executor=Staged()).conv_specs()
    assert [(s.name, s.feeds, s.head) for s in specs] == [
        ("conv1", "conv2", None),
        ("conv2", None, ("fc", 10)),
    ]
    assert [len(s.stage.ops) for s in specs] == [3, 3]


# ------------------------------------------------------------------------------ pooling


def test_max_and_average_pooling_are_one_class():
    assert type(MaxPool2d("p", 2)) is Pool2d and MaxPool2d("p", 2).mode == "max"
    pools = [layer for layer in Model(load_spec("tiny")).layers if isinstance(layer, Pool2d)]
    assert [p.mode for p in pools] == ["max", "max"]
    with pytest.raises(ValueError, match=r"p: pool mode 'min'; expected one of \('max', 'avg'\)"):
        Pool2d("p", 2, mode="min")
