"""Local DP (``dp.mode: local``; fedlore.privacy.local_dp), attacked as a server would attack it.

The adversary is an honest-but-curious server that records every upload it receives, knows the
run seed and can rerun a client's training (the seed names the run folder). Local DP promises it
nothing better than a noised upload:

* the upload that leaves a client is its clipped update plus noise of std σC on every
  coordinate: on 20,000 coordinates the recorded upload minus the true clipped update has that
  std within a 6-sigma bound, mean 0 and a Gaussian shape; noise of σC/2, of σC/√m (central
  DP's share) or added before clipping fails it;
* the noise is not the seed's: two uploads of the same reply differ, and subtracting what the
  seed determines leaves the noise in (under ``dp.reproducible_noise`` the same attack removes
  it exactly: the attack is real);
* the server adds nothing and sees no clip flag; under secure aggregation each client's masked
  contribution carries the whole σC;
* the accountant: one client's ε after k uploads is dp-accounting's ``GaussianDpEvent(σ/2)``
  self-composed k times (RDP, under replace-one), the PLD within 1 % of the exact μ-GDP value
  with μ = 2√k/σ; the reported ``dp_epsilon`` is the worst-off client's, from its own count of
  exchanges, never amplified by sampling; σ solved from a target reaches it and no less σ does;
* central mode is what it was; the settings local DP cannot honour are refused with the reason.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import dp_accounting
import pytest
import torch
from dp_accounting import rdp
from gdp import exact_gdp_epsilon
from pydantic import ValidationError
from scipy import stats

import fedlore.algorithms  # noqa: F401  (registers the methods)
from fedlore import registry
from fedlore.checks import check_privacy
from fedlore.config import ConfigError, DPConfig, load_config
from fedlore.privacy import (
    CLEAR_METRICS,
    DPSettings,
    Privacy,
    SecureSource,
    SeededSource,
    Uploads,
    add_local_noise,
    client_contribution,
    client_noise,
    clip_upload,
    epsilon_spent,
    flatten,
    local_epsilon,
    local_noise_for_epsilon,
    noise_for_epsilon,
    privatize,
)
from fedlore.privacy.client import ReplySpec
from fedlore.privacy.local_dp import UPLOADS_KEY
from fedlore.privacy.randomness import SERVER, SERVER_COUNT
from fedlore.seeding import DP_NOISE, generator
from fedlore.types import Broadcast, Reply, State

SEED = 42
SIGMA, CLIP, DELTA = 1.5, 0.5, 1e-5
L = 20_000
"""Coordinates of the attacked upload: the std of its noise is estimated within 1 % (1σ)."""
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE


class Recording:
    """A secure noise source that records the streams drawn from (zeros for the server)."""

    secure = True

    def __init__(self) -> None:
        self.clients: list[int] = []
        self.real = SecureSource()

    def gaussian(self, n: int, std: float, rnd: int, client: int) -> torch.Tensor:
        self.clients.append(client)
        return self.real.gaussian(n, std, rnd, client)

    def sample(self, num_clients: int, per_round: int, rnd: int) -> list[int]:
        return list(range(per_round))


def _privacy(
    secure: bool = False,
    noise: Any = None,
    num_clients: int = 4,
    per_round: int = 4,
    setup: int = 0,
    sigma: float = SIGMA,
) -> Privacy:
    dp = DPSettings(CLIP, sigma, DELTA)
    src = SecureSource() if noise is None else noise
    return Privacy(secure, dp, True, num_clients, per_round, setup, SEED, noise=src, local=True)


def _reply(n: int = L, scale: float = 0.05, seed: int = 0) -> Reply:  # n even
    """An upload of norm ≈ scale·√n (7 for the default: well above C, so clipping acts)."""
    g = torch.Generator().manual_seed(seed)
    arrays = {
        "update.a": (scale * torch.randn(n // 2, generator=g)).reshape(-1, 2),
        "update.b": scale * torch.randn(n - n // 2, generator=g),
    }
    return Reply(arrays, {"num_examples": 17, "train_loss": 0.3, "train_s": 0.1})


def _clipped(reply: Reply) -> torch.Tensor:
    """What the attacker wants: the client's clipped update (it reruns the client)."""
    arrays, clipped = clip_upload(dict(reply.arrays), CLIP, 0.5)
    assert clipped
    return flatten(arrays)


