"""The exact ε of the Gaussian mechanism, the reference the accountants are checked against
(imported by ``test_accountant.py`` and ``test_local_dp.py``; not a test module)."""

from __future__ import annotations

import math

from scipy import optimize, stats


def exact_gdp_epsilon(mu: float, delta: float) -> float:
    """The exact ε of μ-GDP at δ (Dong, Roth & Su 2022, Corollary 2.13), solved for ε."""

    def excess(eps: float) -> float:
        upper = stats.norm.cdf(-eps / mu + mu / 2)
        lower = math.exp(eps + stats.norm.logcdf(-eps / mu - mu / 2))
        return float(upper - lower - delta)

    return float(optimize.brentq(excess, 0.0, 10.0 * (mu * mu + mu + 1.0), xtol=1e-12))
