"""Networks from PyTorch: a model exported with ``torch.onnx.export`` is imported as a spec and
its weights that give torch's logits (evaluation mode), skips and branches included; what the
spec cannot express is refused naming the node, its operator and attribute; ``hetconv import``
and ``hetconv train --model net.onnx`` end to end; ``--model`` is one option everywhere, with
``--preset`` its other name."""

from __future__ import annotations

import io
import json
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch exports the graphs; install the dev extra")
onnx = pytest.importorskip("onnx", reason="the onnx extra reads the graph; install the dev extra")

from torch import nn  # noqa: E402

from hetconv.cli import main  # noqa: E402
from hetconv.cli.main import build_parser  # noqa: E402
from hetconv.model import Model  # noqa: E402
from hetconv.onnx_import import import_onnx, load_network  # noqa: E402


class Residual(nn.Module):
    """conv-bn-relu-conv-bn plus the block's input, relu; a strided block with a 1x1
    projection shortcut; a concat branch; GAP, flatten, dropout, linear."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.down = nn.Sequential(
            nn.Conv2d(8, 12, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(12),
            nn.ReLU(),
            nn.Conv2d(12, 12, 3, padding=1, bias=False),
            nn.BatchNorm2d(12),
        )
        self.shortcut = nn.Sequential(nn.Conv2d(8, 12, 1, stride=2, bias=False), nn.BatchNorm2d(12))
        self.branch = nn.Conv2d(12, 4, 1)
        self.pool = nn.MaxPool2d(2)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)) + y)
        y = self.relu(self.conv3(y))
        y = self.relu(self.down(y) + self.shortcut(y))
        y = torch.cat([self.pool(y), self.pool(self.branch(y))], 1)
        y = torch.flatten(self.gap(y), 1)
        return self.fc(self.drop(y))


class Chain(nn.Module):
    """Layers one after another, as in 2012: no skip, no batch norm."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 8, (3, 2), stride=(1, 2), padding=(1, 0)),
            nn.ReLU(),
            nn.AvgPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(8 * 4 * 2, 20), nn.ReLU(), nn.Dropout(0.5), nn.Linear(20, classes)
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def _seeded(module_type, seed: int = 0, **kwargs) -> nn.Module:
    """Weights from ``seed`` and batch-norm statistics that are not the initial ones."""
    torch.manual_seed(seed)
    model = module_type(**kwargs)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, nn.BatchNorm2d):
                layer.running_mean.uniform_(-0.5, 0.5)
                layer.running_var.uniform_(0.5, 2.0)
                layer.weight.uniform_(0.5, 1.5)
                layer.bias.uniform_(-0.3, 0.3)
    return model


def _export(model: nn.Module, shape, mode=None) -> bytes:
    """The graph ``torch.onnx.export`` writes (training mode keeps batch norm and dropout)."""
    mode = torch.onnx.TrainingMode.TRAINING if mode is None else mode
    model.train(mode == torch.onnx.TrainingMode.TRAINING)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (torch.zeros(2, *shape),), f, dynamo=False, training=mode,
            input_names=["input"], output_names=["logits"],
        )  # fmt: skip
    model.eval()
    return f.getvalue()


def _logits(spec, weights, shape, x: np.ndarray) -> np.ndarray:
    model = Model(spec, shape)
    model.load_state(weights)
    with model.evaluating():
        return model.forward(x)


def _torch_logits(model: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.from_numpy(x)).numpy()


