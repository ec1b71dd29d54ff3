"""The model spec: strict checking (every layer type, every key), presets that follow the
dataset's class count, the README's table of the spec, and the newer layers (stride, batch
norm, dropout, average and global average pooling) in a whole model against PyTorch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetconv.layers import softmax_cross_entropy
from hetconv.model import LAYER_OPTIONS, LAYER_TYPES, PRESETS, Model, load_spec, walk_spec

INPUT = (3, 12, 12)
# Every layer type, a strided convolution, a pool after batch norm, a global pool before fc.
MODERN = [
    {"type": "conv", "name": "conv1", "out": 6, "kernel": 3, "padding": 1, "stride": 2},
    {"type": "batchnorm", "name": "bn1"},
    {"type": "relu"},
    {"type": "conv", "name": "conv2", "out": 8, "kernel": [3, 2], "padding": "same"},
    {"type": "relu"},
    {"type": "lrn", "size": 3, "alpha": 0.5},
    {"type": "avgpool", "kernel": 2},
    {"type": "batchnorm", "name": "bn2", "eps": 1e-3, "momentum": 0.2},
    {"type": "maxpool", "kernel": 2, "stride": 1},
    {"type": "conv", "name": "conv3", "out": 5, "kernel": 1, "stride": [1, 2]},
    {"type": "gap"},
    {"type": "dropout", "p": 0.3},
    {"type": "fc", "name": "fc", "out": 4},
]


# ------------------------------------------------------------------------------ strictness


@pytest.mark.parametrize(
    "entry, words",
    [
        (
            {"type": "conv", "name": "c1", "out": 4, "strides": 2},
            ["layer 0", "conv", "'c1'", "unknown key 'strides'", "stride (int >= 1 or [sh, sw]"],
        ),
        (
            {"type": "fc", "out": 4, "activation": "relu"},
            ["layer 0", "unknown key 'activation'", "fc accepts", "out (int >= 1"],
        ),
        ({"type": "softmax"}, ["layer 0", "'softmax'", "accepted types", "batchnorm", "gap"]),
        ({"out": 4}, ["layer 0", "type None", "accepted types"]),
        ({"type": "conv", "kernel": 3}, ["layer 0", "missing key 'out'", "conv accepts"]),
        ({"type": "fc"}, ["missing key 'out'"]),
        ({"type": "conv", "out": "8"}, ["layer 0", "out is '8'", "expected int >= 1"]),
        ({"type": "conv", "out": 8.0}, ["out is 8.0", "int >= 1"]),
        ({"type": "conv", "out": True}, ["out is True"]),
        ({"type": "conv", "out": 8, "stride": 0}, ["stride is 0", "int >= 1 or [sh, sw]"]),
        ({"type": "conv", "out": 8, "stride": [2, 2, 2]}, ["stride is [2, 2, 2]"]),
        ({"type": "conv", "out": 8, "kernel": 2.5}, ["kernel is 2.5"]),
        ({"type": "conv", "out": 8, "padding": "full"}, ["padding is 'full'", '"same"']),
        ({"type": "conv", "out": 8, "padding": -1}, ["padding is -1"]),
        ({"type": "maxpool", "kernel": 0}, ["kernel is 0", "int >= 1"]),
        ({"type": "avgpool", "stride": "2"}, ["stride is '2'"]),
        ({"type": "lrn", "size": 0}, ["size is 0"]),
        ({"type": "lrn", "alpha": float("nan")}, ["alpha is nan", "finite number"]),
        ({"type": "batchnorm", "eps": 0}, ["eps is 0", "number > 0"]),
        ({"type": "batchnorm", "momentum": 2}, ["momentum is 2", "number in [0, 1]"]),
        ({"type": "dropout", "p": 1.0}, ["p is 1.0", "number in [0, 1)"]),
        ({"type": "dropout", "rate": 0.5}, ["unknown key 'rate'", "p (number in [0, 1)"]),
        ({"type": "relu", "inplace": True, 3: 1}, ["unknown keys 'inplace', 3", "relu accepts"]),
        ({"type": "gap", "kernel": 2}, ["unknown key 'kernel'", "gap accepts type, name"]),
        ({"type": "relu", "name": ""}, ["name '' must be a non-empty string"]),
        ({"type": "relu", "name": "a.b"}, ["without dots"]),
        ("relu", ["layer 0 is 'relu'", "not an object"]),
    ],
)
def test_every_bad_entry_is_refused_naming_layer_key_and_what_is_accepted(entry, words):
    with pytest.raises(ValueError) as info:
        Model([entry], INPUT)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_the_error_names_the_right_layer_in_a_longer_spec():
    spec = [dict(e) for e in MODERN]
    spec[7] = {**spec[7], "epsilon": 1e-3}
    with pytest.raises(ValueError, match=r"layer 7 \(batchnorm 'bn2'\): unknown key 'epsilon'"):
        Model(spec, INPUT)


def test_layers_that_need_maps_refuse_a_flat_input():
    for kind in ("batchnorm", "avgpool", "gap", "lrn", "maxpool"):
        with pytest.raises(ValueError, match=rf"layer 1 \({kind}1\): needs a C x H x W input"):
            Model([{"type": "fc", "out": 4}, {"type": kind}], INPUT)
    Model([{"type": "fc", "out": 4}, {"type": "relu"}, {"type": "dropout"}], INPUT)


def test_names_must_be_unique():
    spec = [{"type": "conv", "name": "c", "out": 2}, {"type": "conv", "name": "c", "out": 2}]
    with pytest.raises(ValueError, match="layer 1 .* named 'c', as layer 0 is: names must be"):
        Model(spec, INPUT)


def test_a_spec_that_is_not_a_list_is_refused():
    for bad in ({"type": "relu"}, "relu"):
        with pytest.raises(ValueError, match="a model spec is a list of layer objects"):
            list(walk_spec(bad, INPUT))


def test_a_json_file_with_an_unknown_key_is_refused_when_read(tmp_path, capsys):
    """Before any data is read or shape known, naming the file, the layer and the key."""
    from hetconv.cli import main

    path = tmp_path / "net.json"
    path.write_text(json.dumps([{"type": "conv", "out": 4, "stride": 2, "dilation": 2}]))
    with pytest.raises(ValueError, match=r"net.json: layer 0 \(conv\): unknown key 'dilation'"):
        load_spec(str(path))
    assert main(["train", "--local", "--no-progress", "--steps", "1", "--preset", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"hetconv train: error: model spec {path}: layer 0 (conv): unknown key 'dilation'" in err


def test_defaults_are_filled_in():
    layers = {item.name: item for item in walk_spec(MODERN, INPUT)}
    assert layers["conv1"].options == {
        "out": 6, "kernel": 3, "padding": 1, "stride": 2, "bias": True
    }  # fmt: skip
    assert layers["avgpool1"].options == {"kernel": 2, "stride": 2}
    assert layers["bn1"].options == {"eps": 1e-5, "momentum": 0.1}
    assert layers["dropout1"].options == {"p": 0.3}
    assert layers["conv2"].options["kernel"] == (3, 2)


# ------------------------------------------------------------------------ shapes and stages


def test_shapes_of_the_new_layers():
    shapes = {item.name: item.output_shape for item in walk_spec(MODERN, INPUT)}
    assert shapes["conv1"] == (6, 6, 6)  # floor((12 + 2 - 3) / 2) + 1
    assert shapes["avgpool1"] == (8, 3, 3)
    assert shapes["maxpool1"] == (8, 2, 2)
    assert shapes["conv3"] == (5, 2, 1)
    assert shapes["gap1"] == (5, 1, 1)
    assert shapes["fc"] == (4,)
    model = Model(MODERN, INPUT)
    assert model.forward(np.zeros((2, *INPUT), np.float32)).shape == (2, 4)


def test_stages_take_batchnorm_and_end_at_dropout():
    convs = {item.name: item.conv for item in walk_spec(MODERN, INPUT) if item.conv}
    assert convs["conv1"].stride == (2, 2)
    assert [op.kind for op in convs["conv1"].stage.ops] == ["batchnorm", "relu"]
    assert [op.kind for op in convs["conv2"].stage.ops] == [
        "relu", "lrn", "avgpool", "batchnorm", "maxpool"
    ]  # fmt: skip
    bn2 = convs["conv2"].stage.ops[3]
    assert (bn2.eps, bn2.momentum) == (1e-3, 0.2)
    assert convs["conv3"].stride == (1, 2) and [op.kind for op in convs["conv3"].stage.ops] == [
        "gap"
    ]
    spec = [{"type": "conv", "out": 2}, {"type": "gap"}, {"type": "dropout"}, {"type": "relu"}]
    conv = next(walk_spec(spec, INPUT)).conv
    assert [op.kind for op in conv.stage.ops] == ["gap"]
    assert conv.stage.output_hw((10, 10)) == (1, 1)


@pytest.mark.parametrize(
    "chain",
    [
        [{"type": "relu"}, {"type": "avgpool", "kernel": 3, "stride": 2}],
        [{"type": "lrn", "size": 5, "alpha": 1.0}, {"type": "avgpool"}, {"type": "relu"}],
        [{"type": "relu"}, {"type": "lrn", "size": 3, "alpha": 1.0}, {"type": "gap"}],
    ],
    ids=["relu-avgpool", "lrn-avgpool-relu", "relu-lrn-gap"],
)
def test_stage_slices_with_the_new_pools_equal_the_whole_layers(chain):
    """Each node's stage on its (halo-widened) slice, reassembled, is the whole layer chain."""
    from hetconv.backends import get_backend
    from hetconv.stages import StageSpec, ops_to_proto, spec_from_proto, stage_backward
    from hetconv.stages import stage_forward as run_stage

    backend, rng = get_backend("cpu"), np.random.default_rng(5)
    x = rng.standard_normal((3, 4, 9, 9), dtype=np.float32)
    w = rng.standard_normal((11, 4, 3, 3), dtype=np.float32) * 0.3
    b = rng.standard_normal(11, dtype=np.float32) * 0.1
    spec = StageSpec.from_entries(chain)
    assert spec_from_proto(ops_to_proto(spec)) == spec  # as the wire carries it
    layers = spec.build("whole")
    a = backend.conv_forward(x, w, b, 1)
    for layer in layers:
        a = layer.forward(a)
    dy = rng.standard_normal(a.shape, dtype=np.float32)
    assert a.shape[2:] == spec.output_hw((9, 9))
    g = dy
    for layer in reversed(layers):
        g = layer.backward(g)
    want = (
        a,
        backend.conv_grad_input(g, w, (9, 9), 1),
        *backend.conv_grad_kernels(x, g, (3, 3), 1),
    )
    ys, dws, dbs, dx = [], [], [], np.zeros_like(x)
    for own in (slice(0, 4), slice(4, 5), slice(5, 11)):
        wide, grad = spec.widened(own, 11), spec.grad_range(own, 11)
        rel = slice(own.start - wide.start, own.stop - wide.start)
        y, saved = run_stage(backend, x, w[wide], b[wide], 1, spec, rel)
        rel_grad = slice(grad.start - wide.start, grad.stop - wide.start)
        part, dw, db = stage_backward(backend, saved, dy[:, grad], rel_grad, True)
        ys.append(y)
        dws.append(dw)
        dbs.append(db)
        dx += part
    got = (np.concatenate(ys, 1), dx, np.concatenate(dws), np.concatenate(dbs))
    for name, g, e in zip(("y", "dx", "dw", "db"), got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5, err_msg=name)


