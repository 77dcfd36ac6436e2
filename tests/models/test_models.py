"""Model registry: shapes, gradients, head naming, parameter counts, shape errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fedlore import registry
from fedlore.config import load_config
from fedlore.models import build_model, mlp
from fedlore.models.cnn import CNN
from fedlore.models.resnet import CifarResNet

SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32)]
MODELS = ["mlp", "cnn", "resnet20", "resnet32", "resnet44", "resnet56"]


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_all_models_registered() -> None:
    assert set(MODELS) <= set(registry.names("model"))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_backward_head(name: str, shape: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    model = build_model(name, shape, 7)
    x = torch.rand(3, *shape)
    out = model(x)
    assert out.shape == (3, 7)
    out.logsumexp(1).sum().backward()
    assert isinstance(model.head, nn.Linear) and model.head.out_features == 7
    names = [n for n, _ in model.named_parameters()]
    assert [n for n in names if n.startswith("head.")] == ["head.weight", "head.bias"]
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    assert any(p.grad.abs().sum() > 0 for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", ["cnn", "resnet20"])
def test_seeded_construction_is_deterministic(name: str) -> None:
    torch.manual_seed(3)
    a = build_model(name, (1, 28, 28), 10)
    torch.manual_seed(3)
    b = build_model(name, (1, 28, 28), 10)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)


def test_cnn_parameter_count_matches_mcmahan() -> None:
    # McMahan et al. (2017) report 1,663,370 parameters for their MNIST CNN (28x28, 10 classes):
    # conv 1->32 (832) + conv 32->64 (51,264) + Linear 3136->512 (1,606,144) + head (5,130).
    assert n_params(build_model("cnn", (1, 28, 28), 10)) == 1_663_370


def test_cnn_kwargs() -> None:
    m = build_model("cnn", (3, 32, 32), 10, channels=(8, 16), hidden=64, dropout=0.5)
    assert isinstance(m, CNN)
    assert m.fc.in_features == 16 * 8 * 8 and m.fc.out_features == 64
    assert m(torch.rand(2, 3, 32, 32)).shape == (2, 10)


def test_mlp_kwargs() -> None:
    m = build_model("mlp", (1, 8, 8), 10, hidden=[32], dropout=0.1)
    linears = [mod for mod in m.modules() if isinstance(mod, nn.Linear)]
    assert [(lin.in_features, lin.out_features) for lin in linears] == [(64, 32), (32, 10)]
    assert any(isinstance(mod, nn.Dropout) for mod in m.modules())
    linear = build_model("mlp", (5,), 3, hidden=[])
    assert n_params(linear) == 5 * 3 + 3


def test_mlp_batch_norm_sits_between_each_hidden_linear_and_its_relu() -> None:
    """``norm="batch"`` (FedBN's model): Linear -> BatchNorm1d -> ReLU per hidden layer; the
    default builds the plain MLP with the tensor names it always had."""
    torch.manual_seed(0)
    m = build_model("mlp", (1, 8, 8), 10, hidden=[32, 16], norm="batch")
    assert isinstance(m, mlp.MLP)
    kinds = [type(mod) for mod in m.body]
    assert kinds == [nn.Linear, mlp.BatchNorm1d, nn.ReLU] * 2
    assert issubclass(mlp.BatchNorm1d, nn.BatchNorm1d)  # torch's, found by type (FedBN)
    assert [bn.num_features for bn in m.body if isinstance(bn, nn.BatchNorm1d)] == [32, 16]
    assert {"body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked"} <= set(
        m.state_dict()
    )
    assert m(torch.rand(4, 1, 8, 8)).shape == (4, 10)
    bn = m.body[1]
    assert isinstance(bn, nn.BatchNorm1d) and bn.running_mean is not None
    assert not torch.equal(bn.running_mean, torch.zeros(32))  # training mode: stats move
    plain = build_model("mlp", (1, 8, 8), 10, hidden=[32, 16])
    assert not any(isinstance(mod, nn.BatchNorm1d) for mod in plain.modules())
    assert list(plain.state_dict()) == [
        "body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias", "head.weight", "head.bias",
    ]  # fmt: skip
    assert list(plain.state_dict()) == list(build_model("mlp", (1, 8, 8), 10, hidden=[32, 16],
                                                        norm="none").state_dict())  # fmt: skip
    with pytest.raises(ValueError, match="norm must be 'none' or 'batch'"):
        build_model("mlp", (1, 8, 8), 10, norm="group")


def test_mlp_batch_norm_takes_a_training_batch_of_one() -> None:
    """A client of ``1 mod batch_size`` examples ends each pass on a batch of one, which torch's
    BatchNorm1d refuses in training mode: the MLP's normalizes it by its running statistics (as
    in evaluation) and leaves them unchanged, and the step still reaches every parameter."""
    torch.manual_seed(0)
    m = build_model("mlp", (6,), 3, hidden=[8], norm="batch")
    assert isinstance(m, mlp.MLP)
    m.train()
    m(torch.randn(16, 6) * 3 + 1)  # statistics away from (0, 1)
    bn = m.body[1]
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    one = torch.randn(1, 6)
    out = m(one)
    out.sum().backward()
    assert all(torch.equal(v, bn.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is not None for p in m.parameters())
    m.eval()
    torch.testing.assert_close(out.detach(), m(one))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        nn.BatchNorm1d(8).train()(torch.randn(1, 8))  # what torch's own does


@pytest.mark.parametrize(("name", "n"), [("resnet20", 3), ("resnet32", 5), ("resnet56", 9)])
def test_resnet_depth(name: str, n: int) -> None:
    model = build_model(name, (3, 32, 32), 10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    # Option-A shortcuts are parameter-free: all convs are main-path, 6n + 1 of them.
    assert len(convs) == 6 * n + 1 and len(linears) == 1
    assert len(convs) + len(linears) == int(name.removeprefix("resnet"))
    assert [c.out_channels for c in convs[:: 2 * n]] == [16, 16, 32, 64]


def test_resnet20_parameter_count() -> None:
    # He et al. (2016) table 6: ResNet-20 has 0.27 M parameters (269,722 with option A, CIFAR-10).
    assert n_params(build_model("resnet20", (3, 32, 32), 10)) == 269_722


def test_resnet_group_norm_and_width() -> None:
    model = build_model("resnet20", (3, 32, 32), 100, norm="group", width=8, groups=4)
    assert isinstance(model, CifarResNet)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert norms and all(m.num_groups == 4 for m in norms)
    assert model.head.in_features == 32
    assert not list(model.buffers())  # no client-specific running statistics
    model.eval()
    assert model(torch.rand(1, 3, 32, 32)).shape == (1, 100)


@pytest.mark.parametrize(
    ("name", "shape", "match"),
    [
        ("cnn", (28, 28), r"\(C, H, W\)"),
        ("cnn", (1, 2, 2), r"H and W >= 4"),
        ("resnet20", (3, 4, 4), r"H and W >= 8"),
        ("resnet20", (784,), r"\(C, H, W\)"),
        ("mlp", (1, 0, 8), r"positive ints"),
        ("mlp", (), r"must not be empty"),
    ],
)
def test_bad_input_shape(name: str, shape: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_model(name, shape, 10)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"unknown kwargs \['depth'\]") as err:
        build_model("cnn", (1, 28, 28), 10, depth=3)
    assert "YAML" not in str(err.value)


def test_a_key_glued_to_its_value_names_the_missing_space() -> None:
    """`model.kwargs={norm:batch}` is YAML's one key 'norm:batch' (null value), not norm."""
    cfg = load_config(None, ["model.kwargs={norm:batch}"])
    with pytest.raises(ValueError) as err:
        build_model("mlp", (1, 8, 8), 10, **cfg.model.kwargs)
    assert str(err.value) == (
        "model 'mlp': unknown kwargs ['norm:batch']; accepted: ['hidden', 'dropout', 'norm'] "
        "(YAML reads {norm:batch} as one key: put a space after the colon)"
    )
    with pytest.raises(ValueError, match="num_classes"):
        build_model("mlp", (1, 8, 8), 0)
    with pytest.raises(ValueError, match="norm must be"):
        build_model("resnet20", (3, 32, 32), 10, norm="layer")
    with pytest.raises(ValueError, match="divide width"):
        build_model("resnet20", (3, 32, 32), 10, norm="group", groups=3)
    with pytest.raises(KeyError, match="unknown model 'vgg'"):
        build_model("vgg", (3, 32, 32), 10)


