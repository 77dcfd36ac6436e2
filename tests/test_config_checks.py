"""Whole-config checks before any run folder is looked at (:mod:`fedlore.checks`):
unknown names, ``method`` sections of methods left out of ``algorithms``, and command-line
settings of methods the run does not include."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedlore.checks import (
    check_overrides,
    name_problems,
    override_problems,
    unused_method_problems,
)
from fedlore.config import ConfigError, load_config


def test_every_unknown_name_is_listed_with_the_registered_ones() -> None:
    cfg = load_config(None, ["data.name=digitz", "partition.name=diri", "model.name=mpl"])
    problems = name_problems(cfg)
    assert [p.split(":")[0] for p in problems] == ["data.name", "partition.name", "model.name"]
    assert "unknown source 'digitz' (did you mean 'digits'?); registered: [" in problems[0]
    assert "unknown partition 'diri'" in problems[1] and "'dirichlet'" in problems[1]
    assert "unknown model 'mpl' (did you mean 'mlp'?)" in problems[2]
    assert name_problems(load_config(None)) == []


def test_sections_of_methods_left_out_are_checked_by_name_and_key(tmp_path: Path) -> None:
    f = tmp_path / "exp.yaml"
    f.write_text("algorithms: [fedfull, fedlore]\nmethod:\n  fedlore: {rank: 4}\n")
    narrowed = load_config(f, ["algorithms=[fedfull]"])  # a config file's settings may stay
    assert unused_method_problems(narrowed) == []
    assert override_problems(narrowed, ["algorithms=[fedfull]"]) == []
    typo = load_config(
        None, ["algorithms=[fedfull]", "method.fedlore.rnak=4", "method.fedmagic.lr=1"]
    )
    problems = unused_method_problems(typo)
    assert len(problems) == 2
    assert problems[0].startswith("method.fedlore: FedLore has no hyperparameter(s) ['rnak']")
    assert "(fedlore is not in algorithms [fedfull] either)" in problems[0]
    assert problems[1].startswith("method.fedmagic: unknown algorithm 'fedmagic'")


def test_a_command_line_setting_of_a_method_not_in_algorithms_is_refused() -> None:
    over = ["algorithms=[fedfull]", "method.fedlore.rank=4", "method.fedfull.lr=0.1"]
    cfg = load_config(None, over)
    with pytest.raises(ConfigError) as e:
        check_overrides(cfg, over)
    assert str(e.value) == (
        "method.fedlore.rank=4: method 'fedlore' is not in algorithms [fedfull], so the setting "
        "would change nothing; add fedlore to algorithms or drop the setting"
    )
    whole = ["algorithms=[fedavg]", "method={fedlore: {rank: 4}, fedavg: {lr: 0.1}}"]
    problems = override_problems(load_config(None, whole), whole)
    assert len(problems) == 1 and "method 'fedlore' is not in algorithms [fedavg]" in problems[0]
    ok = ["algorithms=[fedfull, fedlore]", "method.fedlore.rank=4"]
    check_overrides(load_config(None, ok), ok)  # in the run: checked when the method is built