def test_the_cost_model_reads_what_the_executors_compute():
    """Strided convolutions reach executors, the cost model and the wire as the stride-1
    convolution of their phases: conv1 (3 channels, 3x3, stride 2, pad 1, 12x12) is 12 phase
    channels of 7x7 with 2x2 kernels, no padding, giving the strided 6x6."""
    from hetconv.workload import ConvLayer, conv_layers

    specs = Model(MODERN, INPUT).conv_specs()
    assert conv_layers(MODERN, batch=5, input_shape=INPUT) == [
        ConvLayer(s.name, s.shape(5), s.need_input_grad) for s in specs
    ]
    conv1 = specs[0]
    assert (conv1.input_shape, conv1.kernel_size, conv1.padding) == ((12, 7, 7), (2, 2), 0)
    assert conv1.output_shape == (6, 6, 6) and conv1.stride == (1, 1)
    assert specs[1].stride == (1, 1) and specs[1].padding == "same"  # stride 1: as written
    # FLOPs: 12 x 2 x 2 = 48 terms per output where a strided kernel has 3 x 3 x 3 = 27
    assert conv1.shape(1).flops_forward == 2 * 6 * 6 * 6 * 48


# ------------------------------------------------------------------ presets and class counts


@pytest.mark.parametrize("classes", [2, 10, 100])
def test_a_preset_ends_in_the_datasets_class_count(classes):
    spec = load_spec("tiny", classes=classes)
    assert spec[-1] == {"type": "fc", "name": "fc", "out": classes}
    assert Model(spec).output_shape == (classes,)
    assert PRESETS["tiny"][-1]["out"] == 10  # the preset itself is untouched
    assert load_spec("tiny") == PRESETS["tiny"]