@pytest.mark.parametrize("shape", [(5, 8, 28, 28), (3, 4, 7, 9), (2, 1, 8, 8)])
@pytest.mark.parametrize("ceil_mode", [False, True])
def test_the_cnns_channels_last_pool_is_torchs_pool_bit_for_bit(
    shape: tuple[int, int, int, int], ceil_mode: bool
) -> None:
    """fedlore's CPU max-pool gives nn.MaxPool2d's values without autograd (its channels-last
    route, ties included: ReLU zeros and repeated integers) and nn.MaxPool2d's values and
    gradients with it; the CNN pools with it."""
    from fedlore.models.cnn import MaxPool2d

    gen = torch.Generator().manual_seed(0)
    ties = torch.randint(0, 3, shape, generator=gen).float()
    for x in (torch.randn(shape, generator=gen).relu(), ties):
        ours, theirs = MaxPool2d(2, ceil_mode=ceil_mode), torch.nn.MaxPool2d(2, ceil_mode=ceil_mode)
        with torch.no_grad():
            out = ours(x)
        assert out.is_contiguous() and torch.equal(out, theirs(x))
        with torch.no_grad():  # a model in channels-last layout (Meta-BayFL's scoring) keeps it
            kept = ours(x.contiguous(memory_format=torch.channels_last))
        assert kept.is_contiguous(memory_format=torch.channels_last) and torch.equal(kept, out)
        grads = []
        for pool in (ours, theirs):
            xg = x.clone().requires_grad_()
            pool(xg).pow(2).sum().backward()
            assert xg.grad is not None
            grads.append(xg.grad)
        assert torch.equal(grads[0], grads[1])
    cnn = CNN((1, 28, 28), 10, (8, 16), 64, 0.0)
    assert sum(isinstance(m, MaxPool2d) for m in cnn.modules()) == 2


