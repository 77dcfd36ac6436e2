"""The client's side of a private round, call by call (fedlore.privacy.client, SecurePlan).

What each client sends is exactly what its broadcast's ``privacy.*`` settings ask for: no clip
and no noise when the settings have none, noise and the adaptive-clipping bit drawn from the
stream named for them, uniform weights by default, the clip flag as it happened; a broadcast
without privacy settings, an upload with NaN, a weight outside (0, W] are refused with messages
that say so. Everything stays float64 on the CPU whatever torch's default device is (a GPU run
sets one). A recording noise source checks which draws are made.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedlore.privacy import (
    Contribution,
    SecurePlan,
    SeededSource,
    client_contribution,
    client_noise,
    flatten,
    privatize,
    unflatten,
)
from fedlore.privacy.client import ReplySpec
from fedlore.privacy.fixedpoint import FixedPoint
from fedlore.privacy.randomness import count_stream
from fedlore.privacy.secagg import RoundParams
from fedlore.types import Reply, Scalars


class Recording:
    """A noise source that returns ``value`` everywhere and records each call."""

    secure = True

    def __init__(self, value: float = 0.25) -> None:
        self.value = value
        self.calls: list[tuple[int, float, int, int]] = []

    def gaussian(self, n: int, std: float, rnd: int, client: int) -> torch.Tensor:
        self.calls.append((n, std, rnd, client))
        return torch.full((n,), self.value, dtype=torch.float64, device="cpu")

    def sample(self, num_clients: int, per_round: int, rnd: int) -> list[int]:
        return list(range(per_round))


def _reply(scale: float = 3.0, n: int = 7) -> Reply:
    arrays = {"update.b": torch.full((2,), scale), "update.a": torch.full((2, 2), -scale)}
    return Reply(arrays, {"num_examples": n, "train_loss": 0.4, "train_s": 0.2})


def test_a_secure_round_without_dp_sends_the_upload_as_it_is() -> None:
    """Only ``privacy.secure``: no clip, no noise, no draw, weight 1, not clipped."""
    noise = Recording()
    reply = _reply()
    c = client_contribution(reply, {"privacy.secure": True}, 3, 5, noise)
    assert torch.equal(c.vector, flatten(reply.arrays))
    assert c.weight == 1.0 and c.clipped is False and noise.calls == []
    assert c.extras.numel() == 0 and c.extras.dtype == torch.float64
    assert c.metrics == {"train_s": 0.2}  # no loss in the clear


def test_weights_follow_the_uniform_setting() -> None:
    reply = _reply(n=7)
    base = {"privacy.secure": True}
    assert (
        client_contribution(reply, {**base, "privacy.uniform": False}, 0, 0, Recording()).weight
        == 7.0
    )
    assert (
        client_contribution(reply, {**base, "privacy.uniform": True}, 0, 0, Recording()).weight
        == 1.0
    )


def test_dp_clips_adds_its_share_and_the_adaptive_bit() -> None:
    """C = 1, share 0.5, count share 0.3: the vector is clipped to norm 1 plus the share's
    draw, the bit is 0 (it was clipped) plus its own draw, each from its own stream."""
    noise = Recording(0.25)
    config: Scalars = {"privacy.secure": True, "privacy.clip_norm": 1.0,
                       "privacy.sketch_share": 0.5, "privacy.noise_share": 0.5,
                       "privacy.count_share": 0.3}  # fmt: skip
    c = client_contribution(_reply(), config, 4, 9, noise)
    assert c.clipped is True
    assert (c.vector - 0.25).norm().item() == pytest.approx(1.0)
    assert c.extras.tolist() == [0.25] and c.extras.dtype == torch.float64
    assert noise.calls == [(6, 0.5, 9, 4), (1, 0.3, 9, count_stream(4))]
    small = client_contribution(_reply(0.01), config, 4, 9, Recording(-0.25))
    assert small.clipped is False and small.extras.tolist() == [0.75]
    assert torch.equal(small.summed, torch.cat([small.vector, small.extras]))


def test_a_share_below_one_is_still_added() -> None:
    config: Scalars = {"privacy.secure": True, "privacy.noise_share": 0.5}
    c = client_contribution(_reply(), config, 0, 0, Recording(0.125))
    assert torch.allclose(c.vector, flatten(_reply().arrays) + 0.125)


def test_refusals_name_the_problem() -> None:
    with pytest.raises(
        ValueError, match=r"^the broadcast carries no privacy settings \(privacy\.\*\)$"
    ):
        client_contribution(_reply(), {}, 0, 0, Recording())
    bad = Reply({"update.a": torch.tensor([1.0, math.nan])}, {"num_examples": 1})
    with pytest.raises(ValueError, match=r"^the upload contains NaN or Inf; nothing is sent$"):
        client_contribution(bad, {"privacy.secure": True}, 0, 0, Recording())


def test_the_client_side_stays_on_the_cpu_whatever_the_default_device() -> None:
    """Under ``torch.device('meta')`` as the default (a GPU run sets cuda) every tensor the
    client side makes is still a CPU float64 one."""
    reply = _reply()
    config: Scalars = {"privacy.secure": True, "privacy.clip_norm": 1.0,
                       "privacy.sketch_share": 0.5, "privacy.count_share": 0.1}  # fmt: skip
    plan = _plan(counts=True, max_weight=2.0, extras=1)
    with torch.device("meta"):
        c = client_contribution(reply, config, 0, 0, Recording())
        plain = client_contribution(reply, {"privacy.secure": True}, 0, 0, Recording())
        ring = plan.encode(c)
    assert c.vector.device.type == c.extras.device.type == "cpu"
    assert plain.extras.device.type == "cpu"
    assert ring.dtype == np.uint64 and ring.size == plan.length


def test_privatize_clips_dp_alone_and_leaves_other_replies_alone() -> None:
    reply = _reply()
    assert privatize(reply, {}) is reply
    assert privatize(reply, {"privacy.secure": True}) is reply
    config: Scalars = {
        "privacy.secure": False,
        "privacy.clip_norm": 1.0,
        "privacy.sketch_share": 0.5,
    }
    out = privatize(reply, config)
    assert out.metrics == {"train_s": 0.2, "num_examples": 1, "dp_clipped": 1}
    assert flatten(out.arrays).norm().item() == pytest.approx(1.0)
    assert privatize(_reply(0.01), config).metrics["dp_clipped"] == 0


def _plan(counts: bool, max_weight: float, extras: int = 0) -> SecurePlan:
    params = RoundParams(0, {0: (1,), 1: (0,)}, 2, 2)
    return SecurePlan(params, FixedPoint.for_sum(8.0, 2), 6, extras, counts, max_weight)


def _contribution(x: torch.Tensor, weight: float) -> Contribution:
    return Contribution(x, torch.zeros(0, dtype=torch.float64), weight, False, {})


def test_the_weight_entry_keeps_float64_precision() -> None:
    """p / W = 7 / 23 (not exact in float32): the decoded weight sum is 7 / 23 to 1e-15."""
    plan = _plan(counts=False, max_weight=23.0)
    x = torch.linspace(-1, 1, 6, dtype=torch.float64)
    sum_wx, sum_w, counts = plan.decode(plan.encode(_contribution(x, 7.0)))
    assert sum_w == pytest.approx(7 / 23, rel=1e-15, abs=0)
    assert torch.allclose(sum_wx / sum_w, x, rtol=1e-14, atol=1e-15)
    assert counts == {}


def test_a_weight_outside_zero_to_w_is_refused() -> None:
    plan = _plan(counts=False, max_weight=4.0)
    x = torch.zeros(6, dtype=torch.float64)
    for weight in (0.0, -1.0, 4.5):
        with pytest.raises(ValueError, match=rf"^weight {weight:g} is outside \(0, 4\]"):
            plan.encode(_contribution(x, weight))
    assert plan.encode(_contribution(x, 4.0)).size == plan.length


def test_a_vector_of_another_length_is_refused() -> None:
    plan = _plan(counts=False, max_weight=1.0)
    with pytest.raises(ValueError, match=r"^upload has 5 \+ 0 entries, expected 6 \+ 0$"):
        plan.encode(_contribution(torch.zeros(5, dtype=torch.float64), 1.0))
    with pytest.raises(ValueError, match=r"^upload has 6 \+ 0 entries, expected 6 \+ 1$"):
        _plan(counts=False, max_weight=1.0, extras=1).encode(
            _contribution(torch.zeros(6, dtype=torch.float64), 1.0)
        )


def test_a_plan_names_its_layout() -> None:
    plan = _plan(counts=True, max_weight=1.0, extras=1)
    assert plan.length == 6 + 1 + 1 + 2 and plan.min_survivors == 2
    assert _plan(counts=False, max_weight=1.0).length == 7


def test_a_client_draws_its_shares_from_os_entropy_unless_the_broadcast_says_reproducible() -> None:
    secure = client_noise({"privacy.secure": True}, 3)
    assert secure.secure and not torch.equal(
        secure.gaussian(4, 1.0, 0, 0), client_noise({}, 3).gaussian(4, 1.0, 0, 0)
    )
    seeded = client_noise({"privacy.reproducible": True}, 3)
    assert not seeded.secure
    assert torch.equal(seeded.gaussian(4, 1.0, 2, 5), SeededSource(3).gaussian(4, 1.0, 2, 5))
    assert client_noise({"privacy.reproducible": False}, 3).secure


def test_flatten_and_unflatten_refuse_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match=r"^no upload arrays to flatten$"):
        flatten({})
    spec: ReplySpec = {"a": ((2,), torch.float32)}
    with pytest.raises(ValueError, match=r"^vector has 3 entries, the reply spec needs 2$"):
        unflatten(torch.zeros(3, dtype=torch.float64), spec)
