"""Residual and branching networks: ``add`` and ``concat``, convolutions without bias, 1x1
strided projection shortcuts, and the presets ``resnet20``, ``resnet18`` and ``vgg11``, each
checked against PyTorch (logits, every gradient, SGD steps with momentum and weight decay, in
training and evaluation mode) and run in onnxruntime from the exported graph."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from test_layers import _assert_gradient, _coords, _numeric

from hetconv.graph import Add, Concat
from hetconv.layers import Conv2d, ReLU, softmax_cross_entropy
from hetconv.model import PRESETS, Model, check_spec, load_spec, walk_spec
from hetconv.optim import SGD, SGDConfig

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

#: A small network of every new piece: a conv without bias reading the input, a residual add
#: of two branches, a 1x1 stride-2 projection, a three-way concat and a three-way add.
SMALL = [
    {"type": "conv", "name": "stem", "out": 4, "padding": 1, "bias": False},
    {"type": "batchnorm", "name": "stembn"},
    {"type": "relu", "name": "stemrelu"},
    {"type": "conv", "name": "a1", "out": 4, "padding": 1, "bias": False},
    {"type": "batchnorm", "name": "a1bn"},
    {"type": "add", "name": "res", "inputs": ["a1bn", "stemrelu"]},
    {"type": "relu", "name": "resrelu"},
    {"type": "conv", "name": "down", "out": 6, "padding": 1, "stride": 2},
    {"type": "conv", "name": "proj", "out": 6, "kernel": 1, "stride": 2, "inputs": ["resrelu"]},
    {"type": "maxpool", "name": "pool", "kernel": 2, "inputs": ["resrelu"]},
    {"type": "concat", "name": "cat", "inputs": ["down", "pool", "proj"]},
    {"type": "relu", "name": "catrelu"},
    {"type": "conv", "name": "mix", "out": 16, "kernel": 1, "bias": False},
    {"type": "add", "name": "sum3", "inputs": ["mix", "catrelu", "cat"]},
    {"type": "gap", "name": "gap"},
    {"type": "fc", "name": "fc", "out": 5},
]
SMALL_INPUT = (3, 8, 8)


# ------------------------------------------------------------------------- add and concat


def test_add_and_concat_gradients_are_the_numerical_ones(rng):
    shapes = {"add": [(2, 3, 4, 5)] * 3, "concat": [(2, 2, 4, 5), (2, 3, 4, 5), (2, 1, 4, 5)]}
    for layer in (Add("sum", 3), Concat("cat", 3)):
        kind = "add" if isinstance(layer, Add) else "concat"
        xs = [rng.standard_normal(s).astype(np.float32) for s in shapes[kind]]
        y = layer.forward(*xs)
        want = sum(xs[1:], xs[0]) if kind == "add" else np.concatenate(xs, axis=1)
        np.testing.assert_array_equal(y, want)
        r = rng.standard_normal(y.shape).astype(np.float32)
        grads = layer.backward(r.copy())
        assert len(grads) == 3

        def f() -> float:
            return float(np.sum(layer.forward(*xs).astype(np.float64) * r))  # noqa: B023

        for i, (x, g) in enumerate(zip(xs, grads, strict=True)):
            assert g.shape == x.shape and g.dtype == np.float32
            coords = _coords(x.shape, rng)
            numeric = _numeric(f, x, coords, 1e-2)
            _assert_gradient(f"{kind} d/dx{i}", np.array([g[c] for c in coords]), numeric)


@pytest.mark.parametrize(
    "spec, words",
    [
        (
            [
                {"type": "conv", "name": "a", "out": 4, "padding": 1},
                {"type": "conv", "name": "b", "out": 4, "stride": 2, "inputs": ["a"]},
                {"type": "add", "name": "join", "inputs": ["a", "b"]},
                {"type": "fc", "out": 2},
            ],
            r"layer 2 \(join\): add sums inputs of one shape, gets \(4, 8, 8\), \(4, 3, 3\)",
        ),
        (
            [
                {"type": "conv", "name": "a", "out": 4, "padding": 1},
                {"type": "conv", "name": "b", "out": 5, "padding": 1, "inputs": ["a"]},
                {"type": "add", "name": "join", "inputs": ["a", "b"]},
                {"type": "fc", "out": 2},
            ],
            r"layer 2 \(join\): add sums inputs of one shape, gets \(4, 8, 8\), \(5, 8, 8\)",
        ),
        (
            [
                {"type": "conv", "name": "a", "out": 4, "padding": 1},
                {"type": "maxpool", "name": "p", "inputs": ["a"]},
                {"type": "concat", "name": "cat", "inputs": ["a", "p"]},
                {"type": "fc", "out": 2},
            ],
            r"layer 2 \(cat\): concat joins inputs of one height and width, gets "
            r"\(4, 8, 8\), \(4, 4, 4\)",
        ),
        (
            [
                {"type": "fc", "name": "f", "out": 4},
                {"type": "fc", "name": "g", "out": 4, "inputs": ["f"]},
                {"type": "concat", "name": "cat", "inputs": ["f", "g"]},
                {"type": "fc", "out": 2},
            ],
            r"layer 2 \(cat\): needs a C x H x W input, gets \(4,\), \(4,\)",
        ),
    ],
)
def test_inputs_of_other_shapes_are_refused_naming_the_layer_and_the_shapes(spec, words):
    with pytest.raises(ValueError, match=words):
        Model(spec, SMALL_INPUT)


def test_add_and_concat_need_two_or_more_named_inputs():
    spec = [{"type": "conv", "name": "c", "out": 2}, {"type": "add"}, {"type": "fc", "out": 2}]
    with pytest.raises(ValueError, match=r"layer 1 \(add 'add1'\): add reads 2 or more layers"):
        check_spec(spec)
    spec[1] = {"type": "concat", "inputs": ["c"]}
    with pytest.raises(ValueError, match=r"reads 1 input \('c'\); concat takes 2 or more"):
        check_spec(spec)


def test_the_layers_refuse_arrays_of_other_shapes_naming_themselves():
    a, b = np.zeros((2, 3, 4, 4), np.float32), np.zeros((2, 3, 4, 5), np.float32)
    with pytest.raises(ValueError, match=r"join: add takes 2 inputs of one shape"):
        Add("join", 2).forward(a, b)
    with pytest.raises(ValueError, match=r"cat: concat takes 2 inputs"):
        Concat("cat", 2).forward(a, b)
    np.testing.assert_array_equal(Concat("cat", 2).forward(a, a[:, :1]).shape, (2, 4, 4, 4))


def test_the_small_network_walks_and_runs_as_its_graph_says():
    walked = {item.name: item for item in walk_spec(SMALL, SMALL_INPUT)}
    assert walked["res"].input_shapes == ((4, 8, 8), (4, 8, 8))
    assert walked["cat"].input_shapes == ((6, 4, 4), (4, 4, 4), (6, 4, 4))
    assert walked["cat"].output_shape == (16, 4, 4)
    assert walked["sum3"].inputs == ("mix", "catrelu", "cat")
    model = Model(SMALL, SMALL_INPUT, seed=1)
    assert [type(model.layers[i]).__name__ for i in (5, 10, 13)] == ["Add", "Concat", "Add"]
    assert model.layers[13].arity == 3 and model.layers[10].arity == 3
    seconds = model.other_seconds(batch=3, repeats=1)
    assert {"res", "cat", "sum3", "pool", "gap", "fc"} <= set(seconds)
    assert all(s > 0 for s in seconds.values())


# -------------------------------------------------------------------------- conv's bias


def test_a_conv_without_bias_has_no_bias_anywhere(tmp_path):
    onnx = pytest.importorskip("onnx", reason="the onnx extra builds the graph")
    from hetconv.onnx_export import build_onnx

    model = Model(SMALL, SMALL_INPUT, seed=2)
    state = model.state()
    assert "stem.weight" in state and "stem.bias" not in state and "a1.bias" not in state
    assert "down.bias" in state and "proj.bias" in state  # the default: a bias
    stem = model.layers[0]
    assert isinstance(stem, Conv2d) and set(stem.params) == {"weight"}
    np.testing.assert_array_equal(stem.bias, np.zeros(4, np.float32))
    x = np.random.default_rng(0).standard_normal((2, *SMALL_INPUT), dtype=np.float32)
    optimizer = SGD(model.parameters(), SGDConfig(lr=0.1))
    for _ in range(2):
        loss, grad, _ = softmax_cross_entropy(model.forward(x), np.array([0, 3]))
        model.backward(grad)
        assert set(model.gradients()) == set(model.parameters())
        optimizer.step(model.gradients())
    assert "stem.bias" not in optimizer.state()
    np.testing.assert_array_equal(stem.bias, 0)  # executors' zeros, never trained
    model.save(tmp_path / "w.npz")
    with np.load(tmp_path / "w.npz") as saved:
        assert "stem.bias" not in saved.files
    again = Model(SMALL, SMALL_INPUT, seed=9)
    again.load(tmp_path / "w.npz")
    np.testing.assert_array_equal(again.forward(x), model.forward(x))
    convs = {n.name: list(n.input) for n in build_onnx(SMALL, state, SMALL_INPUT).graph.node}
    assert convs["stem"] == ["input", "stem.weight"]
    assert convs["down"][1:] == ["down.weight", "down.bias"]
    assert onnx is not None


def test_the_bias_option_takes_true_or_false_only():
    with pytest.raises(ValueError, match=r"layer 0 \(conv\): bias is 0; expected true or false"):
        check_spec([{"type": "conv", "out": 2, "bias": 0}])


# ----------------------------------------------------------------- residual graphs' convs


def test_resnet20_walks_as_he_et_al_describe_it():
    walked = {item.name: item for item in walk_spec(PRESETS["resnet20"])}
    assert sum(item.kind == "conv" for item in walked.values()) == 21  # 19 + 2 projections
    assert walked["conv1"].output_shape == (16, 32, 32)
    assert walked["s2b0_conv1"].output_shape == (32, 16, 16)
    assert walked["s3b0_sc"].conv.kernel_size == (1, 1)
    assert walked["s3b0_sc"].conv.stride == (2, 2) and walked["s3b0_sc"].conv.padding == 0
    assert walked["s3b0_add"].input_shapes == ((64, 8, 8), (64, 8, 8))
    assert walked["s1b1_add"].inputs == ("s1b1_bn2", "s1b0_out")
    assert walked["gap"].output_shape == (64, 1, 1) and walked["fc"].output_shape == (10,)
    assert "s1b0_sc" not in walked  # 16 -> 16 at stride 1: the identity shortcut
    model = Model(PRESETS["resnet20"])
    params = sum(p.size for p in model.parameters().values())
    assert 0.27e6 < params < 0.28e6  # He et al.: 0.27M
    assert not any(name.endswith("conv1.bias") for name in model.parameters())


def test_conv_specs_follow_the_residual_graph():
    specs = {spec.name: spec for spec in Model(PRESETS["resnet20"]).conv_specs()}
    kinds = {name: [op.kind for op in s.stage.ops] for name, s in specs.items() if s.stage}
    assert kinds["conv1"] == ["batchnorm", "relu"]  # its relu feeds a block and its add
    assert specs["conv1"].feeds is None
    assert kinds["s1b0_conv1"] == ["batchnorm", "relu"] and specs["s1b0_conv1"].feeds == (
        "s1b0_conv2"
    )
    assert kinds["s1b0_conv2"] == ["batchnorm"]  # the add reads two tensors: not in the stage
    assert kinds["s2b0_sc"] == ["batchnorm"] and specs["s2b0_sc"].feeds is None
    assert all(s.head is None for s in specs.values())  # the last stage ends before the add
    assert [n for n, s in specs.items() if not s.need_input_grad] == ["conv1"]
    vgg = Model(PRESETS["vgg11"]).conv_specs()
    assert vgg[-1].head == ("fc", 10)
    assert [s.feeds for s in vgg[:-1]] == [f"conv{i}" for i in range(2, 9)]  # a chain
    small = {spec.name: spec for spec in Model(SMALL, SMALL_INPUT).conv_specs()}
    assert not small["stem"].need_input_grad and small["down"].need_input_grad
    assert small["down"].stage is None and small["proj"].stage is None


def test_a_1x1_stride_2_projection_matches_torch(rng):
    torch = pytest.importorskip("torch", reason="PyTorch is the reference; install the dev extra")
    conv = Conv2d("sc", 3, 5, 1, 0, stride=2, bias=False)
    conv.input_shape = (3, 7, 7)
    conv.params["weight"][...] = rng.standard_normal((5, 3, 1, 1)).astype(np.float32)
    x = rng.standard_normal((2, 3, 7, 7)).astype(np.float32)
    y = conv.forward(x)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx = conv.backward(dy)
    tx = torch.from_numpy(x).requires_grad_(True)
    tw = torch.from_numpy(conv.params["weight"].copy()).requires_grad_(True)
    ty = torch.nn.functional.conv2d(tx, tw, None, stride=2)
    ty.backward(torch.from_numpy(dy))
    assert y.shape == (2, 5, 4, 4) == tuple(ty.shape)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(conv.grads["weight"], tw.grad.numpy(), rtol=1e-4, atol=1e-4)
    assert set(conv.grads) == {"weight"}


# --------------------------------------------------------------------------------- PyTorch


def _spec_net():
    torch = pytest.importorskip("torch", reason="PyTorch is the reference; install the dev extra")
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from ddp_rank import SpecNet
    finally:
        sys.path.remove(str(BENCHMARKS))
    return torch, SpecNet


def _close(ours, theirs, what, rtol):
    theirs = theirs.detach().numpy() if hasattr(theirs, "detach") else np.asarray(theirs)
    scale = max(float(np.abs(theirs).max()), 1e-3)
    err = float(np.abs(np.asarray(ours, np.float64) - theirs).max())
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol} * {scale:.3g}"


class _ReluMasks:
    """Records, while active, which inputs of each of our ReLUs are positive, in call order."""

    def __enter__(self):
        self.masks, self._forward = [], ReLU.forward
        masks, forward = self.masks, self._forward
        ReLU.forward = lambda relu, x: masks.append(x > 0) or forward(relu, x)
        return self

    def __exit__(self, *exc):
        ReLU.forward = self._forward


class _TwinMasks:
    """Hooks that make each of the torch twin's ReLUs, in call order, take the mask our model's
    ReLU took in the same place (:class:`_ReluMasks`): a ReLU input within round-off of zero
    can fall on the other side in torch's float32 run, its unit's gradient then on in one run
    and off in the other, and a kernel gradient moves by 5 % (resnet20 at batch 2); with our
    masks both runs take the same branch, and the rest is held to round-off. ``flipped``
    counts the inputs whose side differed."""

    def __init__(self, torch, net):
        self.ours: list | None = None  # None: the twin's own masks
        self.at = self.flipped = 0
        for module in net.modules():
            if isinstance(module, torch.nn.ReLU):
                module.register_forward_hook(self._hook(torch))

    def start(self, ours: list | None) -> None:
        self.ours, self.at, self.flipped = ours, 0, 0

    def _hook(self, torch):
        def hook(module, inputs, out):
            if self.ours is None:
                return out
            assert self.at < len(self.ours), "the twin runs more ReLUs than ours"
            mask = self.ours[self.at]
            self.at += 1
            self.flipped += int(((inputs[0] > 0).numpy() != mask).sum())
            return inputs[0] * torch.from_numpy(mask)

        return hook


def _against_torch(spec, input_shape, batch, steps, rtol=1e-4):
    """``steps`` SGD steps (momentum, weight decay) of our model and the torch twin: logits,
    loss and every gradient at each step, then the parameters and running statistics after
    it; then logits in evaluation mode. Each step starts the twin from our weights, running
    statistics and momentum buffers: two float32 runs part for good where a ReLU input lies
    within round-off of zero (over a few steps at batch 2, a gradient 1% apart), so the twin's
    ReLUs take our masks (:class:`_TwinMasks`)."""
    torch, SpecNet = _spec_net()
    torch.manual_seed(0)
    model = Model(spec, input_shape, seed=3)
    rng = np.random.default_rng(7)
    for name, p in model.parameters().items():  # batch norm away from 1 and 0: checks bite
        if ".weight" in name and p.ndim == 1:
            p[...] = rng.uniform(0.5, 1.5, p.shape)
        elif p.ndim == 1:
            p[...] = rng.standard_normal(p.shape) * 0.1
    net = SpecNet(spec, input_shape)
    optimizer = SGD(model.parameters(), SGDConfig(lr=0.05, momentum=0.9, weight_decay=5e-4))
    theirs = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    named = dict(net.named_parameters())
    assert set(named) == set(model.parameters())
    twin = _TwinMasks(torch, net)
    classes = model.output_shape[0]
    net.train()
    for step in range(steps):
        net.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in model.state().items()})
        for name, buf in optimizer.momentum_buffers.items():
            theirs.state[named[name]]["momentum_buffer"] = torch.from_numpy(buf.copy())
        x = rng.standard_normal((batch, *input_shape), dtype=np.float32)
        labels = rng.integers(0, classes, batch)
        with _ReluMasks() as ours:
            logits = model.forward(x)
        loss, grad, _ = softmax_cross_entropy(logits, labels)
        model.backward(grad)
        theirs.zero_grad()
        twin.start(ours.masks)
        t_logits = net(torch.from_numpy(x))
        t_loss = torch.nn.functional.cross_entropy(t_logits, torch.from_numpy(labels))
        t_loss.backward()
        _close(logits, t_logits, f"step {step} logits", rtol)
        assert loss == pytest.approx(t_loss.item(), rel=rtol)
        assert twin.at == len(ours.masks), "the twin runs its ReLUs as ours"
        for name, g in model.gradients().items():
            _close(g, named[name].grad, f"step {step} d{name}", rtol)
        optimizer.step(model.gradients())
        theirs.step()
        state = net.state_dict()
        for name, value in model.state().items():
            _close(value, state[name], f"{name} after step {step}", rtol)
    x = rng.standard_normal((batch, *input_shape), dtype=np.float32)
    twin.start(None)
    net.eval()
    with model.evaluating():
        _close(model.forward(x), net(torch.from_numpy(x)), "eval logits", rtol)


def test_the_small_residual_and_concat_network_trains_as_torch():
    _against_torch(SMALL, SMALL_INPUT, batch=4, steps=3)


@pytest.mark.parametrize(
    "preset", ["resnet20", "vgg11", pytest.param("resnet18", marks=pytest.mark.slow)]
)
def test_each_preset_trains_as_torch(preset):
    _against_torch(PRESETS[preset], (3, 32, 32), batch=2, steps=3)


def test_the_presets_end_in_the_datasets_class_count():
    for preset in ("resnet20", "resnet18", "vgg11"):
        spec = load_spec(preset, classes=7)
        assert spec[-1] == {"type": "fc", "name": "fc", "out": 7}
        assert PRESETS[preset][-1]["out"] == 10


# ------------------------------------------------------------------------------------ ONNX


@pytest.mark.parametrize("preset", ["resnet20", "resnet18", "vgg11"])
def test_each_preset_exported_runs_in_onnxruntime_with_our_logits(preset, tmp_path):
    pytest.importorskip("onnx", reason="the onnx extra builds the graph")
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime runs the graph")
    from hetconv.onnx_export import export_onnx

    spec = PRESETS[preset]
    model = Model(spec, seed=4)
    rng = np.random.default_rng(5)
    for name, value in model.state().items():  # running statistics as training leaves them
        if name.endswith("running_var"):
            value[...] = rng.uniform(0.5, 2.0, value.shape)
        elif name.endswith("running_mean") or (value.ndim == 1 and "fc" not in name):
            value[...] = rng.standard_normal(value.shape) * 0.3 + name.endswith("weight")
    model.save(tmp_path / "model.npz")  # what `hetconv export` reads
    with np.load(tmp_path / "model.npz") as data:
        weights = {k: data[k] for k in data.files}
    export_onnx(spec, weights, (3, 32, 32), tmp_path / "model.onnx")
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((2, 3, 32, 32), dtype=np.float32)
    (got,) = session.run(["logits"], {"input": x})
    with model.evaluating():
        want = model.forward(x)
    assert np.abs(want).max() > 0.05
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