@pytest.mark.parametrize("classes", [0, -1, 2.5, "10", True])
def test_a_bad_class_count_is_refused(classes):
    with pytest.raises(ValueError, match="classes must be an int >= 1"):
        load_spec("tiny", classes=classes)


def test_a_spec_files_own_outputs_are_kept(tmp_path):
    path = tmp_path / "net.json"
    path.write_text(json.dumps([{"type": "fc", "out": 7}]))
    assert load_spec(str(path), classes=3) == [{"type": "fc", "out": 7}]


@settings(max_examples=150, deadline=None)
@given(
    entries=st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from([*LAYER_TYPES, "pool", 3])},
            optional={
                key: st.one_of(
                    st.integers(-1, 6), st.floats(-1, 2), st.just(float("nan")),
                    st.text(max_size=4), st.lists(st.integers(0, 3), max_size=4), st.none(),
                    st.booleans(),
                )
                for key in ("out", "kernel", "stride", "padding", "p", "eps", "momentum",
                            "size", "alpha", "name", "units")
            },
        ),
        max_size=5,
    )
)  # fmt: skip
def test_any_spec_is_built_or_refused_naming_a_layer(entries):
    """Generated specs: a model comes out, or a ValueError that names a layer by index; never
    another exception."""
    try:
        model = Model(entries, (2, 6, 6))
    except ValueError as e:
        assert re.search(r"layer \d+", str(e)), str(e)
    else:
        out = model.forward(np.ones((2, 2, 6, 6), np.float32))
        assert out.shape == (2, *model.output_shape)


