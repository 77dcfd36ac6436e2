"""FedAvg's server (:class:`fedlore.algorithms.dense.DenseServer`) on hand-checked rounds: the
weights of the mean ``W + Σ n_i Δ_i / Σ n_i`` (McMahan et al. 2017, Algorithm 1), what a lost reply
resets, which tensors a revisiting client is sent, the server optimizer's moments and step
count, the dtypes on the wire, the integer buffers left out of private uploads, the clamp of
BatchNorm's running variances, and the client's ``W_K - W^t``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fedlore.algorithms.fedavg import FedFull
from fedlore.algorithms.pfedme import PFedMe
from fedlore.optim.server import STEPS
from fedlore.robust import combine_updates
from fedlore.types import Broadcast, Reply, State

FLOATS = ("0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var")
COUNT = "1.num_batches_tracked"


def _model(dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).to(dtype)


def _deltas(model: dict[str, torch.Tensor], seed: int, scale: float = 0.1) -> dict[str, Any]:
    """A client's Δ: small random floats (running variances kept above 0) and +seed batches."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in model.items():
        if v.is_floating_point():
            out[k] = scale * torch.rand(v.shape, generator=g, dtype=v.dtype)
        else:
            out[k] = torch.full_like(v, seed)
    return out


def _reply(delta: dict[str, torch.Tensor], n: int) -> Reply:
    return Reply({f"update.{k}": v for k, v in delta.items()}, {"num_examples": n})


def test_the_step_is_the_example_weighted_mean_and_lost_replies_are_left_out() -> None:
    algo = FedFull.of()
    state = algo.init_server(_model(), torch.Generator())
    w = {k: v.clone() for k, v in algo.global_arrays(state).items()}
    d = [_deltas(w, s) for s in (1, 2, 3)]
    replies = [(0, _reply(d[0], 1)), (4, None), (1, _reply(d[1], 3)), (2, _reply(d[2], 6))]
    new, scalars = algo.aggregate(state, replies, 0)
    assert scalars == {"aggregated": 3}
    assert new.values == {}  # no freeze: no seen.<cid>; plain SGD at lr 1: no step count
    assert set(new.arrays) == {f"model.{k}" for k in w}  # no sopt.* moments
    got = algo.global_arrays(new)
    for k in FLOATS:
        want = w[k] + (1 * d[0][k] + 3 * d[1][k] + 6 * d[2][k]) / 10
        assert got[k].dtype == torch.float64
        torch.testing.assert_close(got[k], want, rtol=1e-14, atol=0)
    assert got[COUNT].dtype == torch.int64
    want_count = combine_updates([{COUNT: x[COUNT]} for x in d], [1, 3, 6])[COUNT]
    assert torch.equal(got[COUNT], w[COUNT] + want_count)
    # the state the server was given is not changed
    assert all(torch.equal(algo.global_arrays(state)[k], w[k]) for k in w)


def test_uniform_weighting_weighs_every_reply_alike() -> None:
    algo = FedFull.of(weighting="uniform")
    state = algo.init_server(_model(), torch.Generator())
    w = algo.global_arrays(state)
    d = [_deltas(w, s) for s in (1, 2)]
    new, _ = algo.aggregate(state, [(0, _reply(d[0], 1)), (1, _reply(d[1], 9))], 0)
    torch.testing.assert_close(
        algo.global_arrays(new)["0.weight"],
        w["0.weight"] + (d[0]["0.weight"] + d[1]["0.weight"]) / 2,
    )


def test_a_round_without_replies_keeps_the_model_and_forgets_who_was_lost() -> None:
    algo = FedFull.of(freeze=("0.bias",))
    state = algo.init_server(_model(), torch.Generator())
    state = State(dict(state.arrays), {"seen.0": 1, "seen.1": 1, "seen.5": 1})
    new, scalars = algo.aggregate(state, [(0, None), (1, None)], 3)
    assert scalars == {"aggregated": 0}
    assert new.values == {"seen.5": 1}  # a lost reply's cache may be gone: send it all again
    assert new.arrays == state.arrays and new.arrays is not state.arrays
    assert state.values == {"seen.0": 1, "seen.1": 1, "seen.5": 1}  # the input is not changed


def test_a_client_that_replied_is_sent_all_but_the_frozen_tensors() -> None:
    algo = FedFull.of(freeze=("0.bias",))
    state = algo.init_server(_model(), torch.Generator())
    everything = set(state.arrays)
    first = algo.broadcast(state, 7, 2)
    assert set(first.arrays) == everything and first.config == {"round": 7}
    w = algo.global_arrays(state)
    lost = {**state.values, "seen.1": 1}
    state = State(state.arrays, lost)
    d = _deltas({k: v for k, v in w.items() if k != "0.bias"}, 1)
    state, _ = algo.aggregate(state, [(1, None), (2, _reply(d, 4)), (3, _reply(d, 4))], 7)
    assert state.values == {"seen.2": 1, "seen.3": 1}
    again = algo.broadcast(state, 8, 2)
    assert set(again.arrays) == everything - {"model.0.bias"} and again.config == {"round": 8}
    assert set(algo.broadcast(state, 8, 1).arrays) == everything  # lost: sent everything again
    assert algo.global_arrays(state)["0.bias"].equal(w["0.bias"])  # frozen: never moves
    spec = algo.expected_reply(state, 8, 2)
    assert set(spec) == {f"update.{k}" for k in w if k != "0.bias"}