def _config(privacy: Privacy, rnd: int = 0, m: int = 2) -> dict[str, Any]:
    msgs = privacy.configure(rnd, {c: Broadcast({}, {"round": rnd}) for c in range(m)})
    return dict(msgs[0].config)


def noise_std_ok(residual: torch.Tensor, std: float) -> bool:
    """Whether ``residual`` looks like N(0, std²) per coordinate: its sample std within 6
    standard errors (std/√(2n)) of ``std`` and its mean within 6 of 0."""
    n = residual.numel()
    sd, mean = float(residual.std()), float(residual.mean())
    return abs(sd / std - 1) < 6 / math.sqrt(2 * n) and abs(mean) < 6 * std / math.sqrt(n)


# ------------------------------------------------------------------ the mechanism


def test_the_upload_a_server_records_is_the_clipped_update_plus_noise_of_std_sigma_c() -> None:
    privacy = _privacy()
    reply = _reply()
    config = _config(privacy)
    assert config["privacy.local"] is True and config["privacy.noise_share"] == SIGMA * CLIP
    sent = privatize(reply, config, SecureSource(), 0, 1)
    assert {k: v.dtype for k, v in sent.arrays.items()} == {
        k: v.dtype for k, v in reply.arrays.items()
    }
    assert {k: v.shape for k, v in sent.arrays.items()} == {
        k: v.shape for k, v in reply.arrays.items()
    }
    residual = flatten(sent.arrays) - _clipped(reply)
    assert noise_std_ok(residual, SIGMA * CLIP)
    assert stats.kstest((residual / (SIGMA * CLIP)).numpy(), "norm").pvalue > 1e-4
    # no clip flag and no training loss leave the client: only timings and num_examples = 1
    assert sent.metrics == {"train_s": 0.1, "num_examples": 1}
    assert set(sent.metrics) <= {*CLEAR_METRICS, "num_examples"}


@pytest.mark.parametrize(
    "wrong",
    ["half", "central_share", "before_clipping"],
)
def test_the_noise_check_fails_the_wrong_mechanisms(wrong: str) -> None:
    """The statistical check above is sharp: noise of σC/2, of central DP's share σC/√m (m = 4)
    or added before clipping (then scaled down with the upload) is told apart from σC."""
    reply = _reply()
    truth = _clipped(reply)
    std = SIGMA * CLIP
    if wrong == "before_clipping":
        noisy = {k: v.double() + SecureSource().gaussian(v.numel(), std, 0, 1).reshape(v.shape)
                 for k, v in reply.arrays.items()}  # fmt: skip
        sent = flatten(clip_upload(noisy, CLIP, 0.5)[0])
    else:
        scale = 0.5 if wrong == "half" else 1 / math.sqrt(4)
        sent = truth + SecureSource().gaussian(truth.numel(), std * scale, 0, 1)
    assert not noise_std_ok(sent - truth, std)


def test_the_noise_is_not_the_seeds_and_a_rerun_cannot_remove_it() -> None:
    """The attacker reruns the client (same seed: the same clipped update) and regenerates every
    draw the seed determines for it (``generator(seed, DP_NOISE, round, client)``, the seeded
    source's stream): the residual keeps noise of std σC, and two uploads of the same reply
    differ. Under ``dp.reproducible_noise`` the same attack gives the clipped update back to
    float32 precision."""
    reply = _reply()
    truth = _clipped(reply)
    for reproducible in (False, True):
        privacy = _privacy(noise=SeededSource(SEED) if reproducible else None)
        config = _config(privacy, rnd=3)
        assert config["privacy.reproducible"] is reproducible
        first = privatize(reply, config, client_noise(config, SEED), 3, 1)
        again = privatize(reply, config, client_noise(config, SEED), 3, 1)
        g = generator(SEED, DP_NOISE, 3, 1)
        seeded = SIGMA * CLIP * torch.randn(truth.numel(), generator=g, dtype=torch.float64)
        guess = flatten(first.arrays) - seeded
        if reproducible:
            assert torch.equal(flatten(first.arrays), flatten(again.arrays))
            assert (guess - truth).abs().max().item() < 1e-5
        else:
            assert not torch.equal(flatten(first.arrays), flatten(again.arrays))
            # the seed's draw subtracted adds its own noise: std √2 σC, nothing removed
            assert noise_std_ok(guess - truth, math.sqrt(2) * SIGMA * CLIP)
            assert noise_std_ok(flatten(first.arrays) - truth, SIGMA * CLIP)


