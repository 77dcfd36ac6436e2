"""The leakage audit (fedlore.audit) can be trusted: its model of each upload is the training the
method does, and its attacks recover what is known to be recoverable, so that a low score on
another upload means that upload leaks less, not that the attack is broken."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from fedlore.audit.inversion import analytic_first_layer, infer_label, invert, score
from fedlore.audit.uploads import (
    adam_update,
    bayes_update,
    fedlore_update,
    gradient,
    lora_update,
    sgd_update,
    soft_cross_entropy,
)
from fedlore.bayes.posterior import gaussian_kl, log_softplus
from fedlore.data.sources import load_digits
from fedlore.models.mlp import MLP, mlp

ROOT = Path(__file__).resolve().parents[2]
Digits = tuple[torch.Tensor, torch.Tensor]

PSNR_BAR = 15.0
"""dB: a reconstruction of a digit that a person reads; a random image in [0, 1] scores about 6."""


@pytest.fixture(scope="module")
def digits() -> Digits:
    src = load_digits()
    return src.train.x[:4].float(), src.train.y[:4]


def _model(seed: int = 0, hidden: int = 32) -> MLP:
    torch.manual_seed(seed)
    return mlp((1, 8, 8), 10, hidden=[hidden])


def _onehot(y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(y, 10).float()


def _trained_delta(
    model: torch.nn.Module, opt_name: str, x: torch.Tensor, y: torch.Tensor, lr: float, steps: int
) -> list[torch.Tensor]:
    net = _model()
    net.load_state_dict(model.state_dict())
    opt = (torch.optim.SGD if opt_name == "sgd" else torch.optim.Adam)(net.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        soft_cross_entropy(net(x), _onehot(y)).backward()
        opt.step()
    return [
        a.detach() - b.detach() for a, b in zip(net.parameters(), model.parameters(), strict=True)
    ]


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_the_upload_models_are_the_training_torch_does(digits: Digits, opt_name: str) -> None:
    x, y = digits
    model = _model()
    up = sgd_update(model, 0.1, 3) if opt_name == "sgd" else adam_update(model, 1e-2, 3)
    got = [t.detach() for t in up(x, _onehot(y))]
    want = _trained_delta(model, opt_name, x, y, 0.1 if opt_name == "sgd" else 1e-2, 3)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_the_bnn_upload_is_adam_on_fedlores_elbo(digits: Digits) -> None:
    """Meta-BayFL's upload model against torch's Adam on the ELBO written with fedlore's own KL
    (:func:`~fedlore.bayes.posterior.gaussian_kl`, the one its training uses), the same noise."""
    x, y = digits
    model = _model()
    steps, lr, seed = 3, 1e-2, 11
    got = [t.detach() for t in bayes_update(model, lr, steps, noise_seed=seed)(x, _onehot(y))]
    start = {k: v.detach() for k, v in model.named_parameters()}
    mu = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    rho = {k: torch.full_like(v, -5.0).requires_grad_(True) for k, v in start.items()}
    opt = torch.optim.Adam([*mu.values(), *rho.values()], lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        noise = {k: torch.randn(v.shape, generator=g) for k, v in start.items()}
        w = {k: mu[k] + torch.nn.functional.softplus(rho[k]) * noise[k] for k in start}
        kl = sum(gaussian_kl(mu[k], log_softplus(rho[k]), 0.0, 1.0) for k in start)
        logits = torch.func.functional_call(model, w, (x,))
        loss = soft_cross_entropy(logits, _onehot(y)) + kl / x.shape[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    want = [mu[k].detach() - start[k] for k in start]
    want += [rho[k].detach() + 5.0 for k in start]
    assert len(got) == len(want) == 2 * len(start)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    other = bayes_update(model, lr, steps, noise_seed=seed + 1)(x, _onehot(y))
    assert not torch.allclose(other[len(start)].detach(), got[len(start)])  # ε moves Δrho


@pytest.mark.parametrize("side", ["left", "right"])
def test_fedlore_upload_is_adam_on_the_coordinates(digits: Digits, side: str) -> None:
    """One step by hand: Adam's first direction on R = Pᵀ G is R / (|R| + ε) (bias-corrected),
    so ΔZ = -η R / (|R| + ε); the weight moves by P ΔZ; the dense tensors by plain Adam."""
    x, y = digits
    model = _model()
    w = dict(model.named_parameters())["body.0.weight"]  # 32 x 64 (out x in)
    rows = w.shape[0] if side == "left" else w.shape[1]
    p, _ = torch.linalg.qr(torch.randn(rows, 4, generator=torch.Generator().manual_seed(1)))
    got = fedlore_update(model, {"body.0.weight": p}, 1e-2, 1, side=side)(x, _onehot(y))
    g = [t.detach() for t in gradient(model)(x, _onehot(y))]
    view = g[0] if side == "left" else g[0].T
    r = p.T @ view
    torch.testing.assert_close(got[0].detach(), -1e-2 * r / (r.abs() + 1e-8), rtol=1e-4, atol=1e-7)
    assert got[0].shape == (4, 32 if side == "right" else 64)
    torch.testing.assert_close(got[1].detach(), -1e-2 * g[1] / (g[1].abs() + 1e-8))
    omega = torch.randn(64 if side == "left" else 32, 6, generator=torch.Generator().manual_seed(2))
    sketched = fedlore_update(
        model, {"body.0.weight": p}, 1e-2, 1, side=side, sketch={"body.0.weight": omega}
    )(x, _onehot(y))
    assert len(sketched) == len(got) + 1  # the sketch Y = G Ω of the (only) step's gradient
    torch.testing.assert_close(sketched[-1].detach(), view @ omega, rtol=1e-4, atol=1e-7)


def test_the_closed_form_recovers_a_single_image_and_fedlores_left_side_does_not_hide_it(
    digits: Digits,
) -> None:
    x, y = digits
    model = _model()
    g = [t.detach() for t in gradient(model)(x[:1], _onehot(y[:1]))]
    w_grad, b_grad = g[0], g[1]
    recovered = analytic_first_layer(w_grad, b_grad).reshape(1, 1, 8, 8)
    assert score(recovered.clamp(0, 1), x[:1])["psnr"] > 60
    p, _ = torch.linalg.qr(torch.randn(32, 4, generator=torch.Generator().manual_seed(2)))
    left = analytic_first_layer(p.T @ w_grad, b_grad, basis=p).reshape(1, 1, 8, 8)
    assert score(left.clamp(0, 1), x[:1])["psnr"] > 60  # the coordinates keep the input
    q, _ = torch.linalg.qr(torch.randn(64, 4, generator=torch.Generator().manual_seed(3)))
    right = analytic_first_layer(q.T @ w_grad.T, b_grad, basis=q, side="right")
    torch.testing.assert_close(right, q @ (q.T @ x[0].reshape(-1)), rtol=1e-4, atol=1e-5)
    assert score(right.reshape(1, 1, 8, 8).clamp(0, 1), x[:1])["psnr"] < 20  # a projection only
    assert infer_label(g[-1]) == int(y[0])


def test_inverting_gradients_recovers_one_image_from_a_one_step_fedavg_update(
    digits: Digits,
) -> None:
    x, y = digits
    model = _model()
    up = sgd_update(model, 0.1, 1)
    observed = [t.detach() for t in up(x[:1], _onehot(y[:1]))]
    found = invert(
        up, observed, (1, 8, 8), 10, 1, kind="ig", labels=y[:1], steps=150,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert score(found.x, x[:1])["psnr"] > PSNR_BAR


def test_dlg_recovers_the_image_and_the_label_from_a_gradient(
    digits: Digits,
) -> None:
    x, y = digits
    model = _model()
    observed = [t.detach() for t in gradient(model)(x[:1], _onehot(y[:1]))]
    found = invert(
        gradient(model), observed, (1, 8, 8), 10, 1, kind="dlg", steps=100, lr=1.0,
        generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    assert int(found.labels[0]) == int(y[0])
    assert score(found.x, x[:1])["psnr"] > PSNR_BAR


def test_noise_defeats_the_attack_that_succeeds_without_it(
    digits: Digits,
) -> None:
    """The control: the same attack on the same upload plus Gaussian noise of the upload's own
    norm per coordinate scores at the level of a random image."""
    x, y = digits
    model = _model()
    up = sgd_update(model, 0.1, 1)
    clean = [t.detach() for t in up(x[:1], _onehot(y[:1]))]
    norm = torch.cat([t.reshape(-1) for t in clean]).norm()
    g = torch.Generator().manual_seed(5)
    noisy = [t + norm * torch.randn(t.shape, generator=g) for t in clean]
    found = invert(
        up, noisy, (1, 8, 8), 10, 1, kind="ig", labels=y[:1], steps=150,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert score(found.x, x[:1])["psnr"] < PSNR_BAR - 5


def test_scores_pair_images_whatever_the_order(digits: Digits) -> None:
    x, _ = digits
    noisy = (x + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0))).clamp(
        0, 1
    )
    a = score(noisy, x)
    b = score(noisy[[2, 0, 3, 1]], x)
    assert a == pytest.approx(b)
    assert a["psnr"] > 20 and a["ssim"] > 0.5
    assert score(torch.rand(x.shape, generator=torch.Generator().manual_seed(1)), x)["psnr"] < 10


def test_invert_refuses_what_it_cannot_do(digits: Digits) -> None:
    x, y = digits
    up = gradient(_model())
    observed = [t.detach() for t in up(x[:1], _onehot(y[:1]))]
    with pytest.raises(ValueError, match="needs the labels"):
        invert(up, observed, (1, 8, 8), 10, 1, kind="ig")
    with pytest.raises(ValueError, match="labels: expected shape"):
        invert(up, observed, (1, 8, 8), 10, 1, kind="ig", labels=y[:2])
    with pytest.raises(ValueError, match="does not fit"):
        fedlore_update(_model(), {"body.0.weight": torch.zeros(7, 2)}, 1e-2, 1)


def test_the_benchmark_writes_its_table_summary_and_figure(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("leakage", ROOT / "benchmarks" / "leakage.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--data", "digits", "--batch", "1", "4", "--attack-steps", "3", "--epsilons", "8"]
    assert bench.main([*args, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "leakage.json").read_text())
    methods = {(r["batch"], r["method"], r["attack"]) for r in result["rows"]}
    assert (1, "fedavg-1", "closed form") in methods and (1, "fedavg-1", "dlg") in methods
    assert {m for b, m, a in methods if b == 4} == {
        "fedavg-1", "fedavg-1 ε=8", "fedavg-5", "fedfull", "fedlore", "fedlore ε=8",
        "fedlore side=right", "fedlore-sketch", "fedit", "meta-bayfl noise-known",
        "meta-bayfl noise-guessed", "meta-bayfl flat-prior",
    }  # fmt: skip
    assert result["summary"]["digits_b1_fedavg-1_closed_psnr"] > 60
    assert "digits_b4_fedlore_eps8_ig_ssim" in result["summary"]
    assert (tmp_path / "leakage.png").stat().st_size > 0
    assert 0 < (tmp_path / "leakage-images.pt").stat().st_size < 100_000  # the images only
    assert "| digits | 4 | fedlore | ig |" in (tmp_path / "leakage.md").read_text()


def test_only_reruns_some_methods_and_keeps_the_others_rows(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("leakage", ROOT / "benchmarks" / "leakage.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--data", "digits", "--batch", "1", "--attack-steps", "2", "--epsilons", "8"]
    assert bench.main([*args, "--out", str(tmp_path)]) == 0
    before = json.loads((tmp_path / "leakage.json").read_text())["rows"]
    with pytest.raises(SystemExit, match="other settings"):
        bench.main([*args[:-1], "1", "--only", "fedit", "--out", str(tmp_path)])
    assert bench.main([*args, "--only", "fedit", "--out", str(tmp_path)]) == 0
    after = json.loads((tmp_path / "leakage.json").read_text())["rows"]
    assert [(r["method"], r["attack"]) for r in after] == [
        (r["method"], r["attack"]) for r in before
    ]  # the full run's order
    for old, new in zip(before, after, strict=True):
        if old["method"] != "fedit":
            assert old == new  # kept as written
    md = (tmp_path / "leakage.md").read_text()
    assert md == bench.table(after)


def test_the_committed_table_is_the_committed_results() -> None:
    spec = importlib.util.spec_from_file_location("leakage", ROOT / "benchmarks" / "leakage.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = json.loads((ROOT / "benchmarks" / "results" / "leakage.json").read_text())
    assert (ROOT / "benchmarks" / "results" / "leakage.md").read_text() == bench.table(
        result["rows"]
    )
    assert result["summary"] == bench.summary(result["rows"])


class _LoRAMLP(torch.nn.Module):
    """The MLP of :func:`_model` with its hidden weight adapted as W + B A (W frozen)."""

    def __init__(self, base: MLP, a: torch.Tensor, b: torch.Tensor) -> None:
        super().__init__()
        self.base = base
        self.a = torch.nn.Parameter(a.clone())
        self.b = torch.nn.Parameter(b.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.base.body[0]
        assert isinstance(hidden, torch.nn.Linear)
        w = hidden.weight.detach() + self.b @ self.a
        h = torch.relu(torch.nn.functional.linear(x.flatten(1), w, hidden.bias))
        return self.base.head(h)


def test_the_lora_upload_is_the_training_torch_does(digits: Digits) -> None:
    x, y = digits
    model = _model()
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(4, 64, generator=g) * 0.1, torch.randn(32, 4, generator=g) * 0.1
    got = [
        t.detach() for t in lora_update(model, {"body.0.weight": (a, b)}, 1e-2, 3)(x, _onehot(y))
    ]
    net = _model()
    net.load_state_dict(model.state_dict())
    lora = _LoRAMLP(net, a, b)
    hidden = net.body[0]
    assert isinstance(hidden, torch.nn.Linear)
    trained = [lora.a, lora.b, hidden.bias, net.head.weight, net.head.bias]
    before = [t.detach().clone() for t in trained]
    opt = torch.optim.Adam(trained, lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        soft_cross_entropy(lora(x), _onehot(y)).backward()
        opt.step()
    want = [t.detach() - s for t, s in zip(trained, before, strict=True)]
    assert len(got) == 5  # ΔA, ΔB, then the bias and the head, in parameter order
    for g_, w_ in zip(got, want, strict=True):
        torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-6)
