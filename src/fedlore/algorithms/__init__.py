"""One short module per method; importing this package registers them all."""

from fedlore.algorithms import (  # noqa: F401
    apfl,
    bayes,
    ditto,
    fedavg,
    fedbe,
    feddyn,
    fedfomo,
    fedgalore,
    fedlore,
    fedlore_bayes,
    fedmask,
    fednova,
    fedrep,
    fedslop,
    heterofl,
    local_galore,
    lora_fair,
    lora_fedit,
    lora_ffa,
    lora_flexlora,
    lora_flora,
    lora_frlora,
    lora_rolora,
    moon,
    partial,
    perfedavg,
    pfedbayes,
    pfedme,
    qffl,
    scaffold,
)
from fedlore.algorithms.base import Hyper

__all__ = ["Hyper"]
