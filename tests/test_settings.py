"""The one settings model (:mod:`fedlore.settings`): every shared local-training setting names
the config key it comes from, and ``method.<name>.*`` overrides are validated by pydantic with
every problem named at once."""

from __future__ import annotations

import dataclasses

import pytest

from fedlore import registry
from fedlore.algorithms.fedavg import FedFull
from fedlore.config import Config, load_config
from fedlore.experiment_parts import make_algorithm
from fedlore.settings import (
    LocalTraining,
    build_hyper,
    config_paths,
    config_value,
    hyperparameter_names,
)


def test_every_local_training_field_names_an_existing_config_key() -> None:
    paths = config_paths(LocalTraining)
    run_decided = {
        k
        for k, info in LocalTraining.model_fields.items()
        if isinstance(info.json_schema_extra, dict) and "set_by" in info.json_schema_extra
    }
    assert run_decided == {"upload_increments"}
    assert set(paths) | run_decided == set(LocalTraining.model_fields)
    cfg = Config()
    resolved = LocalTraining()  # defaults as validated (neither steps nor epochs: 10 steps)
    for name, path in paths.items():
        value = config_value(cfg, path)  # AttributeError for a path the config lacks
        # the model's default is the config's default (a method built from defaults is the same)
        assert getattr(resolved, name) == value, name
        assert LocalTraining.model_fields[name].description, name


def test_method_fields_name_existing_config_keys() -> None:
    cfg = Config()
    seen = set()
    for name in registry.names("algorithm"):
        cls = registry.get("algorithm", name)
        for field, path in config_paths(cls).items():
            config_value(cfg, path)
            seen.add(field)
    assert seen == {
        "rank",
        "scale",
        "optimizer",
        "diagnostics_every",
        "exclude",
        "num_clients",
        "compression",
        "compression_fraction",
        "compression_levels",
        "error_feedback",
    }


def test_a_bad_override_is_refused_naming_key_and_method_all_at_once() -> None:
    cfg = load_config(
        None,
        ["method.fedlore.rank=abc", "method.fedlore.lr=-1", "method.fedlore.local_steps=2.5"],
    )
    with pytest.raises(ValueError) as err:
        make_algorithm("fedlore", cfg)
    msg = str(err.value)
    assert "method.fedlore.rank: Input should be a valid integer" in msg
    assert "method.fedlore.lr: Input should be greater than 0 (got -1" in msg
    assert "method.fedlore.local_steps:" in msg


def test_yaml_text_1e_3_is_a_float() -> None:
    cls = registry.get("algorithm", "fedfull")
    algo = build_hyper(cls, "fedfull", Config(), {"lr": "1e-3", "momentum": "5e-1"})
    assert algo.train.lr == 1e-3 and isinstance(algo.train.lr, float)
    assert algo.momentum == 0.5
    via_config = make_algorithm("fedfull", load_config(None, ["method.fedfull.lr=1e-3"]))
    assert isinstance(via_config, FedFull) and via_config.train.lr == 1e-3


def test_an_unknown_key_names_the_known_hyperparameters() -> None:
    with pytest.raises(ValueError) as err:
        make_algorithm("fedfull", load_config(None, ["method.fedfull.bogus_knob=1"]))
    msg = str(err.value)
    assert "method.fedfull: FedFull has no hyperparameter(s) ['bogus_knob']" in msg
    known = hyperparameter_names(registry.get("algorithm", "fedfull"))
    assert f"known: {known}" in msg
    assert {"lr", "momentum", "local_optimizer"} <= set(known) and "train" not in known


def test_overrides_of_shared_settings_go_into_train() -> None:
    cfg = load_config(None, ["lr=0.01", "method.fedfull.lr=0.5", "method.fedfull.grad_clip=2"])
    full = make_algorithm("fedfull", cfg)
    assert isinstance(full, FedFull)
    assert full.train.lr == 0.5 and full.train.grad_clip == 2.0
    avg = make_algorithm("fedavg", cfg)
    assert isinstance(avg, FedFull) and avg.train.lr == 0.01  # other methods keep the config's
    assert isinstance(full.train, LocalTraining)
    with pytest.raises(dataclasses.FrozenInstanceError):
        full.train = LocalTraining()  # type: ignore[misc]  # the frozen field is the point


def test_freeze_and_exclude_stay_refused_per_method() -> None:
    for key in ("freeze", "exclude"):
        with pytest.raises(ValueError, match=f"method.fedlore.{key}: set params.{key} instead"):
            make_algorithm("fedlore", load_config(None, [f"method.fedlore.{key}=[x]"]))


def test_local_training_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="betas"):
        LocalTraining(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="extra"):
        LocalTraining(bogus=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="boolean"):
        LocalTraining(local_steps=True)


def test_a_bad_list_item_is_named_by_its_index() -> None:
    """Two bad items of one list are two places (``shares[0]``, ``shares[2]``), in the run's
    config and in a method's hyperparameters (before, both read ``shares`` and looked like one
    problem said twice)."""
    from fedlore.config import ConfigError
    from fedlore.settings import loc_path

    assert loc_path(["method", "shares", 1, "x"]) == ".method.shares[1].x"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["seeds=[1,b]"])
    assert "\n  seeds[1]: Input should be a valid integer" in str(e.value)
    cfg = load_config(None, ["method.heterofl.shares=[a,1,c]"])
    with pytest.raises(ValueError) as bad:
        make_algorithm("heterofl", cfg)
    said = str(bad.value)
    assert "method.heterofl.shares[0]: Input should be a valid integer" in said
    assert "method.heterofl.shares[2]: Input should be a valid integer" in said
    assert "shares[1]" not in said