# -------------------------------------------------------------------- modes and weight files


def test_eval_mode_uses_running_statistics_and_no_dropout():
    model = Model(MODERN, INPUT, seed=1)
    x = np.random.default_rng(0).standard_normal((6, *INPUT), dtype=np.float32)
    assert model.training
    first, second = model.forward(x), model.forward(x)
    assert not np.array_equal(first, second)  # new dropout masks, moved statistics
    with model.evaluating():
        assert not model.training
        a, b = model.forward(x), model.forward(x)
    np.testing.assert_array_equal(a, b)
    assert model.training
    assert model.buffers()["bn1.num_batches_tracked"] == 2
    model.eval()
    np.testing.assert_array_equal(model.forward(x), a)
    model.train()
    assert model.training


def test_weight_files_hold_parameters_and_buffers(tmp_path):
    model = Model(MODERN, INPUT, seed=2)
    model.forward(np.ones((3, *INPUT), np.float32))
    path = tmp_path / "w.npz"
    model.save(path)
    saved = np.load(path)
    assert list(saved.files) == list(model.state())
    assert "bn2.running_var" in saved.files and saved["bn1.num_batches_tracked"] == 1
    assert "bn1.running_mean" not in model.parameters()  # buffers are not trained
    other = Model(MODERN, INPUT, seed=3)
    other.load(path)
    for name, value in model.state().items():
        np.testing.assert_array_equal(other.state()[name], value, err_msg=name)
    del_one = {k: v for k, v in model.state().items() if k != "bn2.running_mean"}
    with pytest.raises(ValueError, match=r"missing \['bn2.running_mean'\]"):
        other.load_state(del_one)


