"""fedlore.robust on hand-computed cases: the upload norm, the median norm screen (its median,
its threshold, when it abstains, the reason it gives) and the coordinate-wise median and trimmed
mean of Yin et al. 2018 (what is trimmed, in what precision, which tensors pass through)."""

from __future__ import annotations

import math

import pytest
import torch

from fedlore.robust import MIN_SCREENED, combine_updates, norm_screen, upload_norm
from fedlore.types import Reply


def _reply(norm: float) -> Reply:
    """A reply whose upload has Euclidean norm ``norm`` exactly (one float64 entry)."""
    return Reply(arrays={"w": torch.tensor([norm], dtype=torch.float64)})


def test_upload_norm_counts_every_floating_upload_but_diagnostics() -> None:
    """sqrt of the sum of squares over all floating arrays, whatever their dtype, in float64
    (300² overflows float16); integer arrays and ``diag.*`` measurements do not count."""
    reply = Reply(
        arrays={
            "diag.grad_norm": torch.tensor([1e6]),  # skipped, wherever it is in the upload
            "w": torch.tensor([3.0, 4.0]),
            "h": torch.tensor([300.0], dtype=torch.float16),
            "d": torch.tensor([[12.0]], dtype=torch.float64),
            "idx": torch.tensor([1000]),
            "mask": torch.tensor([True]),
            "diag.loss": torch.tensor([5.0]),
        }
    )
    assert upload_norm(reply) == pytest.approx(math.sqrt(9 + 16 + 300**2 + 144), rel=1e-12)
    assert upload_norm(Reply(arrays={"w": torch.zeros(3)})) == 0.0
    assert upload_norm(Reply()) == 0.0


def test_a_tiny_upload_norm_is_not_lost_in_float32() -> None:
    """The squares are summed in float64: 1e-30 squared underflows float32 but not float64."""
    reply = Reply(arrays={"w": torch.tensor([3e-30, 4e-30])})
    assert upload_norm(reply) == pytest.approx(5e-30, rel=1e-6)


def test_norm_screen_rejects_above_multiple_times_the_odd_median() -> None:
    """Odd count: the median is the middle norm (2 of 1, 1.5, 2, 20, 50); a reply is rejected
    only when its norm exceeds ``multiple`` x median (20 = 10 x 2 stays)."""
    replies = {i: _reply(n) for i, n in enumerate([20.0, 1.0, 50.0, 1.5, 2.0])}
    assert set(norm_screen(replies, 10.0)) == {2}
    assert set(norm_screen(replies, 9.99)) == {0, 2}
    assert norm_screen(replies, 25.0) == {}


def test_norm_screen_takes_the_mean_of_the_two_middle_norms_for_an_even_count() -> None:
    """Even count: the median of 1, 2, 4, 25 is (2 + 4) / 2 = 3, and the reason says so."""
    replies = {7: _reply(25.0), 3: _reply(2.0), 5: _reply(1.0), 9: _reply(4.0)}
    rejected = norm_screen(replies, 8.0)  # 25 > 24 = 8 x 3
    assert set(rejected) == {7}
    assert rejected[7] == ("upload norm 25 is 8.33x the round's median 3 (robust.norm_screen=8)")
    assert norm_screen(replies, 8.4) == {}  # 25 <= 25.2 = 8.4 x 3 (a median of 2 would reject)
    assert set(norm_screen(replies, 6.0)) == {7}  # 25 > 18 (a median of 4 would keep it)


def test_norm_screen_abstains_when_it_cannot_judge() -> None:
    """No screen without a multiple, with fewer than MIN_SCREENED (3) replies, or when the
    median norm is 0 (most uploads empty: every ratio would be infinite)."""
    assert MIN_SCREENED == 3
    two = {0: _reply(1.0), 1: _reply(1e9)}
    assert norm_screen(two, 2.0) == {}
    three = {**two, 2: _reply(1.0)}
    assert set(norm_screen(three, 2.0)) == {1}  # three is enough
    assert norm_screen(three, None) == {}
    zeros = {0: _reply(0.0), 1: _reply(0.0), 2: _reply(5.0)}
    assert norm_screen(zeros, 2.0) == {}