def test_the_server_optimizer_steps_from_the_mean_and_keeps_its_moments() -> None:
    """FedAdam (Reddi et al. 2021, Algorithm 2): the step of round t from the mean Δ with the
    moments of round t - 1; a round without replies keeps both the moments and t."""
    algo = FedFull.of(server_optimizer="adam", server_eta=0.1)
    torch.manual_seed(0)
    state = algo.init_server(nn.Linear(3, 2).double(), torch.Generator())
    w0 = {k: v.clone() for k, v in algo.global_arrays(state).items()}
    opt = algo.server_opt()
    moments: dict[str, torch.Tensor] = {}
    want = dict(w0)
    for t in (1, 2):
        d = [_deltas(w0, 10 * t + i) for i in range(2)]
        mean = {k: (1 * d[0][k] + 3 * d[1][k]) / 4 for k in w0}
        step, moments = opt.step(mean, moments, t)
        want = {k: want[k] + step[k] for k in w0}
        state, _ = algo.aggregate(state, [(0, _reply(d[0], 1)), (1, _reply(d[1], 3))], t)
        assert state.values == {STEPS: t}
        assert set(state.arrays) == {f"model.{k}" for k in w0} | set(moments)
        for k, v in moments.items():
            torch.testing.assert_close(state.arrays[k], v, rtol=1e-12, atol=0)
        for k in w0:
            torch.testing.assert_close(algo.global_arrays(state)[k], want[k], rtol=1e-12, atol=0)
    assert moments and all(k.startswith("sopt.") for k in moments)
    kept, _ = algo.aggregate(state, [(0, None)], 3)
    assert kept.values == {STEPS: 2} and kept.arrays == state.arrays


def test_sixteen_bit_uploads_are_upcast_to_the_models_dtype() -> None:
    algo = FedFull.of(transport_dtype="fp16")
    state = algo.init_server(_model(torch.float32), torch.Generator())
    w = algo.global_arrays(state)
    spec = algo.expected_reply(state, 0)
    assert spec == {
        f"update.{k}": (tuple(v.shape), torch.float16 if v.is_floating_point() else torch.int64)
        for k, v in w.items()
    }
    d = {k: v.half() if v.is_floating_point() else v for k, v in _deltas(w, 1).items()}
    new, _ = algo.aggregate(state, [(0, _reply(d, 2))], 0)
    got = algo.global_arrays(new)
    for k in FLOATS:
        assert got[k].dtype == torch.float32
        assert torch.equal(got[k], w[k] + d[k].float())
    assert torch.equal(got[COUNT], w[COUNT] + 1) and got[COUNT].dtype == torch.int64


def test_only_running_variances_are_clamped_at_zero() -> None:
    algo = FedFull.of()
    state = algo.init_server(_model(), torch.Generator())
    w = algo.global_arrays(state)
    d = {k: -10 * torch.ones_like(v) for k, v in w.items()}
    new, _ = algo.aggregate(state, [(0, _reply(d, 1))], 0)
    got = algo.global_arrays(new)
    assert torch.equal(got["1.running_var"], torch.zeros(2, dtype=torch.float64))
    for k in ("0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean"):
        assert torch.equal(got[k], w[k] - 10), k  # below 0, as the mean put them
    assert torch.equal(got[COUNT], w[COUNT] - 10)


@pytest.mark.parametrize("increments", [False, True])
def test_integer_buffers_leave_a_client_only_outside_private_uploads(increments: bool) -> None:
    algo = FedFull.of(upload_increments=increments, freeze=("0.bias",))
    model = _model()
    state = algo.init_server(model, torch.Generator())
    want = {k for k in model.state_dict() if k != "0.bias" and not (increments and k == COUNT)}
    assert set(algo.expected_reply(state, 0)) == {f"update.{k}" for k in want}
    start, _ = algo.dense_start(algo.broadcast(state, 0, 0), None, model)
    assert set(algo.dense_delta(model, start)) == want
    assert algo.uploads("x", torch.float16) and not algo.uploads("0.bias", torch.float32)
    assert algo.uploads(COUNT, torch.int64) is not increments


