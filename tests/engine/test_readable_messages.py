"""One-line messages that list or show a value say what they leave out: a metric that returns no
number shows an abbreviated repr of the value (never one cut in the middle of a quote), a
rejected reply's key lists and a config difference say how many more there are."""

from __future__ import annotations

import pytest
import torch

from fedlore.config import ConfigError, load_config
from fedlore.engine.run_record import _run_config, config_diff, resolved_hyper
from fedlore.engine.validate import validate_reply
from fedlore.experiment_parts import make_algorithm
from fedlore.privacy.client import ReplySpec
from fedlore.train.metrics import MetricError, real_number
from fedlore.types import Reply


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ({f"k{i}": i for i in range(30)}, "dict {'k0': 0, 'k1': 1, 'k10': 10, 'k11': 11, ...}"),
        ("x" * 100, "str 'xxxxxxxxxxxx...xxxxxxxxxxxxx'"),
        ("0.5", "str '0.5'"),
        (None, "NoneType None"),
    ],
)
def test_a_metric_that_returns_no_number_shows_the_value_abbreviated(
    value: object, shown: str
) -> None:
    with pytest.raises(MetricError) as e:
        real_number("mine", value)
    assert str(e.value) == f"metric 'mine' returned {shown}; a metric returns one real number"


def test_a_reply_with_many_wrong_keys_says_how_many() -> None:
    spec: ReplySpec = {f"update.w{i}": ((1,), torch.float32) for i in range(6)}
    reply = Reply({"update.w0": torch.ones(1), "other": torch.ones(1)}, {"num_examples": 1})
    assert validate_reply(reply, spec) == (
        "array keys differ: missing ['update.w1', 'update.w2', 'update.w3'] and 2 more, "
        "unexpected ['other']"
    )
    arrays = {f"update.w{i}": float(i) for i in range(5)}
    assert validate_reply(Reply(arrays, {"num_examples": 1}), spec) == (  # type: ignore[arg-type]
        "arrays that are not tensors: ['update.w0', 'update.w1', 'update.w2'] and 2 more"
    )


def test_a_config_difference_of_more_than_five_settings_says_how_many_more() -> None:
    base = load_config(None, [])
    record = {
        **_run_config(base, "fedavg"),
        "hyper": resolved_hyper(make_algorithm("fedavg", base)),
    }
    five = ["rounds=3", "lr=0.5", "batch_size=7", "local_steps=3", "participation=0.5"]
    diff = config_diff(load_config(None, five), "fedavg", record, make_algorithm)
    assert diff.count(" -> ") == 5 and "more" not in diff
    seven = load_config(None, [*five, "weighting=uniform", "partition.alpha=0.1"])
    diff = config_diff(seven, "fedavg", record, make_algorithm)
    assert diff.count(" -> ") == 5 and diff.endswith("; and 2 more"), diff


def test_a_config_error_shows_the_value_abbreviated_not_cut() -> None:
    """The value a key was given, in a config error: a long list or text abbreviated as a whole
    repr (``[1, 2, 3, 4, 5, 6, ...]``), not cut mid-way and closed with ``...>``."""
    for given, shown in (
        (
            "[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23]",
            "[1, 2, 3, 4, 5, 6, ...]",
        ),
        ("x" * 200, f"'{'x' * 27}...{'x' * 28}'"),
        ("0", "0"),
    ):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"rounds={given}"])
        line = str(e.value).splitlines()[-1]
        assert line.startswith("  rounds: ") and line.endswith(f" (got {shown})"), line