def test_a_residual_network_with_a_branch_gives_torchs_logits():
    model = _seeded(Residual)
    imported = import_onnx(_export(model, (3, 16, 16)))
    kinds = [entry["type"] for entry in imported.spec]
    assert kinds.count("add") == 2 and kinds.count("concat") == 1
    assert kinds.count("batchnorm") == 5 and kinds.count("dropout") == 1
    assert imported.input_shape == (3, 16, 16)
    by_name = {entry["name"]: entry for entry in imported.spec}
    shortcut = {k: by_name["shortcut_0"][k] for k in ("out", "kernel", "stride", "bias")}
    assert shortcut == {"out": 12, "kernel": 1, "stride": 2, "bias": False}
    first_add = next(entry for entry in imported.spec if entry["type"] == "add")
    assert first_add["inputs"][0] == "bn2"
    assert by_name["bn1"]["momentum"] == 0.1 and by_name["bn1"]["eps"] == 1e-5
    assert by_name["drop"]["p"] == 0.25
    state = model.state_dict()
    np.testing.assert_array_equal(imported.weights["down_0.weight"], state["down.0.weight"])
    np.testing.assert_array_equal(imported.weights["bn2.running_var"], state["bn2.running_var"])
    x = np.random.default_rng(1).standard_normal((3, 3, 16, 16), dtype=np.float32)
    ours = _logits(imported.spec, imported.weights, imported.input_shape, x)
    np.testing.assert_allclose(ours, _torch_logits(model, x), rtol=1e-5, atol=2e-6)