def test_the_client_loads_the_broadcast_keeps_its_frozen_tensors_and_uploads_w_k_minus_w_t() -> (
    None
):
    algo = FedFull.of(freeze=("0.bias",))
    server = algo.init_server(_model(), torch.Generator())
    w = algo.global_arrays(server)
    client = _model(torch.float32)  # another model: the client's own copy
    start, keep = algo.dense_start(algo.broadcast(server, 0, 0), None, client)
    assert set(start) == set(w) and all(torch.equal(start[k], w[k]) for k in w)
    assert all(torch.equal(client.state_dict()[k], w[k].float()) for k in w)  # loaded
    assert set(keep.arrays) == {"cache.0.bias"} and keep.values == {}
    assert torch.equal(keep.arrays["cache.0.bias"], w["0.bias"])
    linear = client[0]
    assert isinstance(linear, nn.Linear)
    assert not linear.bias.requires_grad and linear.weight.requires_grad
    # the second round: the frozen bias comes from the cache
    start2, _ = algo.dense_start(
        Broadcast(algo.broadcast(State(server.arrays, {"seen.0": 1}), 1, 0).arrays, {}),
        keep,
        client,
    )
    assert set(start2) == set(w)
    _, none_kept = FedFull.of().dense_start(algo.broadcast(server, 0, 0), None, _model())
    assert none_kept.arrays == {} and none_kept.values == {}
    with torch.no_grad():
        linear.weight.add_(1.5)
    delta = algo.dense_delta(client, start)  # start is float64, the model float32
    assert set(delta) == set(w) - {"0.bias"}
    assert delta["0.weight"].dtype == torch.float32
    assert torch.equal(delta["0.weight"], linear.weight.detach() - w["0.weight"].float())
    assert torch.equal(delta["1.weight"], torch.zeros(2))
    assert all(v.is_contiguous() for v in delta.values())
    up = algo.dense_update(client, start)
    assert set(up) == {f"update.{k}" for k in delta}
    assert all(torch.equal(up[f"update.{k}"], v) for k, v in delta.items())
    half = FedFull.of(transport_dtype="bf16").dense_update(client, start)
    assert (
        half["update.0.weight"].dtype == torch.bfloat16
        and half[f"update.{COUNT}"].dtype == torch.int64
    )


@pytest.mark.parametrize(("n", "f"), [(3, 0), (6, 0), (7, 1), (10, 1), (11, 2), (15, 2)])
def test_bulyan_with_too_few_replies_runs_with_the_largest_f_it_tolerates(n: int, f: int) -> None:
    """El Mhamdi et al. 2018: Bulyan needs n >= 4f + 3."""
    algo = FedFull.of(robust_aggregate="bulyan", num_byzantine=2)
    g = torch.Generator().manual_seed(n)
    ups = [{"w": torch.randn(5, generator=g, dtype=torch.float64)} for _ in range(n)]
    weights = [float(i + 1) for i in range(n)]
    got = algo.combine_deltas(ups, weights)
    assert torch.equal(got["w"], combine_updates(ups, weights, "bulyan", 0.1, f)["w"])


def test_other_rules_take_the_settings_as_given() -> None:
    g = torch.Generator().manual_seed(0)
    ups = [{"w": torch.randn(4, generator=g, dtype=torch.float64)} for _ in range(7)]
    weights = [float(i + 1) for i in range(7)]
    for rule, kw in (
        ("krum", {"num_byzantine": 2}),
        ("multi_krum", {"num_byzantine": 1, "multi_krum_keep": 3}),
        ("trimmed_mean", {"trim_fraction": 0.3}),
        ("median", {}),
        ("mean", {}),
    ):
        algo = FedFull.of(robust_aggregate=rule, **kw)
        t = algo.train
        want = combine_updates(
            ups, weights, rule, t.trim_fraction, t.num_byzantine, t.multi_krum_keep
        )
        assert torch.equal(algo.combine_deltas(ups, weights)["w"], want["w"]), rule


def test_a_step_of_another_dtype_is_cast_to_the_global_tensors() -> None:
    """pFedMe's step ``beta · mean Δ`` (Dinh et al. 2020, Algorithm 1 line 12) is a float for
    BatchNorm's integer batch count: the global model keeps its dtypes."""
    algo = PFedMe.of(beta=0.5)
    state = algo.init_server(_model(torch.float32), torch.Generator())
    w = algo.global_arrays(state)
    d = _deltas(w, 3)
    new, _ = algo.aggregate(state, [(0, _reply(d, 2))], 0)
    got = algo.global_arrays(new)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in w.items()}
    assert torch.equal(got[COUNT], w[COUNT] + 1)  # 0.5 · 3 = 1.5, cast to the int64 count
    assert torch.equal(got["0.weight"], w["0.weight"] + 0.5 * d["0.weight"])


def test_mean_update_is_given_the_global_tensors_by_plain_name() -> None:
    """Methods that combine some tensors on the clients' absolute values ``W^t + Δ_i`` (FedBayes'
    posteriors) read ``W^t`` from ``mean_update``'s ``model``."""
    seen: list[dict[str, torch.Tensor]] = []

    class Recording(FedFull):
        def mean_update(
            self,
            model: dict[str, torch.Tensor],
            updates: list[dict[str, torch.Tensor]],
            weights: list[float],
        ) -> dict[str, torch.Tensor]:
            seen.append(model)
            return super().mean_update(model, updates, weights)

    algo = Recording()
    state = algo.init_server(_model(), torch.Generator())
    w = algo.global_arrays(state)
    algo.aggregate(state, [(0, _reply(_deltas(w, 1), 1))], 0)
    (model,) = seen
    assert set(model) == set(w) and all(torch.equal(model[k], w[k]) for k in w)
