"""`hetconv export`: the ONNX graph of a network runs in onnxruntime and gives hetconv's logits
(evaluation mode: running statistics, no dropout), for every layer type; bad input is refused
by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra builds the graph; install the dev extra")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime runs the graph; install the dev extra")

from hetconv.cli import main  # noqa: E402
from hetconv.model import Model, load_spec, walk_spec  # noqa: E402
from hetconv.onnx_export import IR_VERSION, OPSET, build_onnx  # noqa: E402

EVERY_LAYER = [
    {"type": "conv", "name": "conv1", "out": 6, "kernel": 3, "padding": [1, 2], "stride": 2},
    {"type": "batchnorm", "name": "bn1", "eps": 1e-3},
    {"type": "relu"},
    {"type": "conv", "name": "conv2", "out": 8, "kernel": [3, 2], "padding": "same"},
    {"type": "lrn", "size": 3, "alpha": 0.3, "beta": 0.6, "k": 1.5},
    {"type": "avgpool", "kernel": 3, "stride": 2},
    {"type": "maxpool", "kernel": 2, "stride": 1},
    {"type": "conv", "name": "conv3", "out": 7, "kernel": 2, "padding": [0, 1, 1, 0]},
    {"type": "dropout", "p": 0.4},
    {"type": "gap"},
    {"type": "fc", "name": "hidden", "out": 9},
    {"type": "relu"},
    {"type": "dropout", "p": 0.5},
    {"type": "fc", "name": "fc", "out": 5},
]
INPUT = (3, 15, 14)
#: Residual and branching: a conv without bias, add of two and of three, concat, a 1x1 stride-2
#: projection.
BRANCHING = [
    {"type": "conv", "name": "conv1", "out": 4, "padding": 1, "bias": False},
    {"type": "batchnorm", "name": "bn1"},
    {"type": "relu", "name": "r1"},
    {"type": "conv", "name": "conv2", "out": 4, "padding": 1},
    {"type": "add", "name": "res", "inputs": ["conv2", "r1"]},
    {"type": "conv", "name": "proj", "out": 5, "kernel": 1, "stride": 2, "inputs": ["res"]},
    {"type": "maxpool", "name": "pool", "inputs": ["r1"]},
    {"type": "concat", "name": "cat", "inputs": ["proj", "pool"]},
    {"type": "conv", "name": "conv3", "out": 9, "kernel": 1, "bias": False},
    {"type": "add", "name": "sum3", "inputs": ["conv3", "cat", "conv3"]},
    {"type": "fc", "name": "fc", "out": 4},
]


def _trained_looking(spec, input_shape, seed=0) -> Model:
    """Random weights and batch-norm statistics that are not the initial ones."""
    model = Model(spec, input_shape, seed=seed)
    rng = np.random.default_rng(seed)
    for name, value in model.state().items():
        if name.endswith("running_var"):
            value[...] = rng.uniform(0.5, 2.0, value.shape)
        elif name.endswith("running_mean") or name.startswith("bn"):
            value[...] = rng.standard_normal(value.shape) * 0.5 + (name.endswith("weight"))
    return model


def _run(proto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"input": x})
    return logits


def _ours(model: Model, x: np.ndarray) -> np.ndarray:
    with model.evaluating():
        return model.forward(x)


@pytest.mark.parametrize(
    "spec, input_shape",
    [
        pytest.param(EVERY_LAYER, INPUT, id="every-layer"),
        pytest.param(BRANCHING, (3, 8, 8), id="add-concat-no-bias"),
        pytest.param(load_spec("tiny"), (3, 32, 32), id="tiny"),
        pytest.param(load_spec("tiny", classes=3), (1, 20, 12), id="tiny-gray-3-classes"),
    ],
)
def test_onnxruntime_gives_our_logits(spec, input_shape):
    model = _trained_looking(spec, input_shape)
    proto = build_onnx(spec, model.state(), input_shape)
    assert proto.ir_version == IR_VERSION and proto.opset_import[0].version == OPSET
    assert {i.name for i in proto.graph.initializer} == {
        k for k in model.state() if not k.endswith("num_batches_tracked")
    }  # the PyTorch names
    x = np.random.default_rng(1).standard_normal((4, *input_shape), dtype=np.float32)
    want = _ours(model, x)
    got = _run(proto, x)
    assert got.shape == want.shape == (4, *model.output_shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.abs(want).max() > 0.05  # logits that are not all near zero: the check can fail
    np.testing.assert_allclose(_run(proto, x[:1]), want[:1], rtol=1e-4, atol=1e-4)  # any N


def test_named_inputs_export_the_graph_the_default_does():
    names = [item.name for item in walk_spec(EVERY_LAYER, INPUT)]
    named = [dict(EVERY_LAYER[0])]
    named += [
        {**entry, "inputs": [before]}
        for entry, before in zip(EVERY_LAYER[1:], names[:-1], strict=True)
    ]
    state = _trained_looking(EVERY_LAYER, INPUT).state()
    default, explicit = build_onnx(EVERY_LAYER, state, INPUT), build_onnx(named, state, INPUT)
    assert default.SerializeToString() == explicit.SerializeToString()
    assert [list(n.input)[:1] for n in default.graph.node][:3] == [
        ["input"], ["conv1/output"], ["bn1/output"]
    ]  # fmt: skip


def test_the_graph_is_evaluation_mode():
    kinds = [n.op_type for n in build_onnx(EVERY_LAYER, Model(EVERY_LAYER, INPUT).state(), INPUT)
             .graph.node]  # fmt: skip
    assert "Dropout" not in kinds
    assert kinds.count("BatchNormalization") == 1 and kinds.count("Gemm") == 2
    assert kinds.count("Flatten") == 1  # the second fc's input is flat already


def test_export_command_writes_a_graph_that_runs(tmp_path, capsys):
    spec_path = tmp_path / "net.json"
    spec_path.write_text(json.dumps(EVERY_LAYER))
    model = _trained_looking(EVERY_LAYER, INPUT, seed=3)
    model.save(tmp_path / "model.npz")
    out = tmp_path / "model.onnx"
    argv = ["export", str(tmp_path / "model.npz"), "--spec", str(spec_path)]
    assert main([*argv, "--input-shape", "3,15,14", "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    proto = onnx.load(str(out))
    onnx.checker.check_model(proto)
    x = np.random.default_rng(4).standard_normal((2, *INPUT), dtype=np.float32)
    np.testing.assert_allclose(_run(proto, x), _ours(model, x), rtol=1e-4, atol=1e-4)

    preset = Model(load_spec("tiny", classes=4), (3, 16, 16), seed=2)
    preset.save(tmp_path / "tiny.npz")
    argv = ["export", str(tmp_path / "tiny.npz"), "--preset", "tiny", "--classes", "4"]
    assert main([*argv, "--input-shape", "3,16,16", "-o", str(tmp_path / "t.onnx")]) == 0
    x = np.random.default_rng(5).standard_normal((2, 3, 16, 16), dtype=np.float32)
    got = _run(onnx.load(str(tmp_path / "t.onnx")), x)
    np.testing.assert_allclose(got, _ours(preset, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--preset", "tiny", "--input-shape", "3,16,16"],
         "fc.weight has shape (4, 256), the model expects (10, 256)"),
        (["--preset", "tiny", "--input-shape", "3,8,8", "--classes", "4"], "has shape"),
        (["--spec", "{dir}/net.json", "--classes", "4", "--input-shape", "3,16,16"],
         "--classes is for a preset"),
    ],
)  # fmt: skip
def test_export_refuses_weights_that_do_not_fit(tmp_path, capsys, extra, message):
    Model(load_spec("tiny", classes=4), (3, 16, 16)).save(tmp_path / "tiny.npz")
    (tmp_path / "net.json").write_text(json.dumps(load_spec("tiny")))
    extra = [a.replace("{dir}", str(tmp_path)) for a in extra]
    argv = ["export", str(tmp_path / "tiny.npz"), *extra, "-o", str(tmp_path / "x.onnx")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.parametrize("size", [2, 4, 5])
def test_lrn_of_any_size_exports_with_pytorchs_window(size):
    """Even sizes: ONNX's LRN would centre the window one channel off, so it is built from
    elementary nodes; a strong normalisation (alpha 2) so that a shifted window shows."""
    spec = [
        {"type": "lrn", "name": "norm", "size": size, "alpha": 2.0, "beta": 0.7, "k": 1.2},
        {"type": "fc", "out": 3},
    ]
    model = _trained_looking(spec, (7, 3, 2))
    proto = build_onnx(spec, model.state(), (7, 3, 2))
    x = np.random.default_rng(size).standard_normal((4, 7, 3, 2), dtype=np.float32)
    np.testing.assert_allclose(_run(proto, x), _ours(model, x), rtol=1e-4, atol=1e-5)
    assert ("LRN" in [n.op_type for n in proto.graph.node]) == (size % 2 == 1)


def test_a_bad_input_shape_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["export", "m.npz", "--preset", "tiny", "--input-shape", "3,32", "-o", "x.onnx"])
    assert "is not C,H,W" in capsys.readouterr().err