class Counting:
    """A noise source whose draw is 0, 1, 2, ... (to see which entry lands where)."""

    secure = True

    def gaussian(self, n: int, std: float, rnd: int, client: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float64)

    def sample(self, num_clients: int, per_round: int, rnd: int) -> list[int]:
        return list(range(per_round))


def test_the_noise_is_one_draw_laid_over_the_arrays_in_sorted_key_order() -> None:
    """Three arrays (given out of order): each gets its own consecutive slice of the one draw,
    in sorted key order, shaped and typed as the array; none shares an entry."""
    arrays = {
        "update.c": torch.zeros(2, dtype=torch.float32),
        "update.a": torch.zeros(3, 2, dtype=torch.float64),
        "update.b": torch.zeros(4, dtype=torch.float32),
    }
    out = add_local_noise(arrays, 1.0, Counting(), 0, 0)
    assert list(out) == list(arrays)
    assert torch.equal(out["update.a"], torch.arange(6, dtype=torch.float64).reshape(3, 2))
    assert torch.equal(out["update.b"], torch.arange(6, 10, dtype=torch.float32))
    assert torch.equal(out["update.c"], torch.arange(10, 12, dtype=torch.float32))


def test_local_dp_needs_the_clients_noise_source() -> None:
    with pytest.raises(ValueError, match="needs its noise source"):
        privatize(_reply(20, scale=1.0), _config(_privacy()))


def test_the_server_adds_no_noise_and_averages_the_noised_uploads() -> None:
    """``combine`` under local DP: the mean of the uploads as they came (no server draw, no
    clip count), each contributor's reply that mean with weight 1."""
    noise = Recording()
    privacy = _privacy(noise=noise)
    config = _config(privacy)
    sent = {c: privatize(_reply(200, seed=c), config, SecureSource(), 0, c) for c in range(4)}
    spec = {k: (tuple(v.shape), v.dtype) for k, v in sent[0].arrays.items()}
    out, metrics = privacy.combine(0, spec, list(sent.items()), torch.device("cpu"))
    assert noise.clients == []  # neither SERVER nor SERVER_COUNT: the server draws nothing
    assert SERVER not in noise.clients and SERVER_COUNT not in noise.clients
    want = torch.stack([flatten(r.arrays) for r in sent.values()]).sum(0) / 4
    for _, r in out:
        assert r is not None and r.num_examples == 1
        assert torch.allclose(flatten(r.arrays), want, atol=1e-6)
    assert "dp_clipped" not in metrics and "dp_epsilon_sample_known" not in metrics
    assert privacy.screen(sent[0]) is None  # noised uploads are far above C: not screened
    assert float(flatten(sent[0].arrays).norm()) > 2 * CLIP


def test_under_secure_aggregation_each_client_masks_its_whole_noise() -> None:
    """Local DP with secure aggregation: the noise share is σC whatever the round's size or
    threshold (not σC/√(m_min)), so the contribution a client masks already carries it."""
    privacy = _privacy(secure=True)
    assert privacy.noise_share(3) == privacy.noise_share(50) == SIGMA * CLIP
    config = _config(privacy, m=5)
    assert config["privacy.secure"] is True and config["privacy.noise_share"] == SIGMA * CLIP
    reply = _reply()
    c = client_contribution(reply, config, 2, 0, SecureSource())
    assert c.weight == 1.0 and c.extras.numel() == 0
    assert noise_std_ok(c.vector - _clipped(reply), SIGMA * CLIP)
    assert privacy.entry_bound_of(5) == pytest.approx(CLIP + 12 * SIGMA * CLIP)