def test_a_head_of_another_width_than_the_classes_is_refused() -> None:
    """A registered model whose head ignores ``num_classes`` failed in the first loss with a
    traceback (IndexError: Target 4 is out of bounds); it is refused when built."""
    from fedlore import registry

    @registry.register_model("_test_three_outputs")
    def three(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        model = nn.Module()
        model.head = nn.Linear(4, 3)
        return model

    try:
        build_model("_test_three_outputs", (4,), 3)  # as many outputs as classes: fine
        with pytest.raises(ValueError, match="its head gives 3 outputs, but the data have 10"):
            build_model("_test_three_outputs", (4,), 10)
    finally:
        registry._TABLES["model"].pop("_test_three_outputs")


def test_a_factory_of_another_signature_or_result_is_refused_by_name() -> None:
    """A registered factory without ``num_classes`` was refused as "a keyword argument has the
    wrong type ... {}", and one that returned no module as "does not name its classifier
    Linear 'head'": each is named for what it is."""
    from fedlore import registry

    @registry.register_model("_test_no_classes")
    def no_classes(input_shape: tuple[int, ...]) -> nn.Module:
        return nn.Linear(4, 3)

    @registry.register_model("_test_not_a_module")
    def not_a_module(input_shape: tuple[int, ...], num_classes: int) -> object:
        return "model"

    try:
        with pytest.raises(ValueError) as err:
            build_model("_test_no_classes", (4,), 3)
        said = str(err.value)
        assert said.startswith("model '_test_no_classes': its factory no_classes(input_shape")
        assert said.endswith(
            "cannot be called as f(input_shape, num_classes, **model.kwargs) "
            "(too many positional arguments)"
        )
        with pytest.raises(ValueError) as err:
            build_model("_test_not_a_module", (4,), 3)
        assert str(err.value) == (
            "model '_test_not_a_module': its factory returned str, not an nn.Module"
        )
    finally:
        registry._TABLES["model"].pop("_test_no_classes")
        registry._TABLES["model"].pop("_test_not_a_module")


def test_a_model_that_returns_no_logits_is_refused_before_any_folder(tmp_path: Path) -> None:
    """A registered classifier that returned its argmax (or one score per example), or whose
    forward failed, had every client's update rejected in round 0 with torch's message about
    the loss, after its run folder was made; the preflight names the shape or the error."""
    from fedlore import registry
    from fedlore.config import ConfigError
    from fedlore.experiment import run_experiment

    class Argmax(nn.Module):
        def __init__(self, num_classes: int, width: int) -> None:
            super().__init__()
            self.body = nn.Linear(width, 8)  # digits: 64 features
            self.head = nn.Linear(8, num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x.flatten(1))).argmax(1)

    @registry.register_model("_test_argmax")
    def argmax(input_shape: tuple[int, ...], num_classes: int, *, width: int = 64) -> nn.Module:
        return Argmax(num_classes, width)

    base = ["model.name=_test_argmax", "algorithms=[fedavg]", "rounds=1", "num_clients=2"]
    base += ["progress=false", "seeds=[0]", f"output_dir={tmp_path}"]
    try:
        with pytest.raises(ConfigError) as err:
            run_experiment(load_config(None, base))
        assert str(err.value) == (
            "model '_test_argmax' returns torch.int64 (2,) for inputs (2, 1, 8, 8); a classifier "
            "returns float logits of shape (2, 10) ([batch, num_classes])"
        )
        with pytest.raises(ConfigError) as err:
            run_experiment(load_config(None, [*base, "model.kwargs={width: 10}"]))
        assert str(err.value) == (
            "model '_test_argmax' fails on inputs (2, 1, 8, 8): RuntimeError: mat1 and mat2 "
            "shapes cannot be multiplied (2x64 and 10x8)"
        )
        assert not any(tmp_path.iterdir())  # refused before any run folder
    finally:
        registry._TABLES["model"].pop("_test_argmax")