def test_median_is_coordinatewise_and_unweighted() -> None:
    """Each coordinate's own median (odd N: the middle value; even N: the mean of the two
    middle ones), ignoring the weights; shapes and dtypes kept."""
    ups = [
        {"w": torch.tensor([[1.0, 9.0], [5.0, -1.0]])},
        {"w": torch.tensor([[3.0, 7.0], [4.0, -3.0]])},
        {"w": torch.tensor([[2.0, 8.0], [6.0, -2.0]])},
    ]
    out = combine_updates(ups, [100.0, 1.0, 1.0], "median")["w"]
    assert out.shape == (2, 2) and out.dtype == torch.float32
    assert torch.equal(out, torch.tensor([[2.0, 8.0], [5.0, -2.0]]))
    four = [*ups, {"w": torch.tensor([[10.0, 0.0], [0.0, 10.0]])}]
    out4 = combine_updates(four, [1.0] * 4, "median")["w"]
    assert torch.equal(out4, torch.tensor([[2.5, 7.5], [4.5, -1.5]]))


def test_trimmed_mean_drops_floor_trim_n_at_each_end() -> None:
    """N = 5, trim 0.25: floor(1.25) = 1 value dropped at each end per coordinate, the mean of
    the 3 left; trim 0.15: floor(0.75) = 0, the plain (unweighted) mean of all 5; trim 0.4:
    2 at each end, the median."""
    values = [1.0, 2.0, 4.0, 8.0, 100.0]
    ups = [{"w": torch.tensor([v, -v])} for v in values]
    w = [5.0, 1.0, 1.0, 1.0, 1.0]
    trimmed = combine_updates(ups, w, "trimmed_mean", 0.25)["w"]
    assert torch.allclose(trimmed, torch.tensor([14 / 3, -14 / 3]))
    untrimmed = combine_updates(ups, w, "trimmed_mean", 0.15)["w"]
    assert torch.allclose(untrimmed, torch.tensor([23.0, -23.0]))
    assert torch.equal(combine_updates(ups, w, "trimmed_mean", 0.4)["w"], torch.tensor([4.0, -4.0]))
    assert torch.equal(combine_updates(ups, w, "trimmed_mean", 0.0)["w"], untrimmed)


def test_robust_rules_compute_in_float64_and_cast_back() -> None:
    """float16 deltas near the float16 maximum: their sum overflows float16 (the mean of the
    two middle values of an even count, the trimmed mean), not in float64; the results stay
    float16. A float64 delta keeps its precision."""
    big = [{"h": torch.tensor([60000.0, 60000.0], dtype=torch.float16)} for _ in range(4)]
    for rule in ("median", "trimmed_mean"):
        out = combine_updates(big, [1.0] * 4, rule, 0.0)["h"]
        assert out.dtype == torch.float16 and torch.equal(out, big[0]["h"]), rule
    fine = [{"d": torch.tensor([1.0 + k * 1e-12], dtype=torch.float64)} for k in range(3)]
    mean = combine_updates(fine, [1.0] * 3, "trimmed_mean", 0.0)["d"]
    assert mean.dtype == torch.float64 and float(mean) == pytest.approx(1.0 + 1e-12, abs=1e-15)


def test_integer_tensors_come_from_the_first_update() -> None:
    """Non-floating tensors (e.g. BatchNorm's counter) are not combined: the first client's,
    copied."""
    ups = [
        {"n": torch.tensor([3]), "w": torch.tensor([1.0])},
        {"n": torch.tensor([9]), "w": torch.tensor([2.0])},
        {"n": torch.tensor([5]), "w": torch.tensor([3.0])},
    ]
    for rule in ("median", "trimmed_mean"):
        out = combine_updates(ups, [1.0] * 3, rule)
        assert torch.equal(out["n"], torch.tensor([3])) and out["n"] is not ups[0]["n"]
        assert torch.equal(out["w"], torch.tensor([2.0]))


def test_mean_rule_is_the_weighted_mean() -> None:
    """``mean``: Σ p_i Δ_i / Σ p_i (weights matter, unlike the robust rules)."""
    ups = [{"w": torch.tensor([1.0])}, {"w": torch.tensor([4.0])}]
    assert torch.allclose(combine_updates(ups, [3.0, 1.0])["w"], torch.tensor([1.75]))


