"""Whether a run diverged, judged from its metrics rows (``metrics.jsonl``).

A run diverged when its training loss went non-finite (every local step was skipped, in the
whole run or in its last trained round) or its model blew up: the global model's predictions
on the test set are not finite, or its test NLL exceeds :data:`DIVERGED_NLL` (training losses
are not compared with it: a Bayesian method's holds a KL term of no fixed scale). Under secure
aggregation or DP no training loss is released, so only the test scores tell. The test set is
never empty (:func:`fedlore.data.checks.central_splits`), so a missing score is no divergence
by itself.
"""

from __future__ import annotations

from typing import Any

DIVERGED_NLL = 1e4
"""A classification or language-model run whose final test NLL exceeds this many
nats per example (token) is marked diverged: a uniform guess over K classes costs ln K (2.3 for
10 classes, 10.4 for a 32k vocabulary), so only logits blown up to this scale reach it while
staying finite."""


def divergence(rows: list[dict[str, Any]]) -> dict[str, str]:
    """``{"diverged": reason}`` for a run that diverged (see the module docstring), else ``{}``.

    Args:
        rows: the run's metrics rows in round order (non-finite values written as None).
    """
    trained = [r for r in rows if r.get("accepted")]
    # under secure aggregation or DP no client's training loss is released (only the test
    # loss below tells a diverged run)
    private = any(k in r for r in rows for k in ("secagg_dropped", "dp_clipped", "dp_epsilon"))
    regression = any("rmse" in r for r in rows)  # a Gaussian NLL scales with the targets
    cure = "lower the learning rate"
    if any("dp_epsilon" in r for r in rows):
        cure += " or, under DP, the noise (a larger dp.epsilon or dp.clip_norm)"
    if trained and not private:
        losses = [r.get("train_loss") for r in trained]
        skipped = sum(int(r.get("skipped_steps", 0)) for r in rows)
        if all(v is None for v in losses):
            return {
                "diverged": f"every local step was skipped ({skipped} steps with a non-finite "
                "loss or gradient): the model never trained; lower the learning rate"
            }
        if losses[-1] is None:
            return {
                "diverged": f"the training loss went non-finite: every local step of the last "
                f"round ({trained[-1].get('round')}) was skipped; {cure}"
            }
    evaluated = [r for r in rows if "loss" in r]
    if evaluated and evaluated[-1]["loss"] is None:
        return {"diverged": f"the global model's test predictions are not finite; {cure}"}
    if evaluated and not regression:  # classes or tokens: NLL in nats
        final = float(evaluated[-1]["loss"])
        if final > DIVERGED_NLL:
            return {
                "diverged": f"the final test loss is {final:.3g} nats per example (> "
                f"{DIVERGED_NLL:g}; a uniform guess costs ln K): the model blew up; {cure}"
            }
    return {}