def test_central_mode_is_what_it_was() -> None:
    """Central DP alone: the broadcast has no ``privacy.local`` key, the client sends exactly
    the clipped arrays with its clip flag (bit for bit what ``clip_upload`` gives), the server
    draws its noise on the sum from the server's stream, and ``record`` leaves the state."""
    noise = Recording()
    central = Privacy(False, DPSettings(CLIP, SIGMA, DELTA), True, 4, 4, 0, SEED, noise=noise)
    config = _config(central)
    assert "privacy.local" not in config and config["privacy.noise_share"] == 0.0
    reply = _reply(100, scale=1.0)
    sent = privatize(reply, config, SecureSource(), 0, 1)
    arrays, _ = clip_upload(dict(reply.arrays), CLIP, 0.5)
    assert all(torch.equal(sent.arrays[k], arrays[k]) for k in arrays)
    assert sent.metrics == {"train_s": 0.1, "num_examples": 1, "dp_clipped": 1}
    spec = {k: (tuple(v.shape), v.dtype) for k, v in sent.arrays.items()}
    _, metrics = central.combine(0, spec, [(0, sent), (1, sent)], torch.device("cpu"))
    assert noise.clients == [SERVER] and metrics["dp_clipped"] == 2
    state = State({}, {"x": 1})
    assert central.record(state) is state and central.uploads.counts == {}


# ------------------------------------------------------------------ the accountant


@pytest.mark.parametrize(("sigma", "uploads"), [(1.0, 1), (1.5, 7), (4.0, 30)])
def test_a_clients_epsilon_is_the_gaussian_of_sensitivity_2c_composed_over_its_uploads(
    sigma: float, uploads: int
) -> None:
    """RDP: dp-accounting's ``GaussianDpEvent(σ/2)`` self-composed ``uploads`` times under
    replace-one (sensitivity 2C, noise σC), to the last digit. PLD: within 1 % of the exact
    μ-GDP value, μ = 2√k/σ, never below it; RDP at or above it. A sensitivity of C (the event
    σ) falls well below the exact value."""
    acc = rdp.RdpAccountant(neighboring_relation=REPLACE_ONE)
    acc.compose(
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma / 2), uploads)
    )
    assert local_epsilon(sigma, DELTA, uploads) == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)
    exact = exact_gdp_epsilon(2 * math.sqrt(uploads) / sigma, DELTA)
    pld = local_epsilon(sigma, DELTA, uploads, accountant="pld")
    assert exact * (1 - 1e-6) <= pld <= exact * 1.01
    assert local_epsilon(sigma, DELTA, uploads) >= exact * (1 - 1e-6)
    wrong = rdp.RdpAccountant(neighboring_relation=REPLACE_ONE)
    wrong.compose(dp_accounting.GaussianDpEvent(sigma), uploads)  # sensitivity C
    assert wrong.get_epsilon(DELTA) < 0.8 * exact


def test_no_upload_spends_nothing_and_no_noise_is_infinite() -> None:
    assert local_epsilon(SIGMA, DELTA, 0) == 0.0
    assert local_epsilon(0.0, DELTA, 3) == math.inf
    with pytest.raises(ValueError, match="accountant"):
        local_epsilon(SIGMA, DELTA, 3, accountant="moments")


SAMPLES = [[0, 1], [0, 2], [1, 3], [0, 3], [0, 1]]
"""Two of four clients per round, five rounds: client 0 in four of them, 1 in three, 3 in two,
2 in one."""


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_dp_epsilon_is_the_worst_off_clients_and_never_amplified(accountant: str) -> None:
    """After each round ``dp_epsilon`` is the ε of the client with the most exchanges (client 0:
    1, 2, 2, 3, 4), not of the rounds (5 at the end), and not amplified by sampling 2 of 4 (the
    sampled accountant gives less for every round: a mutant that used it fails)."""
    sigma = 4.0
    dp = DPSettings(CLIP, sigma, DELTA, accountant=accountant)
    privacy = Privacy(False, dp, True, 4, 2, 0, SEED, local=True)
    spec: ReplySpec = {"update.w": ((3,), torch.float32)}
    most = []
    for rnd, sample in enumerate(SAMPLES):
        replies = [(c, Reply({"update.w": torch.ones(3)}, {"num_examples": 1})) for c in sample]
        _, metrics = privacy.combine(rnd, spec, replies, torch.device("cpu"))
        most.append(privacy.uploads.most())
        want = local_epsilon(sigma, DELTA, most[-1], accountant=accountant)
        assert metrics["dp_epsilon"] == want
        assert "dp_epsilon_sample_known" not in metrics
        sampled = epsilon_spent(sigma, DELTA, most[-1], 4, 2, accountant=accountant)
        assert sampled < 0.9 * metrics["dp_epsilon"]  # amplification would report less
    assert most == [1, 2, 2, 3, 4]
    assert privacy.uploads.counts == {0: 4, 1: 3, 2: 1, 3: 2}
    worst = local_epsilon(sigma, DELTA, 5, accountant=accountant)  # a client in all 5
    assert privacy.epsilon(4) == worst > float(metrics["dp_epsilon"])


