"""Experiment configuration: YAML -> frozen, validated pydantic model.

Unknown keys are errors at every level; ``key=value`` overrides use dotted keys that mirror the
YAML (``partition.alpha=0.1``, ``algorithms=[fedlore,fedfull]``). Values in overrides are parsed
as YAML scalars/lists. A config file may name a ``base`` file (relative to itself) whose keys it
overrides, so experiment files only state what differs.

The models live in :mod:`fedlore.config_sections` (the sections) and :mod:`fedlore.config_model`
(:class:`Config`), reading and validation in :mod:`fedlore.config_load`; the local-training
settings every method shares are :class:`fedlore.settings.LocalTraining`. Import them from here.
"""

from __future__ import annotations

from fedlore.config_federation import (
    AsynchronousConfig,
    AttackConfig,
    ClientsConfig,
    CompressionConfig,
    ServerConfig,
)
from fedlore.config_load import (
    ConfigError,
    apply_overrides,
    effective_overrides,
    load_config,
    read_yaml,
    validate,
)
from fedlore.config_model import Config
from fedlore.config_sections import (
    DataConfig,
    DiagnosticsConfig,
    DPAuditConfig,
    DPConfig,
    EvalConfig,
    FlowerConfig,
    ModelConfig,
    OptimConfig,
    ParamsConfig,
    PartitionConfig,
    RobustConfig,
    StoreConfig,
)
from fedlore.config_stopping import EarlyStoppingConfig
from fedlore.config_tracking import TrackingConfig
from fedlore.config_tune import TuneConfig

__all__ = [
    "AsynchronousConfig",
    "AttackConfig",
    "ClientsConfig",
    "CompressionConfig",
    "Config",
    "ConfigError",
    "DPAuditConfig",
    "DPConfig",
    "DataConfig",
    "DiagnosticsConfig",
    "EarlyStoppingConfig",
    "EvalConfig",
    "FlowerConfig",
    "ModelConfig",
    "OptimConfig",
    "ParamsConfig",
    "PartitionConfig",
    "RobustConfig",
    "ServerConfig",
    "StoreConfig",
    "TrackingConfig",
    "TuneConfig",
    "apply_overrides",
    "effective_overrides",
    "load_config",
    "read_yaml",
    "validate",
]
