"""SCAFFOLD under secure aggregation (and not DP), attacked through the real round loop
(``personal_bed.py``'s run).

Its server needs only the weighted means of the two uploads, ``Δy`` and ``Δc_i``, both
increments: the secure round hands it their mean, once per contributor with weight 1, and it
moves ``x`` by the mean Δy and ``c`` by ``|S| / N`` times the mean Δc_i. So:

* what a client masks is exactly its ``[Δc_i, Δy]`` (the reply spec's entries, sorted), its
  ``c_i`` stays in its state, and no training loss or state size travels in the clear;
* three rounds at unequal weights, client 2 sitting out one (``|S| = 3`` of ``N = 4``), end in
  the plain run's ``x``, ``c`` and every client's ``c_i``; a server that took the uniform mean,
  or scaled ``c``'s step by 1/N instead of |S|/N, would not;
* DP, central or local, is refused with the reason (``Capabilities.no_dp``).
"""

from __future__ import annotations

import pytest
import torch
from personal_bed import N, client, privacy, run

from fedlore.algorithms.scaffold import CONTROL, Scaffold
from fedlore.checks import check_privacy
from fedlore.config import ConfigError, load_config
from fedlore.privacy import CLEAR_METRICS, Contribution, flatten
from fedlore.tensors import select

SCHEDULE = [[0, 1, 2, 3], [0, 1, 3], [0, 1, 2, 3]]


def _scaffold(**kw: object) -> Scaffold:
    return Scaffold.of(lr=0.05, local_steps=4, batch_size=16, num_clients=N, **kw)


def test_a_secure_scaffold_run_is_the_plain_run(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = run(_scaffold(), "none", None, SCHEDULE, monkeypatch)
    secure = run(_scaffold(upload_increments=True), "none", privacy("secagg"), SCHEDULE,
                 monkeypatch)  # fmt: skip
    assert all(r["secagg_aborted"] == 0 and r["train_loss"] is None for r in secure.rows)
    for (rnd, cid), raw in secure.raw.items():
        sent = secure.sent[(rnd, cid)]
        assert isinstance(sent, Contribution)
        assert torch.equal(sent.vector, flatten(raw.arrays).cpu())  # Δc_i and Δy, nothing else
        assert {k.split(".")[0] for k in raw.arrays} == {"update", "dcontrol"}
        assert set(sent.metrics) <= set(CLEAR_METRICS)
    want, got = plain.states[-1].arrays, secure.states[-1].arrays
    assert want.keys() == got.keys()
    for k, v in want.items():
        if v.is_floating_point():
            torch.testing.assert_close(got[k], v, rtol=0, atol=2e-6, msg=k)
    for cid in range(N):
        mine = select(plain.clients[-1][cid].arrays, CONTROL, strip=False)
        assert mine
        for k, v in mine.items():
            torch.testing.assert_close(secure.clients[-1][cid].arrays[k], v, rtol=0, atol=1e-5)
    # c moved, and by |S| / N of the weighted mean in the round client 2 sat out
    c0, c1, c2 = (select(plain.states[r].arrays, CONTROL) for r in (0, 1, 2))
    assert any(float((c1[k] - c0[k]).abs().max()) > 1e-3 for k in c0)
    sizes = {c: float(client(c).num_examples) for c in SCHEDULE[1]}
    total = sum(sizes.values())
    for k in c1:
        dc = sum(sizes[c] * plain.raw[(1, c)].arrays["dcontrol." + k] for c in SCHEDULE[1])
        torch.testing.assert_close(c2[k], c1[k] + (len(SCHEDULE[1]) / N) * dc / total,
                                   rtol=0, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("mode", [[], ["dp.mode=local"], ["secure_aggregation=true"]])
def test_dp_is_refused_with_the_reason(mode: list[str]) -> None:
    dp = ["weighting=uniform", "dp.clip_norm=1", "dp.noise_multiplier=1", *mode]
    with pytest.raises(ConfigError, match="pile up in c as a random walk"):
        check_privacy("scaffold", Scaffold, load_config(None, dp))
    check_privacy("scaffold", Scaffold, load_config(None, ["secure_aggregation=true"]))