def test_batchnorm_starts_as_pytorch_does():
    state = Model(MODERN, INPUT, seed=5).state()
    np.testing.assert_array_equal(state["bn1.weight"], np.ones(6, np.float32))
    np.testing.assert_array_equal(state["bn1.bias"], np.zeros(6, np.float32))
    np.testing.assert_array_equal(state["bn2.running_var"], np.ones(8, np.float32))
    assert state["bn2.num_batches_tracked"].dtype == np.int64


# ----------------------------------------------------------------------------- the README


def test_the_readme_documents_every_layer_type_and_key():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Your own model") :]
    section = section[: section.index("\n## ", 1)]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \|([^\n]*)$", section, re.M)}
    assert set(rows) == set(LAYER_TYPES)
    for kind, options in LAYER_OPTIONS.items():
        for key in options:
            assert f"`{key}`" in rows[kind], (kind, key)
    example = re.search(r"```json\n(.*?)```", section, re.S).group(1)
    Model(json.loads(example), (3, 32, 32))


# ------------------------------------------------------------------------------- PyTorch

torch = pytest.importorskip(
    "torch", reason="PyTorch is the reference implementation; install the dev extra"
)


class _Join(torch.nn.Module):
    """``add`` (the inputs' sum, in order) or ``concat`` (along channels)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, *xs):
        return torch.cat(xs, 1) if self.kind == "concat" else sum(xs[1:], xs[0])


def torch_twin(spec, input_shape):
    """The spec as a torch module with our layer names (so state dicts are the same), each
    layer reading the inputs the spec names."""
    nn = torch.nn
    net = nn.Module()
    order = []
    for item in walk_spec(spec, input_shape):
        o, kind = item.options, item.kind
        if kind == "conv":
            c = item.conv
            pad = c.padding if c.padding == "same" else o["padding"]
            module = nn.Conv2d(
                c.input_shape[0], c.kernels, c.kernel_size, c.stride, pad, bias=o["bias"]
            )
        elif kind == "batchnorm":
            module = nn.BatchNorm2d(item.input_shape[0], o["eps"], o["momentum"])
        elif kind == "relu":
            module = nn.ReLU()
        elif kind == "lrn":
            module = nn.LocalResponseNorm(o["size"], o["alpha"], o["beta"], o["k"])
        elif kind == "maxpool":
            module = nn.MaxPool2d(o["kernel"], o["stride"])
        elif kind == "avgpool":
            module = nn.AvgPool2d(o["kernel"], o["stride"])
        elif kind == "gap":
            module = nn.AdaptiveAvgPool2d(1)
        elif kind == "dropout":
            module = nn.Dropout(o["p"])
        elif kind in ("add", "concat"):
            module = _Join(kind)
        else:
            module = nn.Sequential(
                nn.Flatten(), nn.Linear(int(np.prod(item.input_shape)), o["out"])
            )
            item = item.__class__(**{**item.__dict__, "name": item.name + "_"})
        net.add_module(item.name, module)
        order.append((item.name, module, item.inputs or ("",)))

    def forward(x):
        values = {"": x}
        for name, module, sources in order:
            x = values[name] = module(*(values[source] for source in sources))
        return x

    net.forward = forward
    return net


def _load_into(net, model):
    state = {}
    for k, v in model.state().items():
        head, _, tail = k.partition(".")
        if head == "fc":  # the twin's fc sits behind a Flatten
            k = f"fc_.1.{tail}"
        state[k] = torch.from_numpy(np.array(v))
    net.load_state_dict(state, strict=True)


def _close(ours, theirs, what, rtol=1e-4, floor=1e-30):
    """|ours - theirs| within rtol of theirs' largest magnitude (or of ``floor``, for a
    tensor that is zero up to round-off, as a conv bias's gradient before batch norm is)."""
    theirs = theirs.detach().numpy() if torch.is_tensor(theirs) else np.asarray(theirs)
    scale = max(float(np.abs(theirs).max()), floor)
    err = float(np.abs(np.asarray(ours, np.float64) - theirs).max())
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol} * {scale:.3g}"


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
def test_a_model_with_every_new_layer_matches_torch_in_training_and_eval():
    spec = [e for e in MODERN if e["type"] != "dropout"]  # masks cannot match; eval below
    model = Model(spec, INPUT, seed=4)
    rng = np.random.default_rng(1)
    for p in model.parameters().values():
        p[...] += rng.standard_normal(p.shape).astype(np.float32) * 0.1
    net = torch_twin(spec, INPUT)
    _load_into(net, model)
    net.train()
    for step in range(2):
        x = rng.standard_normal((5, *INPUT), dtype=np.float32)
        labels = rng.integers(0, 4, 5)
        logits = model.forward(x)
        loss, grad, _ = softmax_cross_entropy(logits, labels)
        model.backward(grad)
        net.zero_grad()
        t_logits = net(torch.from_numpy(x))
        torch.nn.functional.cross_entropy(t_logits, torch.from_numpy(labels)).backward()
        _close(logits, t_logits, f"step {step} logits")
        theirs = dict(net.named_parameters())
        for name, g in model.gradients().items():
            key = name.replace("fc.", "fc_.1.")
            _close(g, theirs[key].grad, f"step {step} d{name}", rtol=2e-4, floor=1e-3)
    buffers = dict(net.named_buffers())
    for name, value in model.buffers().items():
        _close(value, buffers[name], name)
    x = rng.standard_normal((3, *INPUT), dtype=np.float32)
    net.eval()
    with model.evaluating():
        _close(model.forward(x), net(torch.from_numpy(x)), "eval logits")


