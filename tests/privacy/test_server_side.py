"""The server's side of a private round, setting by setting (fedlore.privacy.Privacy).

Every number the server derives is checked at values where a wrong formula shows (a clip norm
of 2.5, not 1): the noise-share size from the survivor threshold and the colluders, the
fixed point's entry bound, the Shamir threshold of a ring, ε with setup exchanges and the chosen
accountant, the noise std on the sum and the adaptive clip step. Then the round's edges: every
client dropped, a contributor after a dropout, an aborted round, a mean of the wrong length,
results on the model's device, the clip norm carried through a checkpoint's state. A recording
noise source shows which draws the server makes.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedlore.privacy import ClipNorm, DPSettings, Privacy, epsilon_spent
from fedlore.privacy.aggregation import CLIP_KEY, NOISE_TAIL
from fedlore.privacy.client import ReplySpec
from fedlore.privacy.randomness import SERVER, SERVER_COUNT
from fedlore.types import Broadcast, Reply, Scalars, State

SPEC: ReplySpec = {"update.w": ((4,), torch.float64)}
C, Z = 2.5, 1.5


class Recording:
    """Noise that is ``value`` everywhere; records (n, std, round, stream) of each call."""

    secure = True

    def __init__(self, value: float = 0.0) -> None:
        self.value = value
        self.calls: list[tuple[int, float, int, int]] = []

    def gaussian(self, n: int, std: float, rnd: int, client: int) -> torch.Tensor:
        self.calls.append((n, std, rnd, client))
        return torch.full((n,), self.value, dtype=torch.float64, device="cpu")

    def sample(self, num_clients: int, per_round: int, rnd: int) -> list[int]:
        return list(range(per_round))


def _dp(accountant: str = "rdp") -> DPSettings:
    return DPSettings(clip_norm=C, noise_multiplier=Z, delta=1e-5, accountant=accountant)


def _privacy(secure: bool = False, **kw: object) -> Privacy:
    args: dict[str, object] = {"noise": Recording()}
    args.update(kw)
    dp = args.pop("dp", _dp())
    return Privacy(secure, dp, True, 20, 6, 0, 7, **args)  # type: ignore[arg-type]


def test_noise_shares_cover_the_honest_survivors() -> None:
    """6 sampled, 4 must survive, 1 colludes: 3 honest shares of std σC/√3 make σC."""
    p = _privacy(secure=True, threshold=4, colluders=1)
    assert p.min_survivors(6) == 4
    assert p.noise_share(6) == pytest.approx(Z * C / math.sqrt(3))
    assert _privacy(secure=True, threshold=4, colluders=3).noise_share(6) == pytest.approx(Z * C)
    with pytest.raises(
        ValueError,
        match=r"^dp\.colluding_clients=4 leaves no honest survivor in a round that completes "
        r"with 4 clients$",
    ):
        _privacy(secure=True, threshold=4, colluders=4).noise_share(6)
    assert _privacy(secure=False).noise_share(6) == 0.0  # DP alone: the server adds it
    assert Privacy(True, None, True, 20, 6, 0, 7).noise_share(6) == 0.0


def test_the_entry_bound_covers_the_clip_and_the_shares_tail() -> None:
    p = _privacy(secure=True, threshold=4)
    assert p.entry_bound_of(6) == pytest.approx(C + NOISE_TAIL * Z * C / 2)
    # adaptive clipping: the noised bit's tail can be the larger one
    clip = ClipNorm(0.05, 0.5, 0.2, 3.0)
    small = DPSettings(clip_norm=0.05, noise_multiplier=0.1, delta=1e-5)
    q = _privacy(secure=True, threshold=4, dp=small, clip=clip)
    assert q.count_share(6) == pytest.approx(1.5)  # σ_b / sqrt(4 honest survivors)
    assert q.entry_bound_of(6) == pytest.approx(1.0 + NOISE_TAIL * 1.5)
    r = _privacy(secure=False, dp=small, clip=ClipNorm(0.05, 0.5, 0.2, 2.0))
    assert r.entry_bound_of(6) == pytest.approx(0.05)  # DP alone: no shares, no bit
    assert (
        Privacy(True, None, True, 20, 6, 0, 7, entry_bound=1.0).fixed_point(4).fraction_bits == 60
    )


def test_the_ring_is_public_per_run_and_round_and_its_threshold_counts_holders() -> None:
    """The SecAgg+ ring: the same for the same run seed and round, another in another round
    or run; a degree-2 ring has holder sets of 3, so two thirds is t = 2."""
    p = Privacy(True, None, True, 20, 6, 0, 7, mask_degree=2)
    ids = [5, 1, 3, 0, 2, 4]
    assert p.neighbours(3, ids) == p.neighbours(3, sorted(ids))
    assert p.neighbours(3, ids) != p.neighbours(4, ids)
    other = Privacy(True, None, True, 20, 6, 0, 8, mask_degree=2)
    assert any(other.neighbours(r, ids) != p.neighbours(r, ids) for r in range(3))
    params = p.round_params(3, ids)
    assert params.threshold == 2 and params.min_survivors == 4
    assert all(len(params.holders(c)) == 3 for c in ids)


def test_a_plan_counts_underflow_only_without_dp() -> None:
    assert Privacy(True, None, True, 20, 6, 0, 7).plan(0, list(range(6)), SPEC).counts
    assert not _privacy(secure=True).plan(0, list(range(6)), SPEC).counts


def test_configure_keeps_the_broadcast_and_adds_the_settings() -> None:
    arrays = {"model.w": torch.ones(2)}
    out = Privacy(True, None, False, 20, 2, 0, 7).configure(1, {0: Broadcast(arrays, {"a": 1})})
    assert out[0].arrays is arrays
    assert out[0].config == {
        "a": 1,
        "privacy.secure": True,
        "privacy.uniform": False,
        "privacy.clip_norm": 0.0,
        "privacy.sketch_share": 0.5,
        "privacy.noise_share": 0.0,
        "privacy.reproducible": False,
    }
    dp = DPSettings(clip_norm=C, noise_multiplier=Z, delta=1e-5, sketch_share=0.3)
    assert _privacy(dp=dp).configure(0, {0: Broadcast()})[0].config["privacy.sketch_share"] == 0.3
    seeded = _privacy(noise=type("S", (), {"secure": False})())
    assert seeded.configure(1, {0: Broadcast()})[0].config["privacy.reproducible"] is True


def test_the_screen_holds_uploads_to_the_clip_norm() -> None:
    p = _privacy()
    at = Reply({"update.w": torch.tensor([C * (1 + 1e-5), 0.0], dtype=torch.float64)}, {})
    over = Reply({"update.w": torch.tensor([C * 1.5, 0.0], dtype=torch.float64)}, {})
    assert p.screen(at) is None
    assert p.screen(over) == "upload norm 3.75 exceeds the clip norm 2.5"
    assert _privacy(secure=True).screen(over) is None  # masked: nothing to screen
    assert Privacy(False, None, True, 20, 6, 0, 7).screen(over) is None


def test_epsilon_counts_setup_exchanges_with_the_chosen_accountant() -> None:
    for accountant in ("rdp", "pld"):
        p = Privacy(False, _dp(accountant), True, 20, 20, 1, 7)
        assert p.epsilon(2) == epsilon_spent(Z, 1e-5, 4, 20, 20, accountant=accountant)
    assert Privacy(False, _dp("pld"), True, 20, 20, 0, 7).epsilon(0) < Privacy(
        False, _dp("rdp"), True, 20, 20, 0, 7
    ).epsilon(0)


def _uploads(*values: float) -> list[tuple[int, Reply | None]]:
    return [
        (c, Reply({"update.w": torch.full((4,), v, dtype=torch.float64)}, {"train_s": 0.5}))
        for c, v in enumerate(values)
    ]


def test_dp_alone_noises_the_sum_by_z_times_c_on_the_server() -> None:
    noise = Recording(0.5)
    p = _privacy(noise=noise)
    out, metrics = p.combine(2, SPEC, _uploads(1.0, 2.0 + 1e-9), torch.device("cpu"))
    assert noise.calls == [(4, Z * C, 2, SERVER)]
    mean = out[0][1].arrays["update.w"]  # type: ignore[union-attr]
    assert mean.dtype == torch.float64
    assert torch.equal(mean, torch.full((4,), (3.0 + 1e-9 + 0.5) / 2, dtype=torch.float64))
    assert metrics["dp_clipped"] == 0 and metrics["dp_clip_norm"] == C
    assert out[1][1].metrics == {"train_s": 0.5, "num_examples": 1}  # type: ignore[union-attr]
    with pytest.raises(
        ValueError, match=r"^a secure round's sum comes from the transport's send_secure$"
    ):
        _privacy(secure=True).combine(0, SPEC, _uploads(1.0), torch.device("cpu"))


def test_adaptive_dp_alone_noises_the_count_and_takes_the_exact_step() -> None:
    """Two of three unclipped, count noise 0.25: b̃ = 2.25 / 3; C moves by exp(−η (b̃ − γ))."""
    noise = Recording(0.25)
    clip = ClipNorm(C, 0.5, 0.3, 4.0)
    p = _privacy(noise=noise, clip=clip)
    ups = _uploads(1.0, 1.0, 1.0)
    ups[2] = (2, Reply(ups[2][1].arrays, {"dp_clipped": 1}))  # type: ignore[union-attr]
    _, metrics = p.combine(5, SPEC, ups, torch.device("cpu"))
    assert noise.calls[1] == (1, 4.0, 5, SERVER_COUNT)
    assert metrics["dp_unclipped_fraction"] == pytest.approx(2.25 / 3)
    assert metrics["dp_clipped"] == 1 and metrics["dp_clip_norm"] == C
    assert p.clip_norm == pytest.approx(C * math.exp(-0.3 * (2.25 / 3 - 0.5)))


def test_a_round_with_every_client_dropped_reports_epsilon_and_moves_nothing() -> None:
    p = _privacy()
    out, metrics = p.combine(3, SPEC, [(0, None), (4, None)], torch.device("cpu"))
    assert out == [(0, None), (4, None)]
    known = p.epsilon(3, sample_known=True)  # 6 of 20 sampled: no amplification, larger
    assert known > p.epsilon(3)
    assert metrics == {
        "dp_epsilon": p.epsilon(3),
        "dp_epsilon_sample_known": known,
        "dp_clip_norm": C,
    }


def test_from_mean_keeps_every_contributor_after_a_dropout() -> None:
    p = Privacy(True, None, True, 20, 3, 0, 7)
    mean = torch.tensor([1.0, 2.0, 3.0, 4.0])
    clear: dict[int, Scalars] = {0: {"train_s": 0.1, "loss": 9.0}, 2: {"train_s": 0.3}}
    out, metrics = p.from_mean(0, SPEC, mean, clear, [0, 1, 2], torch.device("cpu"))
    assert [c for c, r in out if r is not None] == [0, 2] and out[1] == (1, None)
    assert out[0][1].metrics == {"train_s": 0.1, "num_examples": 1}  # type: ignore[union-attr]
    assert out[2][1].arrays["update.w"].dtype == torch.float64  # type: ignore[union-attr]
    assert metrics == {"secagg_dropped": 1}
    with pytest.raises(ValueError, match=r"^secure mean has 3 entries, expected 4$"):
        p.from_mean(0, SPEC, mean[:3], clear, [0, 1, 2], torch.device("cpu"))
    adaptive = _privacy(secure=True, clip=ClipNorm(C, 0.5, 0.2, 4.0))
    with pytest.raises(ValueError, match=r"^secure mean has 4 entries, expected 5$"):
        adaptive.from_mean(0, SPEC, mean, clear, [0, 1, 2], torch.device("cpu"))


def test_an_adaptive_round_without_contributors_leaves_the_clip_alone() -> None:
    p = _privacy(secure=True, clip=ClipNorm(C, 0.5, 0.2, 4.0))
    out, _ = p.from_mean(0, SPEC, torch.zeros(5), {}, [0, 1], torch.device("cpu"))
    assert out == [(0, None), (1, None)] and p.clip_norm == C


def test_results_land_on_the_models_device_from_any_device() -> None:
    """The mean handed to the method is on the server model's device (here ``meta``),
    whatever device the secure mean came from and whatever torch's default device is."""
    p = _privacy()
    dev = torch.device("meta")
    out, _ = p.combine(0, SPEC, _uploads(1.0), dev)
    assert out[0][1].arrays["update.w"].device == dev  # type: ignore[union-attr]
    q = Privacy(True, None, True, 20, 3, 0, 7)
    out, _ = q.from_mean(0, SPEC, torch.ones(4), {0: {}}, [0], dev)
    assert out[0][1].arrays["update.w"].device == dev  # type: ignore[union-attr]
    ups = _uploads(1.0, 3.0)
    with torch.device("meta"):
        out, _ = p.combine(0, SPEC, ups, torch.device("cpu"))
    assert out[0][1].arrays["update.w"].tolist() == [2.0] * 4  # type: ignore[union-attr]


