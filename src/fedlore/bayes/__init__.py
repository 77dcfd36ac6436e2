"""Bayesian building blocks: mean-field Gaussian layers with a Gaussian prior, MC-dropout layers,
converters for any registered model, the closed-form KL, the combination of clients' posteriors,
the sampling switch and the estimator switch (weight sampling or local reparameterization).

The closed-form Gaussian math is in :mod:`fedlore.bayes.posterior`, the layers in
:mod:`fedlore.bayes.layers`, the operations on a whole model in :mod:`fedlore.bayes.model`; the
ELBO and the Meta-BayFL family are in :mod:`fedlore.algorithms.bayes`, its learning-rate search
in :mod:`fedlore.algorithms.meta_lr`.
"""

from fedlore.bayes.layers import (
    ESTIMATORS,
    BayesConv2d,
    BayesLinear,
    Estimator,
    MCDropoutConv2d,
    MCDropoutLinear,
    Stochastic,
)
from fedlore.bayes.model import (
    add_mc_dropout,
    bayesianize,
    is_bayesian,
    is_stochastic,
    kl_divergence,
    log_prior,
    posterior_kl,
    sampling,
    seeded,
    set_estimator,
)
from fedlore.bayes.posterior import (
    Aggregation,
    GaussianPrior,
    combine_gaussians,
    gaussian_kl,
    gaussian_kl_between,
    inverse_softplus,
    log_softplus,
)

__all__ = [
    "ESTIMATORS",
    "Aggregation",
    "BayesConv2d",
    "BayesLinear",
    "Estimator",
    "GaussianPrior",
    "MCDropoutConv2d",
    "MCDropoutLinear",
    "Stochastic",
    "add_mc_dropout",
    "bayesianize",
    "combine_gaussians",
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
