"""Bayesian building blocks: mean-field Gaussian layers with a Gaussian prior, MC-dropout layers,
converters for any registered model, the closed-form KL, and the sampling switch.

See :mod:`fedlore.bayes.layers`; the ELBO and the Meta-BayFL family are in
:mod:`fedlore.algorithms.bayes`.
"""

from fedlore.bayes.layers import (
    BayesConv2d,
    BayesLinear,
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
)

__all__ = [
    "BayesConv2d",
    "BayesLinear",
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
]