def test_a_spec_with_add_concat_and_convs_without_bias_matches_its_torch_twin():
    spec = [
        {"type": "conv", "name": "conv1", "out": 4, "padding": 1, "bias": False},
        {"type": "batchnorm", "name": "bn1"},
        {"type": "relu", "name": "r1"},
        {"type": "conv", "name": "conv2", "out": 4, "padding": 1, "stride": 2, "bias": False},
        {"type": "conv", "name": "proj", "out": 4, "kernel": 1, "stride": 2, "inputs": ["r1"]},
        {"type": "add", "name": "sum", "inputs": ["conv2", "proj"]},
        {"type": "avgpool", "name": "pool", "kernel": 2, "stride": 2, "inputs": ["r1"]},
        {"type": "concat", "name": "cat", "inputs": ["sum", "pool", "proj"]},
        {"type": "gap"},
        {"type": "fc", "name": "fc", "out": 3},
    ]
    model = Model(spec, INPUT, seed=8)
    net = torch_twin(spec, INPUT)
    _load_into(net, model)
    net.train()
    rng = np.random.default_rng(4)
    x, labels = rng.standard_normal((3, *INPUT), dtype=np.float32), np.array([0, 2, 1])
    logits = model.forward(x)
    loss, grad, _ = softmax_cross_entropy(logits, labels)
    model.backward(grad)
    t_logits = net(torch.from_numpy(x))
    torch.nn.functional.cross_entropy(t_logits, torch.from_numpy(labels)).backward()
    _close(logits, t_logits, "logits")
    theirs = dict(net.named_parameters())
    assert {name.replace("fc.", "fc_.1.") for name in model.gradients()} == set(theirs)
    for name, g in model.gradients().items():
        _close(g, theirs[name.replace("fc.", "fc_.1.")].grad, f"d{name}", rtol=2e-4, floor=1e-3)
    net.eval()
    with model.evaluating():
        _close(model.forward(x), net(torch.from_numpy(x)), "eval logits")


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
def test_dropout_in_eval_matches_torch():
    model = Model(MODERN, INPUT, seed=6)
    model.forward(np.random.default_rng(2).standard_normal((4, *INPUT), dtype=np.float32))
    net = torch_twin(MODERN, INPUT)
    _load_into(net, model)
    net.eval()
    x = np.random.default_rng(3).standard_normal((3, *INPUT), dtype=np.float32)
    with model.evaluating():
        _close(model.forward(x), net(torch.from_numpy(x)), "eval logits")


