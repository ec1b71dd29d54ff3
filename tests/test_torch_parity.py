"""hetconv against PyTorch, the reference implementation, on the reference network.

Tolerances (both sides compute in float32, in different orders): every comparison is
``max|ours - torch| <= RTOL * max(max|torch|, tiny)`` per tensor, i.e. relative to the tensor's
largest magnitude, with RTOL = 1e-4 for a forward/backward pass (round-off of sums of up to
~10^4 terms is ~1e-6 .. 1e-5 relative) and 2e-4 after 5 SGD steps (the updates are small, so
the parameters themselves stay within a few ulps of each other). The 5-step parameter
change (p_5 - p_0, much smaller than p) is compared at 1e-2 of its largest magnitude, which
still catches a wrong lr, momentum or weight decay. The loss is compared with rel 1e-5 (rel 1e-4
during the SGD steps).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="PyTorch is the reference implementation; install the dev extra"
)
nn = torch.nn
F = torch.nn.functional

from hetconv.conv import LocalConv  # noqa: E402
from hetconv.layers import (  # noqa: E402
    Conv2d,
    LocalResponseNorm,
    MaxPool2d,
    ReLU,
    softmax_cross_entropy,
)
from hetconv.model import CIFAR_INPUT, PRESETS, Model, reference_spec  # noqa: E402
from hetconv.optim import SGD, SGDConfig  # noqa: E402

RTOL = 1e-4
RTOL_STEPS = 2e-4


class ReferenceNet(nn.Module):
    """conv 5x5 pad 2 -> ReLU -> LRN(5) -> maxpool 2 -> conv -> ReLU -> LRN -> pool -> fc."""

    def __init__(self, c1: int, c2: int, classes: int = 10, in_channels: int = 3, hw: int = 32):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, c1, 5, padding=2)
        self.conv2 = nn.Conv2d(c1, c2, 5, padding=2)
        self.lrn = nn.LocalResponseNorm(5)
        self.fc = nn.Linear(c2 * (hw // 4) ** 2, classes)

    def forward(self, x):
        x = F.max_pool2d(self.lrn(F.relu(self.conv1(x))), 2)
        x = F.max_pool2d(self.lrn(F.relu(self.conv2(x))), 2)
        return self.fc(torch.flatten(x, 1))


def _close(ours, theirs, what: str, rtol: float = RTOL) -> None:
    ours = np.asarray(ours, np.float64)
    theirs = theirs.detach().numpy().astype(np.float64) if torch.is_tensor(theirs) else theirs
    assert ours.shape == theirs.shape, what
    scale = max(float(np.abs(theirs).max()), 1e-30)
    err = float(np.abs(ours - theirs).max())
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol} * {scale:.3g}"


def _torch_twin(model: Model, c1: int, c2: int) -> ReferenceNet:
    net = ReferenceNet(c1, c2)
    state = {k: torch.from_numpy(v.copy()) for k, v in model.parameters().items()}
    net.load_state_dict(state, strict=True)
    return net


def _batch(n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *CIFAR_INPUT), dtype=np.float32)
    y = rng.integers(0, 10, size=n)
    return x, y


SPECS = [pytest.param("tiny", 8, 16, id="tiny"), pytest.param(None, 12, 40, id="mid-12-40")]


def _model(preset, c1, c2, seed=3) -> Model:
    spec = PRESETS[preset] if preset else reference_spec(c1, c2)
    return Model(spec, seed=seed)


@pytest.fixture(autouse=True)
def _torch_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("preset, c1, c2", SPECS)
def test_forward_loss_and_gradients(preset, c1, c2):
    model = _model(preset, c1, c2)
    net = _torch_twin(model, c1, c2)
    x, labels = _batch(8, seed=11)

    logits = model.forward(x)
    loss, grad, _ = softmax_cross_entropy(logits, labels)
    model.backward(grad)

    t_logits = net(torch.from_numpy(x))
    t_loss = F.cross_entropy(t_logits, torch.from_numpy(labels))
    t_loss.backward()

    _close(logits, t_logits, "logits")
    assert loss == pytest.approx(t_loss.item(), rel=1e-5)
    grads = model.gradients()
    assert set(grads) == {n for n, _ in net.named_parameters()}
    for name, p in net.named_parameters():
        assert np.abs(grads[name]).max() > 0, name
        _close(grads[name], p.grad, f"d loss / d {name}")


@pytest.mark.parametrize("preset, c1, c2", SPECS)
def test_five_sgd_steps(preset, c1, c2):
    model = _model(preset, c1, c2)
    net = _torch_twin(model, c1, c2)
    config = SGDConfig(lr=0.01, momentum=0.9, weight_decay=5e-4)
    opt = SGD(model.parameters(), config)
    t_opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    initial = {k: v.copy() for k, v in model.parameters().items()}

    for step in range(5):
        x, labels = _batch(8, seed=100 + step)
        loss, grad, _ = softmax_cross_entropy(model.forward(x), labels)
        model.backward(grad)
        opt.step(model.gradients())

        t_opt.zero_grad()
        t_loss = F.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(labels))
        t_loss.backward()
        t_opt.step()
        assert loss == pytest.approx(t_loss.item(), rel=1e-4), f"step {step}"

    t_params = dict(net.named_parameters())
    for name, value in model.parameters().items():
        assert not np.array_equal(value, initial[name]), f"{name} never moved"
        _close(value, t_params[name], f"{name} after 5 steps", RTOL_STEPS)
        # The moves themselves (tiny next to the weights) must also agree.
        _close(
            value - initial[name],
            t_params[name] - torch.from_numpy(initial[name]),
            f"{name} update",
            1e-2,
        )


@pytest.mark.parametrize(
    "lr, momentum, weight_decay", [(0.01, 0.9, 5e-4), (0.1, 0.0, 0.0), (0.05, 0.5, 0.1)]
)
def test_sgd_updates_match_torch(lr, momentum, weight_decay):
    """The optimiser alone, where every term of the update is large enough to be seen.

    In the network test above, weight decay moves the weights by less than 1% of the update;
    here the gradients are the size of the weights (and zero on one step: pure decay plus
    momentum), so each term is checked at 1e-5 of the update.
    """
    rng = np.random.default_rng(7)
    params = {"a": rng.standard_normal((3, 4), dtype=np.float32), "b": np.ones(5, np.float32)}
    t_params = {k: torch.from_numpy(v.copy()).requires_grad_(True) for k, v in params.items()}
    opt = SGD(params, SGDConfig(lr=lr, momentum=momentum, weight_decay=weight_decay))
    t_opt = torch.optim.SGD(
        list(t_params.values()), lr=lr, momentum=momentum, weight_decay=weight_decay
    )
    for step in range(4):
        before = {k: v.copy() for k, v in params.items()}
        grads = {k: rng.standard_normal(v.shape, dtype=np.float32) for k, v in params.items()}
        if step == 2:
            grads = {k: np.zeros_like(v) for k, v in grads.items()}
        opt.step(grads)
        for k, p in t_params.items():
            p.grad = torch.from_numpy(grads[k].copy())
        t_opt.step()
        for k in params:
            _close(params[k], t_params[k], f"{k} at step {step}", 1e-6)
            t_update = t_params[k].detach().numpy() - before[k]
            if np.abs(t_update).max() > 1e-3 * np.abs(before[k]).max():  # not just round-off
                _close(params[k] - before[k], t_update, f"{k} update at step {step}", 1e-4)


def test_save_then_load_into_torch(tmp_path):
    model = _model("tiny", 8, 16, seed=5)
    path = tmp_path / "weights.npz"
    model.save(path)
    net = ReferenceNet(8, 16)
    state = {k: torch.from_numpy(v) for k, v in np.load(path).items()}
    net.load_state_dict(state, strict=True)
    x, _ = _batch(4, seed=1)
    _close(model.forward(x), net(torch.from_numpy(x)), "logits after loading our file")


def test_torch_state_dict_loads_into_model(tmp_path):
    torch.manual_seed(0)
    net = ReferenceNet(8, 16)
    path = tmp_path / "torch.npz"
    np.savez(path, **{k: v.detach().numpy() for k, v in net.state_dict().items()})
    model = _model("tiny", 8, 16, seed=9)
    model.load(path)
    for name, value in net.state_dict().items():
        np.testing.assert_array_equal(model.parameters()[name], value.numpy())
    x, _ = _batch(4, seed=2)
    _close(model.forward(x), net(torch.from_numpy(x)), "logits after loading torch weights")


# ------------------------------------------------------------------------ single layers


def _layer_vs_torch(layer, t_fn, x: np.ndarray, seed: int = 0):
    """Forward and input gradient of ``layer`` against ``t_fn`` for a random output gradient."""
    y = layer.forward(x)
    dy = np.random.default_rng(seed).standard_normal(y.shape).astype(np.float32)
    dx = layer.backward(dy)
    tx = torch.from_numpy(x.copy()).requires_grad_(True)
    ty = t_fn(tx)
    ty.backward(torch.from_numpy(dy))
    _close(y, ty, f"{layer!r} forward")
    _close(dx, tx.grad, f"{layer!r} input gradient")
    return y, dx


@pytest.mark.parametrize("size, channels", [(5, 7), (4, 6), (5, 3), (4, 2), (2, 5), (1, 3)])
@pytest.mark.parametrize("alpha, beta, k", [(1e-4, 0.75, 1.0), (0.5, 0.6, 2.0)])
def test_lrn_matches_torch(size, channels, alpha, beta, k):
    x = np.random.default_rng(size * 10 + channels).standard_normal((2, channels, 3, 4))
    x = (x * 5).astype(np.float32)
    layer = LocalResponseNorm("lrn", size=size, alpha=alpha, beta=beta, k=k)
    _layer_vs_torch(layer, nn.LocalResponseNorm(size, alpha=alpha, beta=beta, k=k), x)


@pytest.mark.parametrize(
    "kernel, stride, hw", [(2, 2, 6), (2, 2, 7), (3, 2, 7), (3, 3, 10), (2, 1, 5)]
)
def test_maxpool_matches_torch_including_ties(kernel, stride, hw):
    rng = np.random.default_rng(kernel * 100 + hw)
    # Rounded values through a ReLU: many ties, including whole windows of zeros.
    x = np.maximum(np.round(rng.standard_normal((2, 3, hw, hw))), 0).astype(np.float32)
    _layer_vs_torch(MaxPool2d("pool", kernel, stride), lambda t: F.max_pool2d(t, kernel, stride), x)


def test_relu_matches_torch():
    x = np.array([[[[-1.0, 0.0, 2.0, -0.0]]]], np.float32)
    _layer_vs_torch(ReLU("relu"), F.relu, x)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
@pytest.mark.parametrize("kernel", [(4, 4), (2, 3), (5, 5), (1, 2)])
@pytest.mark.parametrize("channels", [3, 24])
def test_conv_same_padding_matches_torch(kernel, channels):
    rng = np.random.default_rng(sum(kernel) + channels)
    layer = Conv2d("conv", channels, 4, kernel, "same")
    layer.params["weight"][...] = rng.standard_normal(layer.params["weight"].shape)
    layer.params["bias"][...] = rng.standard_normal(4)
    weight = torch.from_numpy(layer.params["weight"].copy()).requires_grad_(True)
    bias = torch.from_numpy(layer.params["bias"].copy()).requires_grad_(True)
    x = rng.standard_normal((2, channels, 6, 5)).astype(np.float32)
    _layer_vs_torch(layer, lambda t: F.conv2d(t, weight, bias, padding="same"), x)
    _close(layer.grads["weight"], weight.grad, "conv weight gradient")
    _close(layer.grads["bias"], bias.grad, "conv bias gradient")


class _Staged(LocalConv):
    supports_stages = True


RESIDUAL = [
    {"type": "conv", "name": "c1", "out": 6, "kernel": 3, "padding": 1},
    {"type": "relu"},
    {"type": "conv", "name": "ca", "out": 6, "kernel": 3, "padding": 1},
    {"type": "conv", "name": "cb", "out": 6, "kernel": 1, "inputs": ["relu1"]},
    {"type": "add", "name": "sum", "inputs": ["ca", "cb"]},
    {"type": "relu"},
    {"type": "maxpool", "kernel": 2},
    {"type": "fc", "name": "fc", "out": 10},
]


class ResidualNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.ca = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 6, 3, padding=1)
        self.cb, self.fc = nn.Conv2d(6, 6, 1), nn.Linear(6 * 16 * 16, 10)

    def forward(self, x):
        x = F.relu(self.c1(x))  # feeds both convolutions: its gradient is their sum
        x = F.max_pool2d(F.relu(self.ca(x) + self.cb(x)), 2)
        return self.fc(torch.flatten(x, 1))


@pytest.mark.parametrize("executor", [None, _Staged()], ids=["plain", "staged"])
def test_a_residual_graph_against_torch(executor):
    model = Model(RESIDUAL, seed=5, executor=executor)
    net = ResidualNet()
    net.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in model.parameters().items()})
    x, labels = _batch(4, seed=2)

    loss, grad, _ = softmax_cross_entropy(model.forward(x), labels)
    model.backward(grad)
    t_loss = F.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(labels))
    t_loss.backward()

    assert loss == pytest.approx(t_loss.item(), rel=1e-5)
    grads = model.gradients()
    for name, p in net.named_parameters():
        assert np.abs(grads[name]).max() > 0, name
        _close(grads[name], p.grad, f"d loss / d {name}")