class _Block(nn.Module):
    """A CIFAR ResNet's basic block, a 1x1 stride-2 projection where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet20(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16)
        blocks, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(_Block(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        y = self.layers(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


def test_a_pytorch_resnet20_imports_as_the_resnet20_preset():
    model = _seeded(ResNet20, seed=7)
    imported = import_onnx(_export(model, (3, 32, 32)))

    def convs(spec):
        keys = ("out", "kernel", "stride", "padding", "bias")
        return sorted(tuple(e.get(k) for k in keys) for e in spec if e["type"] == "conv")

    def kinds(spec):
        return sorted(entry["type"] for entry in spec)

    preset = load_network("resnet20").spec
    assert convs(imported.spec) == convs(preset)
    assert kinds(imported.spec) == kinds(preset)
    x = np.random.default_rng(7).standard_normal((2, 3, 32, 32), dtype=np.float32)
    ours = _logits(imported.spec, imported.weights, imported.input_shape, x)
    np.testing.assert_allclose(ours, _torch_logits(model, x), rtol=1e-4, atol=1e-5)


def test_a_chain_gives_torchs_logits_and_an_evaluation_export_too():
    model = _seeded(Chain, seed=2)
    x = np.random.default_rng(2).standard_normal((2, 3, 16, 16), dtype=np.float32)
    for mode in (torch.onnx.TrainingMode.TRAINING, torch.onnx.TrainingMode.EVAL):
        imported = import_onnx(_export(model, (3, 16, 16), mode))
        assert not any("inputs" in entry for entry in imported.spec)  # one after another
        ours = _logits(imported.spec, imported.weights, imported.input_shape, x)
        np.testing.assert_allclose(ours, _torch_logits(model, x), rtol=1e-5, atol=2e-6)
    conv = imported.spec[3]
    assert (conv["kernel"], conv["stride"], conv["padding"]) == ([3, 2], [1, 2], [1, 0])


def test_a_view_before_the_linear_layer_imports_with_a_fixed_or_a_dynamic_batch():
    class View(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4 * 6 * 6, 3)

        def forward(self, x):
            y = self.conv(x)
            return self.fc(y.view(y.size(0), -1))

    model = _seeded(View, seed=6)
    x = np.random.default_rng(6).standard_normal((5, 3, 8, 8), dtype=np.float32)
    for dynamic in (None, {"input": {0: "N"}}):
        f = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                model, (torch.zeros(2, 3, 8, 8),), f, dynamo=False, dynamic_axes=dynamic,
                input_names=["input"], output_names=["logits"],
            )  # fmt: skip
        imported = import_onnx(f.getvalue())
        assert [entry["type"] for entry in imported.spec] == ["conv", "fc"]
        ours = _logits(imported.spec, imported.weights, imported.input_shape, x)
        np.testing.assert_allclose(ours, _torch_logits(model, x), rtol=1e-5, atol=2e-6)


def test_an_evaluation_export_folds_batch_norm_and_keeps_the_logits():
    """torch's default export folds batch norm into the convolution before it: the logits
    stay, batch norm goes (the docs say to export with TrainingMode.PRESERVE)."""
    model = _seeded(Residual, seed=3)
    imported = import_onnx(_export(model, (3, 16, 16), torch.onnx.TrainingMode.EVAL))
    assert "batchnorm" not in [entry["type"] for entry in imported.spec]
    x = np.random.default_rng(3).standard_normal((2, 3, 16, 16), dtype=np.float32)
    ours = _logits(imported.spec, imported.weights, imported.input_shape, x)
    np.testing.assert_allclose(ours, _torch_logits(model, x), rtol=1e-4, atol=1e-5)


class _One(nn.Module):
    def __init__(self, layer: nn.Module, flat: int):
        super().__init__()
        self.layer, self.fc = layer, nn.Linear(flat, 3)

    def forward(self, x):
        return self.fc(torch.flatten(self.layer(x), 1))


class _Tanh(nn.Module):
    def forward(self, x):
        return torch.tanh(x)


@pytest.mark.parametrize(
    "layer, flat, words",
    [
        (_Tanh(), 2 * 8 * 8, ["'/layer/Tanh'", "operator Tanh"]),
        (nn.Conv2d(2, 4, 3, dilation=2), 4 * 4 * 4, ["(Conv)", "dilations = [2, 2]"]),
        (nn.Conv2d(2, 4, 3, groups=2), 4 * 6 * 6, ["'/layer/Conv'", "group = 2"]),
        (nn.MaxPool2d(3, 2, ceil_mode=True), 2 * 4 * 4, ["(MaxPool)", "ceil_mode = 1"]),
        (nn.MaxPool2d(3, 2, padding=1), 2 * 4 * 4, ["'/layer/MaxPool'", "pads = [1, 1, 1, 1]"]),
        (nn.AvgPool2d((2, 1)), 2 * 4 * 8, ["(AveragePool)", "kernel_shape = [2, 1]"]),
        (nn.LeakyReLU(), 2 * 8 * 8, ["(LeakyRelu)", "operator LeakyRelu"]),
    ],
)  # fmt: skip
def test_what_the_spec_cannot_express_is_refused_naming_the_node(layer, flat, words):
    graph = _export(_One(layer, flat), (2, 8, 8))
    with pytest.raises(ValueError) as e:
        import_onnx(graph)
    for word in words:
        assert word in str(e.value)
    assert str(e.value).startswith("the graph: node ")


def test_a_concat_not_along_channels_and_a_skip_from_the_input_are_refused():
    class Wide(nn.Module):
        def forward(self, x):
            return torch.cat([x, x], 3)

    class FromInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x):
            return self.conv(x) + x

    with pytest.raises(ValueError, match=r"node '/layer/Concat' \(Concat\): attribute axis = 3"):
        import_onnx(_export(_One(Wide(), 2 * 8 * 16), (2, 8, 8)))
    with pytest.raises(ValueError, match=r"\(Add\): reads the network's input"):
        import_onnx(_export(_One(FromInput(), 2 * 8 * 8), (2, 8, 8)))


def test_a_file_that_is_not_a_graph_is_refused(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a graph")
    with pytest.raises(ValueError, match="cannot read ONNX graph"):
        import_onnx(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_network(str(tmp_path / "none.onnx"))


def test_import_command_writes_a_spec_and_weights_that_train(tmp_path, capsys):
    model = _seeded(Residual, seed=4)
    (tmp_path / "net.onnx").write_bytes(_export(model, (3, 32, 32)))
    out = tmp_path / "net.json"
    assert main(["import", str(tmp_path / "net.onnx"), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "hetconv train --model" in printed
    spec = json.loads(out.read_text())
    with np.load(tmp_path / "net.npz") as data:
        weights = {k: data[k] for k in data.files}
    x = np.random.default_rng(4).standard_normal((2, 3, 32, 32), dtype=np.float32)
    ours = _logits(spec, weights, (3, 32, 32), x)
    np.testing.assert_allclose(ours, _torch_logits(model, x), rtol=1e-5, atol=2e-6)


def test_import_command_refuses_by_name_in_one_line(tmp_path, capsys):
    (tmp_path / "net.onnx").write_bytes(_export(_One(_Tanh(), 2 * 8 * 8), (2, 8, 8)))
    assert main(["import", str(tmp_path / "net.onnx"), "-o", str(tmp_path / "n.json")]) == 2
    err = capsys.readouterr().err
    assert "hetconv import: error:" in err and "operator Tanh" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "n.json").exists()


def test_train_starts_from_the_graphs_weights(tmp_path, capsys):
    model = _seeded(Residual, seed=5)
    graph = tmp_path / "net.onnx"
    graph.write_bytes(_export(model, (3, 32, 32)))
    saved = tmp_path / "trained.npz"
    argv = ["train", "--model", str(graph), "--local", "--steps", "2", "--batch", "4",
            "--train-size", "16", "--eval-size", "8", "--no-progress", "--no-run-dir",
            "--lr", "1e-30", "--momentum", "0", "--save", str(saved)]  # fmt: skip
    assert main(argv) == 0
    assert f"training {graph}" in capsys.readouterr().err
    with np.load(saved) as data:
        trained = {k: data[k] for k in data.files}
    state = model.state_dict()
    for ours, theirs in (("conv1.weight", "conv1.weight"), ("fc.weight", "fc.weight"),
                         ("shortcut_0.weight", "shortcut.0.weight")):  # fmt: skip
        np.testing.assert_array_equal(trained[ours], state[theirs].numpy())
    assert int(trained["bn1.num_batches_tracked"]) == 2
    back = tmp_path / "trained.onnx"  # and back to ONNX, the graph naming the network
    assert main(["export", str(saved), "--model", str(graph), "-o", str(back)]) == 0
    returned = import_onnx(back)  # evaluation mode: no dropout
    assert returned.spec == [e for e in import_onnx(graph).spec if e["type"] != "dropout"]
    for name, value in returned.weights.items():
        if not name.endswith("num_batches_tracked"):  # not in ONNX
            np.testing.assert_array_equal(value, trained[name])


def test_model_names_the_network_in_every_command_and_preset_is_its_other_name(tmp_path):
    parser = build_parser()
    commands = {
        "train": [],
        "evaluate": ["run"],
        "export": ["m.npz", "-o", "x.onnx"],
        "plan": [],
    }
    for command, rest in commands.items():
        for flag in ("--model", "--preset"):
            args = parser.parse_args([command, *rest, flag, "net.onnx"])
            assert args.preset == "net.onnx", (command, flag)
    for flag in ("--model", "--preset"):
        args = parser.parse_args(["simulate", flag, "a.onnx,paper-50-500"])
        assert args.network == ["a.onnx", "paper-50-500"]
    assert parser.parse_args(["train"]).preset == "tiny"
    assert parser.parse_args(["plan"]).preset == "tiny"  # train's default


def test_a_runs_config_keeps_the_network_under_preset(tmp_path):
    from hetconv.cli.train_config import write_run_config

    args = build_parser().parse_args(["train", "--local", "--model", "tiny"])
    write_run_config(tmp_path / "config.toml", args)
    assert 'preset = "tiny"' in (tmp_path / "config.toml").read_text()
    config = tmp_path / "config.toml"
    args = build_parser().parse_args(["train", "--config", str(config)])
    from hetconv.cli.train_config import apply_config

    apply_config(args, ["train", "--config", str(config)])
    assert args.preset == "tiny"


def test_plan_takes_an_onnx_network(tmp_path, capsys):
    graph = tmp_path / "net.onnx"
    graph.write_bytes(_export(_seeded(Chain), (3, 16, 16)))
    scenario = tmp_path / "laptops.toml"
    scenario.write_text(
        'name = "laptops"\n[network]\nkind = "wifi"\nbandwidth_mbps = 60.0\nlatency_ms = 3.0\n'
        '[sweep]\nnodes = [1, 2]\nnetworks = ["tiny"]\nbatches = [16]\n'
        '[master]\nname = "a"\ngflops = 60\n[[workers]]\nname = "b"\ngflops = 45\n'
        f'[comp]\n"{graph}" = {{ per_image_ms = 1.0 }}\n'
    )
    out = tmp_path / "plan.json"
    argv = ["plan", str(scenario), "--model", str(graph), "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert {r["kind"] for r in rows} >= {"hetconv", "one machine"}
    assert f"plan for {graph}" in capsys.readouterr().out
