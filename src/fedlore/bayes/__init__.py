"""Bayesian building blocks: mean-field Gaussian layers with a Gaussian prior, MC-dropout layers,
converters for any registered model, the closed-form KL, the sampling switch and the estimator
switch (weight sampling or local reparameterization).

See :mod:`fedlore.bayes.layers`; the ELBO and the Meta-BayFL family are in
:mod:`fedlore.algorithms.bayes`.
"""

from fedlore.bayes.layers import (
    ESTIMATORS,
    BayesConv2d,
    BayesLinear,
    Estimator,
    GaussianPrior,
    MCDropoutConv2d,
    MCDropoutLinear,
    Stochastic,
    add_mc_dropout,
    bayesianize,
    gaussian_kl,
    gaussian_kl_between,
    inverse_softplus,
    is_bayesian,
    is_stochastic,
    kl_divergence,
    log_prior,
    log_softplus,
    posterior_kl,
    sampling,
    seeded,
    set_estimator,
)

__all__ = [
    "ESTIMATORS",
    "BayesConv2d",
    "BayesLinear",
    "Estimator",
    "GaussianPrior",
    "MCDropoutConv2d",
    "MCDropoutLinear",
    "Stochastic",
    "add_mc_dropout",
    "bayesianize",
    "gaussian_kl",
    "gaussian_kl_between",
    "inverse_softplus",
    "is_bayesian",
    "is_stochastic",
    "kl_divergence",
    "log_prior",
    "log_softplus",
    "posterior_kl",
    "sampling",
    "seeded",
    "set_estimator",
]