def test_bad_rules_and_trims_are_refused() -> None:
    """Unknown rule, trim outside [0, 0.5) and no update at all are errors."""
    ups = [{"w": torch.tensor([1.0])}]
    with pytest.raises(ValueError, match="unknown aggregate 'mode'"):
        combine_updates(ups, [1.0], "mode")
    for trim in (-0.01, 0.5):
        with pytest.raises(ValueError, match=r"trim_fraction must be in \[0, 0.5\)"):
            combine_updates(ups, [1.0], "trimmed_mean", trim)
    assert torch.equal(combine_updates(ups, [1.0], "trimmed_mean", 0.49)["w"], ups[0]["w"])
    for rule in ("median", "trimmed_mean"):
        with pytest.raises(ValueError, match=r"^combine_updates needs at least one update$"):
            combine_updates([], [], rule)


# ---------------------------------------------------------------- Krum, Multi-Krum, Bulyan
def _updates(n: int, seed: int = 0, outliers: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        scale = 50.0 if i < outliers else 1.0
        out.append({
            "w": scale * torch.randn(3, 4, generator=g, dtype=torch.float64),
            "b": scale * torch.randn(4, generator=g, dtype=torch.float64),
        })  # fmt: skip
    return out


def _to_flwr(updates: list[dict[str, torch.Tensor]], weights: list[float]) -> list:
    return [
        ([u["w"].numpy(), u["b"].numpy()], int(w)) for u, w in zip(updates, weights, strict=True)
    ]


@pytest.mark.parametrize(("n", "f", "keep"), [(7, 2, 0), (10, 1, 0), (7, 2, 3), (12, 3, 5)])
def test_krum_and_multi_krum_equal_flowers(n: int, f: int, keep: int) -> None:
    """Identical inputs through flwr's ``aggregate_krum`` (``to_keep`` 0: Krum; m: Multi-Krum,
    a num_examples-weighted mean of the m lowest scores) and ours."""
    from flwr.server.strategy.aggregate import aggregate_krum

    ups = _updates(n, seed=n + f, outliers=f)
    weights = [float(3 + (i * 7) % 11) for i in range(n)]
    want = aggregate_krum(_to_flwr(ups, weights), num_malicious=f, to_keep=keep)
    rule = "multi_krum" if keep else "krum"
    got = combine_updates(ups, weights, rule, num_byzantine=f, keep=keep or None)
    err = max(float((got["w"] - torch.from_numpy(want[0])).abs().max()),
              float((got["b"] - torch.from_numpy(want[1])).abs().max()))  # fmt: skip
    assert err < 1e-12
    if not keep:  # Krum returns one client's update, never an outlier's
        assert any(torch.equal(got["w"], u["w"]) for u in ups[f:])


@pytest.mark.parametrize(("n", "f"), [(7, 1), (11, 2), (15, 3), (8, 1)])
def test_bulyan_equals_flowers(n: int, f: int) -> None:
    from flwr.server.strategy.aggregate import aggregate_bulyan, aggregate_krum

    ups = _updates(n, seed=100 + n, outliers=f)
    weights = [1.0] * n
    want = aggregate_bulyan(_to_flwr(ups, weights), num_malicious=f,
                            aggregation_rule=aggregate_krum, to_keep=0)  # fmt: skip
    got = combine_updates(ups, weights, "bulyan", num_byzantine=f)
    err = max(float((got["w"] - torch.from_numpy(want[0])).abs().max()),
              float((got["b"] - torch.from_numpy(want[1])).abs().max()))  # fmt: skip
    assert err < 1e-12
    # the outliers (50x) leave no trace: every coordinate is within the honest ones' range
    honest = torch.stack([u["w"] for u in ups[f:]])
    assert bool(
        (got["w"] <= honest.max(0).values).all() and (got["w"] >= honest.min(0).values).all()
    )


def test_krum_scores_by_hand() -> None:
    """Four one-dimensional updates 0, 1, 3, 10 with f = 1: n - f - 2 = 1 nearest neighbour, so
    the scores are the squared distance to the nearest other: 1, 1, 4, 49; Krum picks 0 (the
    tie goes to the earlier client)."""
    from fedlore.robust import krum_scores

    ups = [{"x": torch.tensor([v], dtype=torch.float64)} for v in (0.0, 1.0, 3.0, 10.0)]
    assert krum_scores(ups, 1) == [1.0, 1.0, 4.0, 49.0]
    assert float(combine_updates(ups, [1.0] * 4, "krum", num_byzantine=1)["x"]) == 0.0
    two = combine_updates(ups, [1.0, 3.0, 1.0, 1.0], "multi_krum", num_byzantine=1, keep=2)
    assert float(two["x"]) == pytest.approx(0.75)  # (1·0 + 3·1) / 4
    with pytest.raises(ValueError, match="4f \\+ 3"):
        combine_updates(ups, [1.0] * 4, "bulyan", num_byzantine=1)


def test_configs_that_cannot_tolerate_f_are_refused() -> None:
    from fedlore.config import ConfigError, load_config
    from fedlore.experiment_parts import make_algorithm

    with pytest.raises(ConfigError, match="4f \\+ 3"):
        make_algorithm("fedavg", load_config(None, ["num_clients=10", "robust.aggregate=bulyan",
                                                    "robust.num_byzantine=2"]))  # fmt: skip
    with pytest.raises(ConfigError, match="2f \\+ 2"):
        make_algorithm("fedavg", load_config(None, ["num_clients=4", "robust.aggregate=krum",
                                                    "robust.num_byzantine=1"]))  # fmt: skip
    with pytest.raises(ConfigError, match="offers no robust combination of its uploads"):
        make_algorithm("fedlore", load_config(None, ["robust.aggregate=krum"]))
    # secure aggregation: the server sees only the sum, so no client's delta can be compared
    secure = ["robust.aggregate=multi_krum", "secure_aggregation=true", "weighting=uniform"]
    with pytest.raises(ConfigError, match="needs each client's upload"):
        make_algorithm("fedavg", load_config(None, secure))


@pytest.mark.parametrize("method", ["qffl", "scaffold", "fednova", "feddyn", "fedlore"])
def test_a_method_override_of_the_robust_aggregate_is_refused_like_the_run_wide_one(
    method: str,
) -> None:
    """``method.<name>.robust_aggregate`` is what that method's server would use, so a method
    without a robust combination refuses it as it refuses ``robust.aggregate`` (q-FFL's server
    used to run with it, a median where the docs say it is refused)."""
    from fedlore.config import ConfigError, load_config
    from fedlore.experiment_parts import make_algorithm

    cfg = load_config(None, [f"method.{method}.robust_aggregate=median"])
    with pytest.raises(ConfigError, match=rf"method\.{method}\.robust_aggregate=median: method"):
        make_algorithm(method, cfg)


def test_method_overrides_of_the_robust_settings_are_checked_as_the_run_wide_ones() -> None:
    from fedlore.config import ConfigError, load_config
    from fedlore.experiment_parts import make_algorithm

    over = ["num_clients=4", "method.fedavg.robust_aggregate=krum", "method.fedavg.num_byzantine=1"]
    with pytest.raises(ConfigError, match=r"method\.fedavg\.num_byzantine=1 needs more"):
        make_algorithm("fedavg", load_config(None, over))
    # the run-wide rule with the method's own f, and the method's own rule with the run-wide f
    mixed = ["num_clients=4", "robust.aggregate=krum", "method.fedavg.num_byzantine=1"]
    with pytest.raises(ConfigError, match="2f \\+ 2"):
        make_algorithm("fedavg", load_config(None, mixed))
    bulyan = ["num_clients=10", "method.fedavg.robust_aggregate=bulyan", "robust.num_byzantine=2"]
    with pytest.raises(ConfigError, match=r"method\.fedavg\.robust_aggregate=bulyan with robust"):
        make_algorithm("fedavg", load_config(None, bulyan))
    topk = ["method.fedavg.robust_aggregate=median", "method.fedavg.compression=topk"]
    with pytest.raises(ConfigError, match="zero almost everywhere"):
        make_algorithm("fedavg", load_config(None, topk))
    # allowed where the method has a robust combination: fedavg with its own median runs
    make_algorithm("fedavg", load_config(None, ["method.fedavg.robust_aggregate=median"]))