def test_every_exchange_a_client_is_sent_counts() -> None:
    """A client of the round counts whether its upload arrived or not (it may have left the
    client); a setup exchange (round -1) counts; the secure round's result and an aborted
    secure round count their sampled clients; repeats after a resume count for everyone."""
    privacy = _privacy(setup=1)
    spec: ReplySpec = {"update.w": ((3,), torch.float32)}
    ok = Reply({"update.w": torch.ones(3)}, {"num_examples": 1})
    privacy.combine(-1, spec, [(0, ok), (1, None)], torch.device("cpu"))
    assert privacy.uploads.counts == {0: 1, 1: 1}
    secure = _privacy(secure=True)
    secure.from_mean(0, spec, torch.zeros(3), {0: {}}, [0, 2], torch.device("cpu"))
    metrics = secure.aborted(1, [0, 3])
    assert secure.uploads.counts == {0: 2, 2: 1, 3: 1}
    assert metrics["dp_epsilon"] == local_epsilon(SIGMA, DELTA, 2)
    repeats = dataclasses.replace(secure, repeated=3)
    assert repeats.uploads is secure.uploads  # one count, shared as the clip norm is
    assert repeats.epsilon_metrics(1)["dp_epsilon"] == local_epsilon(SIGMA, DELTA, 5)


def test_the_counts_go_into_the_checkpoint_and_come_back() -> None:
    privacy = _privacy()
    privacy.uploads.add([0, 2, 2, 7])
    state = privacy.record(State({}, {"x": 1}))
    assert state.values == {"x": 1, UPLOADS_KEY: "0:1,2:1,7:1"}
    resumed = _privacy()
    resumed.restore(state)
    assert resumed.uploads.counts == {0: 1, 2: 1, 7: 1}
    resumed.restore(State({}, {}))  # an older checkpoint: nothing to restore
    assert resumed.uploads.counts == {0: 1, 2: 1, 7: 1}
    for bad in ("0:1,x", "1:-2"):
        with pytest.raises(ValueError, match=UPLOADS_KEY):
            Uploads().restore(bad)
    empty = Uploads()
    empty.restore("")
    assert empty.most() == 0 and empty.encode() == ""
    empty.restore("4:0")  # a zero count is a count (never written, harmless)
    assert empty.counts == {4: 0} and empty.most() == 0


def test_an_unreachable_target_names_a_client_in_every_exchange_not_one_of_one() -> None:
    """Local DP and DP-FedBuff solve σ for one client in every exchange: the refusal says so
    (it said "of 1 of 1 clients" of a 20-client run); central DP's names its sampling."""
    with pytest.raises(ValueError) as err:
        local_noise_for_epsilon(0.001, DELTA, 10)
    assert " over 10 exchanges with one client in every one (the worst case): noise " in str(
        err.value
    )
    with pytest.raises(ValueError, match=r" over 10 exchanges of 10 of 20 clients: noise "):
        noise_for_epsilon(0.001, DELTA, 10, 20, 10)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize(("target", "exchanges"), [(2.0, 10), (8.0, 51)])
def test_sigma_solved_from_a_target_reaches_it_and_no_smaller_sigma_does(
    accountant: str, target: float, exchanges: int
) -> None:
    sigma = local_noise_for_epsilon(target, DELTA, exchanges, accountant=accountant)
    assert local_epsilon(sigma, DELTA, exchanges, accountant=accountant) <= target
    less = sigma * (1 - 1e-3)
    assert local_epsilon(less, DELTA, exchanges, accountant=accountant) > target
    # the worst case ignores sampling: more noise than central DP's sampled solution
    assert sigma > noise_for_epsilon(target, DELTA, exchanges, 100, 10, accountant=accountant)


