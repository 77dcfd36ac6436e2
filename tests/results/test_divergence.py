"""A run is marked diverged only when its training loss went non-finite or its model blew up
(:mod:`fedlore.results.divergence`)."""

from __future__ import annotations

from typing import Any

from fedlore.results.divergence import divergence


def _row(rnd: int, train_loss: float | None, loss: float | None, **more: Any) -> dict[str, Any]:
    return {"round": rnd, "accepted": 3, "train_loss": train_loss, "loss": loss, **more}


def test_a_healthy_run_is_not_diverged() -> None:
    assert divergence([_row(0, 2.0, 2.1, accuracy=0.3), _row(1, 1.5, 1.6, accuracy=0.5)]) == {}


def test_every_step_skipped_or_the_last_round_all_skipped_is_diverged() -> None:
    never = divergence([_row(0, None, 2.3, skipped_steps=20), _row(1, None, 2.3, skipped_steps=20)])
    assert never["diverged"].startswith("every local step was skipped (40 steps")
    late = divergence([_row(0, 2.0, 1.9), _row(1, None, None, skipped_steps=20)])
    assert late["diverged"].startswith("the training loss went non-finite: every local step of "
                                       "the last round (1) was skipped")  # fmt: skip


def test_a_model_that_blew_up_is_diverged_by_its_test_scores() -> None:
    nan = divergence([_row(0, 2.0, 1.9), _row(1, 1.8, None)])
    assert nan["diverged"].startswith("the global model's test predictions are not finite")
    huge = divergence([_row(0, 9.0, 3.4e35)])
    assert "the final test loss is 3.4e+35 nats per example" in huge["diverged"]
    assert divergence([_row(0, 9.0, 3.2e3, rmse=80.0)]) == {}  # regression: not on this scale


def test_under_privacy_only_the_test_scores_tell() -> None:
    rows = [_row(0, None, 1.9, dp_clipped=1), _row(1, None, 1.7, dp_clipped=0)]
    assert divergence(rows) == {}  # no training loss is released
    rows[-1]["loss"] = None
    assert "under DP" not in divergence(rows)["diverged"]
    rows[-1]["dp_epsilon"] = 1.0
    assert "under DP, the noise" in divergence(rows)["diverged"]