# ------------------------------------------------------- a cluster of real worker processes

CLUSTER_SPEC = [
    {"type": "conv", "name": "conv1", "out": 6, "kernel": 3, "padding": 1, "stride": 2},
    {"type": "batchnorm", "name": "bn1"},
    {"type": "relu"},
    {"type": "conv", "name": "conv2", "out": 12, "kernel": 3, "padding": "same"},
    {"type": "relu"},
    {"type": "lrn", "size": 3, "alpha": 1.0},
    {"type": "avgpool", "kernel": 2},
    {"type": "batchnorm", "name": "bn2", "momentum": 0.3},
    {"type": "dropout", "p": 0.2},
    {"type": "conv", "name": "conv3", "out": 10, "kernel": 3, "padding": 1, "stride": 2},
    {"type": "relu"},
    {"type": "gap"},
    {"type": "fc", "name": "fc", "out": 10},
]
# Kernels per node (master first): uneven, a node with none, shares below the LRN's halo.
CLUSTER_SHARES = {"conv1": (2, 3, 1), "conv2": (5, 2, 5), "conv3": (0, 7, 3)}


def _train_spec(tmp_path, name, executor, steps=8, trace=None):
    import io

    from hetconv.training import TrainConfig, train

    spec = tmp_path / "net.json"
    spec.write_text(json.dumps(CLUSTER_SPEC))
    weights = tmp_path / f"{name}.npz"
    config = TrainConfig(
        preset=str(spec), steps=steps, batch=8, train_size=32, eval_size=8, progress=False,
        save=str(weights), trace=trace,
    )  # fmt: skip
    result = train(config, executor, log=io.StringIO())
    return result, dict(np.load(weights))