def test_the_same_definition_registered_again_replaces_it_and_another_is_refused() -> None:
    """A notebook that runs the own-model tutorial's registration cell again (after changing
    the model) was refused with "model 'tiny_cnn' is registered twice"; the same definition
    (module and name) now replaces the old one, and another definition still is refused,
    naming both."""
    from fedlore import registry

    def define(width: int) -> object:
        @registry.register_model("_test_again")
        def again(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
            model = nn.Module()
            model.head = nn.Linear(width, num_classes)
            return model

        return again

    try:
        define(4)
        define(5)  # the cell run again
        head = build_model("_test_again", (4,), 3).head
        assert isinstance(head, nn.Linear) and head.in_features == 5
        with pytest.raises(ValueError, match=r"'_test_again' is registered twice: by .*again and"):
            registry.register_model("_test_again")(lambda input_shape, num_classes: None)
    finally:
        registry._TABLES["model"].pop("_test_again")


def test_a_server_without_a_pool_checks_the_model_on_test_inputs() -> None:
    """Under ``flower.site_data`` the server's federation has an empty pool: the model's
    output is checked on its central test inputs instead (not on an empty batch)."""
    import dataclasses

    from fedlore.checks import check_model_output
    from fedlore.config import ConfigError
    from fedlore.data.client_data import TensorSplit
    from fedlore.data.federation import build_federation

    cfg = load_config(None, ["num_clients=2", "model.kwargs={hidden: [8]}"])
    fed = build_federation(cfg, 0)
    site = dataclasses.replace(fed, pool=TensorSplit(fed.pool.x[:0], fed.pool.y[:0]))
    model = build_model("mlp", tuple(fed.input_shape), fed.num_classes, hidden=[8])
    check_model_output(cfg, model, site)  # logits [2, 10]: fine
    model.head = nn.Linear(8, 3)  # three logits, not ten
    with pytest.raises(ConfigError, match=r"returns torch.float32 \(2, 3\) for inputs \(2, 1, 8"):
        check_model_output(cfg, model, site)