def _cfg(*extra: str) -> Any:
    return load_config(
        None,
        ["num_clients=4", "rounds=5", "weighting=uniform", "dp.clip_norm=1", "progress=false",
         "participation=0.5", *extra],
    )  # fmt: skip


def test_make_privacy_solves_sigma_for_a_client_in_every_exchange() -> None:
    from fedlore.experiment_parts import make_algorithm
    from fedlore.experiment_privacy import make_privacy, privacy_summary

    cfg = _cfg("dp.mode=local", "dp.epsilon=6", "dp.accountant=pld")
    privacy = make_privacy(cfg, make_algorithm("fedavg", cfg), SEED)
    assert privacy is not None and privacy.local and privacy.dp is not None
    assert privacy.dp.noise_multiplier == local_noise_for_epsilon(6.0, DELTA, 5, accountant="pld")
    summary = privacy_summary(privacy)
    assert summary["dp_mode"] == "local" and summary["dp_accountant"] == "pld"
    central = _cfg("dp.epsilon=6", "dp.accountant=pld")
    other = make_privacy(central, make_algorithm("fedavg", central), SEED)
    assert other is not None and not other.local and privacy_summary(other)["dp_mode"] == "central"
    assert other.dp is not None and other.dp.noise_multiplier < privacy.dp.noise_multiplier
    sketch = _cfg("dp.mode=local", "dp.epsilon=6")  # FedLore-Sketch: one setup exchange more
    p = make_privacy(sketch, make_algorithm("fedlore_sketch", sketch), SEED)
    assert p is not None and p.dp is not None
    assert p.dp.noise_multiplier == local_noise_for_epsilon(6.0, DELTA, 6)


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "local", "noise_multiplier": 1.0}, "dp.mode=local is set but dp.clip_norm"),
        (
            {"mode": "local", "clip_norm": 1.0, "noise_multiplier": 1.0, "target_quantile": 0.5},
            r"dp.mode=local cannot adapt the clip norm \(dp.target_quantile\)",
        ),
        (
            {"mode": "local", "clip_norm": 1.0, "noise_multiplier": 1.0, "colluding_clients": 1},
            "dp.mode=local has no use for dp.colluding_clients",
        ),
        ({"mode": "distributed", "clip_norm": 1.0, "noise_multiplier": 1.0}, "central"),
    ],
)
def test_settings_local_dp_cannot_honour_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        DPConfig(**kwargs)


def test_privacy_refuses_a_local_mechanism_without_dp_or_with_adaptive_clipping() -> None:
    from fedlore.privacy import ClipNorm

    with pytest.raises(ValueError, match="needs the DP mechanism"):
        Privacy(True, None, True, 4, 4, 0, SEED, local=True)
    dp = DPSettings(CLIP, SIGMA, DELTA)
    with pytest.raises(ValueError, match="neither adaptive clipping nor colluding"):
        Privacy(False, dp, True, 4, 4, 0, SEED, clip=ClipNorm(CLIP, 0.5), local=True)
    with pytest.raises(ValueError, match="neither adaptive clipping nor colluding"):
        Privacy(True, dp, True, 4, 4, 0, SEED, colluders=1, local=True)


def test_every_method_that_takes_central_dp_takes_local_dp_and_no_other() -> None:
    """The same allow-list with the same refusal text: local DP is refused exactly where central
    DP is (the methods whose server needs single uploads)."""
    central, local = _cfg("dp.noise_multiplier=1"), _cfg("dp.noise_multiplier=1", "dp.mode=local")
    accepted = []
    for name in registry.names("algorithm"):
        cls = registry.get("algorithm", name)
        outcome = []
        for cfg in (central, local):
            try:
                check_privacy(name, cls, cfg)
                outcome.append("ok")
            except ConfigError as e:
                outcome.append(str(e))
        assert outcome[0] == outcome[1], name
        if outcome[0] == "ok":
            accepted.append(name)
    assert "fedavg" in accepted and "fedlore_sketch" in accepted and "fedlore" not in accepted