def test_a_fused_cluster_with_stride_batchnorm_and_avgpool_trains_as_local(tmp_path):
    """Two worker processes, fused stages (the strided conv1 with batch norm and ReLU, conv2
    with ReLU, LRN, average pooling, batch norm and max pooling, the strided conv3 with global
    average pooling), dropout on the master: step by step the losses, and at the end every
    weight and running statistic, equal local training's."""
    from hetconv.conv import LocalConv
    from hetconv.master.cluster import Cluster, ClusterConfig
    from hetconv.master.launch import LocalWorkers

    local, local_weights = _train_spec(tmp_path, "local", LocalConv())
    fast = dict(deadline_floor=1.0, deadline_factor=5.0, retry_min=0.2, retry_max=1.0)
    config = ClusterConfig(**fast, shares=CLUSTER_SHARES, stages="fused")
    trace = tmp_path / "trace.jsonl"
    with LocalWorkers(2) as workers, Cluster(workers.addresses, config=config) as cluster:
        got, weights = _train_spec(tmp_path, "cluster", cluster, trace=str(trace))
        assert cluster.stage_modes == {"conv1": "fused", "conv2": "fused", "conv3": "fused"}
        addresses = workers.addresses
    np.testing.assert_allclose(got.losses, local.losses, rtol=1e-5)
    assert sorted(weights) == sorted(local_weights)
    assert "bn2.running_var" in weights and weights["bn1.num_batches_tracked"] == 8
    for name, value in weights.items():
        np.testing.assert_allclose(value, local_weights[name], rtol=0, atol=1e-5, err_msg=name)
    # The workers computed their shares (no silent fallback to the master).
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = [r for r in steps if "step" in r]
    assert len(steps) == 8
    for record in steps:
        assert record["stage_modes"] == {"conv1": "fused", "conv2": "fused", "conv3": "fused"}
        for layer, shares in CLUSTER_SHARES.items():
            for address, share in zip(addresses, shares[1:], strict=True):
                assert record["nodes"][address][layer]["kernels"] == share


def test_a_resumed_run_with_batchnorm_and_dropout_equals_an_unbroken_one(tmp_path):
    """Checkpoints hold batch norm's running statistics, and dropout's masks follow the step:
    5 steps, then resumed to 10, is bit for bit the 10-step run."""
    import io

    from hetconv.training import TrainConfig, train

    spec = tmp_path / "net.json"
    spec.write_text(json.dumps(CLUSTER_SPEC))
    run = dict(preset=str(spec), batch=8, train_size=32, eval_size=0, progress=False)
    whole = train(TrainConfig(steps=10, save=str(tmp_path / "whole.npz"), **run), log=io.StringIO())
    short = dict(run, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=5)
    train(TrainConfig(steps=5, **short), log=io.StringIO())
    resumed = train(
        TrainConfig(steps=10, resume=True, save=str(tmp_path / "resumed.npz"), **short),
        log=io.StringIO(),
    )
    assert resumed.losses == whole.losses
    want, got = np.load(tmp_path / "whole.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(got.files) == sorted(want.files) and "bn2.running_mean" in got.files
    for name in want.files:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# ------------------------------------------------------------------ stride on every backend


@pytest.fixture(params=["cpu", "opencl", "cuda"])
def backend_name(request):
    from hetconv.backends import BackendUnavailable, backend_class

    try:
        backend_class(request.param)
    except BackendUnavailable as e:
        pytest.skip(str(e))
    return request.param


@pytest.mark.parametrize(
    "kernel, stride, padding", [(3, 2, 1), (5, (2, 3), "same"), (1, 2, 0), (4, 3, (1, 2))]
)
def test_strided_conv_layers_on_every_backend_match_the_cpu_backend(
    backend_name, kernel, stride, padding
):
    """The phases run through each backend's own stride-1 kernels: forward and both
    gradients of a strided layer equal the cpu backend's (and so PyTorch's, above)."""
    from hetconv.backends import get_backend
    from hetconv.conv import LocalConv
    from hetconv.layers import Conv2d

    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 5, 13, 11), dtype=np.float32)
    results = []
    for name in ("cpu", backend_name):
        layer = Conv2d("conv", 5, 7, kernel, padding, LocalConv(get_backend(name)), stride)
        layer.params["weight"][...] = np.random.default_rng(1).standard_normal(
            layer.params["weight"].shape
        )
        layer.params["bias"][...] = 0.5
        y = layer.forward(x)
        dy = np.random.default_rng(2).standard_normal(y.shape).astype(np.float32)
        dx = layer.backward(dy)
        results.append((y, dx, layer.grads["weight"], layer.grads["bias"]))
    for what, got, want in zip(("y", "dx", "dw", "db"), results[1], results[0], strict=True):
        scale = float(np.abs(want).max())
        assert float(np.abs(got - want).max()) <= 2e-4 * scale, (backend_name, what)