def test_an_aborted_round_reports_it_with_epsilon() -> None:
    p = _privacy()
    assert p.aborted(2, [1, 2, 3]) == {
        "secagg_dropped": 3,
        "secagg_aborted": 1,
        "dp_epsilon": p.epsilon(2),
        "dp_epsilon_sample_known": p.epsilon(2, sample_known=True),
        "dp_clip_norm": C,
    }
    everyone = Privacy(False, _dp(), True, 6, 6, 0, 7, noise=Recording())  # all sampled: one ε
    assert "dp_epsilon_sample_known" not in everyone.aborted(2, [1, 2, 3])
    plain = Privacy(True, None, True, 20, 6, 0, 7)
    assert plain.aborted(0, [1]) == {"secagg_dropped": 1, "secagg_aborted": 1}


def test_the_adaptive_clip_norm_travels_in_the_server_state() -> None:
    arrays = {"model.w": torch.ones(1)}
    state = State(arrays, {"other": 1})
    fixed = _privacy()
    assert fixed.record(state) is state
    p = _privacy(clip=ClipNorm(C, 0.5, 0.2, 4.0))
    p.clip.value = 3.25  # type: ignore[union-attr]
    saved = p.record(state)
    assert saved.arrays is arrays and saved.values == {"other": 1, CLIP_KEY: 3.25}
    q = _privacy(clip=ClipNorm(C, 0.5, 0.2, 4.0))
    q.restore(saved)
    assert q.clip_norm == 3.25
    q.restore(state)  # no recorded value: unchanged
    assert q.clip_norm == 3.25
    fixed.restore(saved)  # a fixed clip ignores it
    assert fixed.clip_norm == C


def test_rounds_run_again_after_a_resume_count_in_epsilon() -> None:
    """``repeated`` exchanges (released, then run again after a resume) add to the rounds the
    accountant counts, like setup exchanges do."""
    p = _privacy()
    again = Privacy(False, _dp(), True, 20, 6, 0, 7, noise=Recording(), repeated=2)
    assert again.epsilon(3) == p.epsilon(5) > p.epsilon(3)
    assert again.epsilon(3, sample_known=True) == p.epsilon(5, sample_known=True)
