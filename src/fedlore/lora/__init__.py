"""LoRA adapters on peft for the federated LoRA baselines.

* :mod:`fedlore.lora.adapters`: injection with one fixed adapter name, the adapter <-> Arrays
  mapping (``<module>.A`` ``r x n``, ``<module>.B`` ``m x r``), strict loading.
* :mod:`fedlore.lora.factors`: fp32 products and merges, PEFT / PiSSA initialisations,
  truncated SVD, factor sizes.
"""

from fedlore.lora.adapters import (
    ADAPTER,
    Target,
    adapted_copy,
    adapter_arrays,
    adapter_params,
    dense_arrays,
    find_targets,
    inject,
    load_adapters,
    plain_name,
    set_trainable,
)
from fedlore.lora.factors import (
    FACTORS,
    Factor,
    factor_numel,
    kaiming_a,
    merge,
    principal_factors,
    product,
    scaling,
    truncated_svd,
    zeros_b,
)

__all__ = [
    "ADAPTER",
    "FACTORS",
    "Factor",
    "Target",
    "adapted_copy",
    "adapter_arrays",
    "adapter_params",
    "dense_arrays",
    "factor_numel",
    "find_targets",
    "inject",
    "kaiming_a",
    "load_adapters",
    "merge",
    "plain_name",
    "principal_factors",
    "product",
    "scaling",
    "set_trainable",
    "truncated_svd",
    "zeros_b",
]
