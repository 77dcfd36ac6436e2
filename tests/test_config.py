"""Config loading: YAML, ``base`` chains, ``key=value`` overrides, strict validation, and how
``method.<name>`` overrides reach the algorithm (``fedlore.experiment_parts.make_algorithm``)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pydantic
import pytest

from fedlore import registry
from fedlore.algorithms.base import Hyper
from fedlore.algorithms.fedavg import FedFull
from fedlore.algorithms.fedlore import FedLore
from fedlore.checks import setup_rounds
from fedlore.config import Config, ConfigError, apply_overrides, load_config, read_yaml
from fedlore.experiment import run_experiment
from fedlore.experiment_parts import make_algorithm


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------ YAML


def test_yaml_file_is_loaded_and_missing_keys_take_defaults(tmp_path: Path) -> None:
    cfg_file = _write(
        tmp_path / "exp.yaml",
        "name: tiny\nrounds: 7\nlr: 0.02\nalgorithms: [fedfull]\n"
        "partition:\n  name: iid\nmodel:\n  name: mlp\n  kwargs: {hidden: [16, 8]}\n",
    )
    cfg = load_config(cfg_file)
    assert cfg.name == "tiny" and cfg.rounds == 7 and cfg.lr == 0.02
    assert cfg.algorithms == ["fedfull"]
    assert cfg.partition.name == "iid"
    assert cfg.partition.alpha == Config().partition.alpha  # untouched nested default
    assert cfg.model.kwargs == {"hidden": [16, 8]}
    assert cfg.num_clients == Config().num_clients


def test_quickstart_config_loads() -> None:
    path = Path(__file__).resolve().parents[1] / "experiments" / "quickstart.yaml"
    cfg = load_config(path)
    assert cfg.name == "quickstart" and cfg.data.name == "digits"
    assert cfg.algorithms == ["fedlore", "fedfull", "local_galore"]
    assert set(cfg.algorithms) <= set(registry.names("algorithm"))


def test_empty_yaml_gives_defaults_and_says_so(tmp_path: Path) -> None:
    """An empty (or comments-only) config trained the whole default experiment without a word:
    a wrong or unsaved file. It still loads, and a warning names it (and whose base it is)."""
    from fedlore.config_load import EmptyConfigWarning

    for text in ("", "# settings to come\n"):
        with pytest.warns(EmptyConfigWarning, match=r"empty\.yaml holds no settings .*default"):
            assert load_config(_write(tmp_path / "empty.yaml", text)) == Config()
    child = _write(tmp_path / "child.yaml", "base: empty.yaml\nrounds: 3\n")
    with pytest.warns(EmptyConfigWarning, match=r"empty\.yaml \(the base of .*child\.yaml\)"):
        assert load_config(child).rounds == 3


def test_non_mapping_yaml_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="mapping"):
        load_config(_write(tmp_path / "list.yaml", "- 1\n- 2\n"))


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_config_is_frozen() -> None:
    cfg = load_config(None)
    with pytest.raises(pydantic.ValidationError):
        cfg.rounds = 3  # type: ignore[misc]


# ------------------------------------------------------------------------------ base chain


def test_base_chain_merges_deeply_and_later_files_win(tmp_path: Path) -> None:
    _write(
        tmp_path / "base.yaml",
        "name: base\nrounds: 50\nlr: 0.1\n"
        "partition:\n  name: dirichlet\n  alpha: 0.5\n  min_size: 3\n",
    )
    # the middle file lives in a sub-folder: its base is relative to itself
    _write(
        tmp_path / "sub" / "mid.yaml", "base: ../base.yaml\nrounds: 20\npartition:\n  alpha: 0.2\n"
    )
    top = _write(tmp_path / "top.yaml", "base: sub/mid.yaml\nname: top\n")
    raw = read_yaml(top)
    assert "base" not in raw
    cfg = load_config(top)
    assert cfg.name == "top"  # top wins
    assert cfg.rounds == 20  # mid wins over base
    assert cfg.lr == 0.1  # only in base
    assert cfg.partition.alpha == 0.2  # nested key from mid ...
    assert cfg.partition.name == "dirichlet" and cfg.partition.min_size == 3  # ... merged, kept


def test_base_chain_loop_is_an_error(tmp_path: Path) -> None:
    _write(tmp_path / "a.yaml", "base: b.yaml\nrounds: 1\n")
    _write(tmp_path / "b.yaml", "base: a.yaml\nrounds: 2\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(tmp_path / "a.yaml")


def test_missing_base_is_an_error(tmp_path: Path) -> None:
    top = _write(tmp_path / "top.yaml", "base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=re.escape("nowhere.yaml")):
        load_config(top)


# ------------------------------------------------------------------------------- overrides


def test_dotted_overrides_on_top_of_a_file(tmp_path: Path) -> None:
    f = _write(tmp_path / "exp.yaml", "rounds: 9\npartition:\n  alpha: 0.5\n  min_size: 4\n")
    cfg = load_config(f, ["partition.alpha=0.1", "rounds=3"])
    assert cfg.partition.alpha == 0.1
    assert cfg.partition.min_size == 4  # sibling of the overridden key survives
    assert cfg.rounds == 3


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("algorithms=[fedlore,fedfull]", ["fedlore", "fedfull"]),
        ("algorithms=[fedlore, fedfull]", ["fedlore", "fedfull"]),
        ("algorithms=fedlore", ["fedlore"]),
        ("algorithms=fedfull", ["fedfull"]),
    ],
)
def test_algorithms_override_is_a_list(override: str, expected: list[str]) -> None:
    assert load_config(None, [override]).algorithms == expected


@pytest.mark.parametrize(("override", "expected"), [("seeds=[1,2]", [1, 2]), ("seeds=3", [3])])
def test_seeds_override(override: str, expected: list[int]) -> None:
    assert load_config(None, [override]).seeds == expected


def test_override_values_are_yaml_parsed() -> None:
    cfg = load_config(
        None, ["model.kwargs={hidden: [16]}", "data.root=", "optim.betas=[0.8,0.9]", "lr=1e-2"]
    )
    assert cfg.model.kwargs == {"hidden": [16]}
    assert cfg.data.root is None  # empty value -> null
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.lr == pytest.approx(0.01)


def test_override_does_not_mutate_its_input() -> None:
    raw = {"partition": {"alpha": 0.5}}
    out = apply_overrides(raw, ["partition.alpha=0.1"])
    assert raw == {"partition": {"alpha": 0.5}} and out["partition"]["alpha"] == 0.1


@pytest.mark.parametrize(
    ("override", "needle"),
    [("rounds", "key=value"), ("rounds.deep=1", "'rounds' is not a section")],
)
def test_malformed_overrides(override: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, ["rounds=3", override])


# ------------------------------------------------------------------ unknown keys, bad values


@pytest.mark.parametrize(
    "override",
    ["roundz=3", "partition.alpah=0.1", "data.nmae=digits", "optim.lrr=1", "eval.evry=2"],
)
def test_unknown_keys_are_errors_naming_the_key(override: str) -> None:
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert re.search(rf"^\s*{re.escape(key)}: unknown key", str(err.value), re.M), str(err.value)


def test_unknown_keys_in_yaml_are_errors(tmp_path: Path) -> None:
    f = _write(tmp_path / "exp.yaml", "rounds: 2\npartition:\n  alhpa: 0.3\ncolour: red\n")
    with pytest.raises(ConfigError) as err:
        load_config(f)
    msg = str(err.value)
    assert "partition.alhpa: unknown key" in msg and "colour: unknown key" in msg  # all listed


@pytest.mark.parametrize(
    ("override", "field", "shown"),
    [
        ("participation=0", "participation", "0"),
        ("participation=1.5", "participation", "1.5"),
        ("lr=-1", "lr", "-1"),
        ("partition.alpha=0", "partition.alpha", "0"),
        ("rounds=0", "rounds", "0"),
        ("num_clients=0", "num_clients", "0"),
        ("local_steps=-2", "local_steps", "-2"),
        ("batch_size=0", "batch_size", "0"),
        ("rank=0", "rank", "0"),
        ("data.fraction=0", "data.fraction", "0"),
        ("algorithms=[]", "algorithms", "[]"),
        ("rounds=many", "rounds", "'many'"),
        ("diagnostics.every=-1", "diagnostics.every", "-1"),
        ("diagnostics.batch_size=0", "diagnostics.batch_size", "0"),
        ("diagnostics.clients=some", "diagnostics.clients", "'some'"),
        ("store.max_memory_mb=0", "store.max_memory_mb", "0"),
        ("store.max_memory_mb=true", "store.max_memory_mb", "True"),  # true is not 1
        ("diagnostics.batch_size=true", "diagnostics.batch_size", "True"),
        ("lr=true", "lr", "True"),
        ("data.root=false", "data.root", "False"),
    ],
)
def test_invalid_values_name_field_and_value(override: str, field: str, shown: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert isinstance(err.value, ValueError)
    line = rf"^\s*{re.escape(field)}: .*\(got {re.escape(shown)}\)$"
    assert re.search(line, str(err.value), re.M), str(err.value)


def test_every_issue_key_exists_and_is_settable() -> None:
    overrides = {
        "rounds": 7,
        "num_clients": 5,
        "participation": 0.4,
        "local_steps": 4,
        "batch_size": 8,
        "lr": 0.05,
        "rank": 3,
        "algorithms": ["fedfull", "fedlore"],
        "seeds": [5, 6],
        "data.name": "fashion_mnist",
        "data.root": "/data/somewhere",
        "partition.name": "iid",
        "partition.alpha": 0.3,
        "output_dir": "out/dir",
        "diagnostics.every": 5,
        "diagnostics.batch_size": 16,
        "diagnostics.clients": "sampled",
        "store.max_memory_mb": 64.0,
        "store.spill_dir": "/tmp/spill",
    }
    items = []
    for k, v in overrides.items():
        text = "[" + ",".join(map(str, v)) + "]" if isinstance(v, list) else str(v)
        items.append(f"{k}={text}")
    cfg = load_config(None, items)
    for k, v in overrides.items():
        obj: object = cfg
        for part in k.split("."):
            obj = getattr(obj, part)
        assert obj == v, k
        assert v != _default(k), f"{k}: test value equals the default, so it proves nothing"


def _default(dotted: str) -> object:
    obj: object = Config()
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def test_clients_per_round_follows_participation() -> None:
    assert load_config(None, ["num_clients=10", "participation=0.3"]).clients_per_round() == 3
    assert load_config(None, ["num_clients=10", "participation=1.0"]).clients_per_round() == 10
    assert load_config(None, ["num_clients=10", "participation=0.01"]).clients_per_round() == 1


# ------------------------------------------------------------------ method.<name> overrides


def test_common_settings_reach_every_algorithm() -> None:
    cfg = load_config(None, ["lr=0.02", "local_steps=4", "batch_size=8", "rounds=6", "rank=3"])
    for name in registry.names("algorithm"):
        algo = make_algorithm(name, cfg)
        assert isinstance(algo, Hyper), name  # every method carries the shared settings
        assert (
            algo.train.lr,
            algo.train.local_steps,
            algo.train.batch_size,
            algo.train.rounds,
        ) == (0.02, 4, 8, 6)
        ranks = [getattr(algo, f.name) for f in dataclasses.fields(algo) if f.name == "rank"]
        assert ranks in ([], [3]), name


def test_method_overrides_reach_only_their_algorithm() -> None:
    cfg = load_config(
        None,
        [
            "lr=0.01",
            "method.fedfull.lr=0.5",
            "method.fedfull.betas=[0.8,0.95]",
            "method.fedlore.init_basis=random",
            "method.fedlore.rank=2",
        ],
    )
    full = make_algorithm("fedfull", cfg)
    assert isinstance(full, FedFull)
    assert full.train.lr == 0.5 and full.train.betas == (
        0.8,
        0.95,
    )  # list -> tuple (hashable, frozen)
    lore = make_algorithm("fedlore", cfg)
    assert isinstance(lore, FedLore)
    assert lore.train.lr == 0.01 and lore.rank == 2 and lore.init_basis == "random"
    assert setup_rounds(lore) == 0  # a random P^0 needs no setup exchange
    assert setup_rounds(make_algorithm("fedlore", load_config(None))) == 1
    galore = make_algorithm("local_galore", cfg)
    assert isinstance(galore, Hyper) and galore.train.lr == 0.01


def test_method_overrides_from_yaml(tmp_path: Path) -> None:
    f = _write(tmp_path / "exp.yaml", "method:\n  fedfull:\n    local_optimizer: sgd\n")
    full = make_algorithm("fedfull", load_config(f))
    assert isinstance(full, FedFull) and full.local_optimizer == "sgd"


def test_unknown_hyperparameter_is_a_value_error_naming_it() -> None:
    cfg = load_config(None, ["method.fedfull.bogus_knob=1"])
    with pytest.raises(ValueError, match="bogus_knob"):
        make_algorithm("fedfull", cfg)
    make_algorithm("fedlore", cfg)  # other methods are unaffected


def test_unknown_method_is_a_key_error_listing_registered_ones() -> None:
    with pytest.raises(KeyError) as err:
        make_algorithm("fedmagic", load_config(None))
    msg = str(err.value)
    assert "fedmagic" in msg
    for name in registry.names("algorithm"):
        assert repr(name) in msg


def test_unknown_method_section_fails_before_any_run(tmp_path: Path) -> None:
    cfg = load_config(
        None, ["algorithms=fedfull", "method.fedmagic.lr=1", f"output_dir={tmp_path}"]
    )
    with pytest.raises(ConfigError, match="fedmagic"):
        run_experiment(cfg)
    assert not any(tmp_path.iterdir())  # nothing was run or written


@pytest.mark.parametrize("name", ["../../etc", "a/b", "..", ".hidden", ""])
def test_name_must_be_a_plain_folder_name(name: str) -> None:
    with pytest.raises(ConfigError, match="name"):
        load_config(None, [f"name={name!r}"] if name else ["name=''"])


@pytest.mark.parametrize(
    "override",
    [
        "lr=.inf",
        "lr=.nan",
        "partition.alpha=.inf",
        "seeds=[]",
        "seeds=[1,1]",
        "algorithms=[fedlore,fedlore]",
    ],
)
def test_non_finite_empty_and_duplicate_values_are_errors(override: str) -> None:
    with pytest.raises(ConfigError, match=override.split("=")[0].split(".")[-1]):
        load_config(None, [override])


def test_malformed_yaml_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(None, ["rounds=["])
    bad.write_text("rounds: 3\nname: x: y\n")  # one line: where, and what is wrong
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(e.value) == (
        f"{bad}, line 2, column 8: not valid YAML: mapping values are not allowed here"
    )


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys silently (``rounds: 3`` ... ``rounds: 4`` ran 4
    rounds); the YAML spec forbids them, and so does fedlore, in every mapping. A merge key
    (``<<: *anchor``) may still be overridden."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: 3\nlr: 0.1\nrounds: 4\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(e.value) == (
        f"{bad}, line 3, column 1: not valid YAML: key 'rounds' given twice (first on line 1)"
    )
    bad.write_text("partition: {name: dirichlet, alpha: 0.1, alpha: 0.5}\n")
    with pytest.raises(ConfigError, match="key 'alpha' given twice"):
        load_config(bad)
    bad.write_text("partition: {&k alpha: 0.1, *k : 0.5}\n")  # an alias key is the same node
    with pytest.raises(ConfigError, match="key 'alpha' given twice \\(once more through an alias"):
        load_config(bad)
    bad.write_text("x: &k rounds\nrounds: 2\n*k : 3\n")  # the anchor is a value elsewhere
    with pytest.raises(ConfigError, match="key 'rounds' given twice \\(once more through an"):
        load_config(bad)
    merged = tmp_path / "merged.yaml"
    merged.write_text("data: &d {name: digits}\nrounds: 2\n")
    assert load_config(merged).rounds == 2
    merged.write_text("x: &m {alpha: 0.1, min_size: 5}\npartition:\n  <<: *m\n  alpha: 0.3\n")
    with pytest.raises(ConfigError, match="unknown key"):  # x: merged fine, then refused
        load_config(merged)


def test_a_config_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("name: caf\u00e9\nrounds: 2\n".encode("latin-1"))
    with pytest.raises(
        ConfigError, match=rf"^{bad}: not a UTF-8 text file \(byte 0xe9 at offset 9\)"
    ):
        load_config(bad)


def test_a_missing_base_names_the_file_that_refers_to_it(tmp_path: Path) -> None:
    child = tmp_path / "child.yaml"
    child.write_text("base: missing.yaml\nrounds: 3\n")
    with pytest.raises(ConfigError, match=r"missing\.yaml \(the base of .*child\.yaml\)"):
        load_config(child)


def test_a_folder_or_a_forgotten_equals_sign_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a folder; give a config file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"key=value, e\.g\. rounds=\.\.\."):
        load_config(tmp_path / "rounds")


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("rouns=3", "rouns: unknown key (did you mean 'rounds'?) (got 3)"),
        ("partition.alpah=1", "partition.alpah: unknown key (did you mean 'alpha'?) (got 1)"),
        (
            "robust.zzz=1",
            "robust.zzz: unknown key (got 1); robust has: aggregate, "
            "multi_krum_keep, norm_screen, num_byzantine, trim_fraction",
        ),  # nothing close: the keys
        ("seeds=[]", "seeds: at least one entry is needed (got [])"),  # no pydantic prefix
    ],
)
def test_a_config_error_is_one_plain_line_per_key(override: str, line: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).splitlines()[1:] == [f"  {line}"]


def test_a_rule_over_two_keys_names_them_without_dumping_the_config(tmp_path: Path) -> None:
    both = tmp_path / "both.yaml"
    both.write_text("rounds: 2\nlocal_steps: 10\nlocal_epochs: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(both)
    lines = str(e.value).splitlines()
    assert lines[1].startswith("  local_steps=10 and local_epochs=1 are both set")
    assert "rounds" not in str(e.value) and len(lines) == 2


def test_did_you_mean_guesses_only_close_names() -> None:
    from fedlore.registry import did_you_mean

    assert did_you_mean("FedLore", ["fedlore", "fedfull"]) == " (did you mean 'fedlore'?)"
    assert did_you_mean("fedlroe", ["fedlore", "fedfull"]) == " (did you mean 'fedlore'?)"
    assert did_you_mean("lrr", ["lr", "rank"]) == " (did you mean 'lr'?)"
    assert did_you_mean("zzz", ["lr", "rank"]) == ""
    cfg = load_config(None, ["algorithms=[fedfull]", "method.fedfull.lrr=1"])
    with pytest.raises(
        ValueError, match=r"has no hyperparameter\(s\) \['lrr'\] \(did you mean 'lr'"
    ):
        make_algorithm("fedfull", cfg)


def test_diagnostics_period_reaches_fedlore_only_where_it_has_the_field() -> None:
    cfg = load_config(None, ["diagnostics.every=3"])
    assert make_algorithm("fedlore", cfg).diagnostics_every == 3  # type: ignore[attr-defined]
    assert not hasattr(make_algorithm("fedfull", cfg), "diagnostics_every")


def test_one_name_for_a_list_of_names_and_wrong_types_are_value_errors() -> None:
    cfg = load_config(None, ["method.fedit.target_modules=head"])
    assert make_algorithm("fedit", cfg).target_modules == ("head",)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"method\.fedlore\.lr: Input should be a valid number"):
        make_algorithm("fedlore", load_config(None, ["method.fedlore.lr=abc"]))
    with pytest.raises(ValueError, match=r"FlexLoRA|flexlora|client_ranks"):
        make_algorithm("flexlora", load_config(None, ["method.flexlora.client_ranks=4"]))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("method.pfedme.inner_steps=2.5", r"method\.pfedme\.inner_steps: .*valid integer"),
        ("method.fedfomo.num_candidates=true", "num_candidates: expected a number"),
        ("method.fedbe.swa=maybe", r"method\.fedbe\.swa: must be true or false"),
        ("method.ditto.lam=.inf", "method.ditto.lam: Input should be a finite number"),
        ("method.fedbe.var_scale=-.inf", "var_scale: Input should be a finite number"),
    ],
)
def test_hyperparameter_kinds_are_checked(override: str, message: str) -> None:
    name = override.split(".")[1]
    with pytest.raises(ValueError, match=message):
        make_algorithm(name, load_config(None, [override]))
    # a whole float is taken as the int it spells
    algo = make_algorithm("pfedme", load_config(None, ["method.pfedme.inner_steps=3.0"]))
    assert algo.inner_steps == 3 and isinstance(algo.inner_steps, int)  # type: ignore[attr-defined]


def test_a_method_refuses_fewer_clients_per_round_than_it_needs() -> None:
    cfg = load_config(None, ["num_clients=4", "participation=0.25"])  # one client per round
    with pytest.raises(ValueError, match="fedmask needs at least 2 clients per round"):
        make_algorithm("fedmask", cfg)
    make_algorithm("fedavg", cfg)  # the others do not care
    with pytest.raises(ValueError, match="lr \\* lam"):
        make_algorithm("pfedme", load_config(None, ["lr=0.3"]))  # 0.3 * 15 >= 2


def test_a_setting_the_method_never_reads_is_no_difference_between_its_runs() -> None:
    """``rank`` feeds FedLore's and the LoRA methods' settings, not FedAvg's: a finished FedAvg
    run is this config's run at any rank (its results are the same), unless the subspace
    diagnostics, which run at ``rank``, are on; for FedLore the rank is a difference."""
    from fedlore.engine.run_record import _run_config, config_diff, resolved_hyper

    def record(cfg: Config, method: str) -> dict[str, object]:
        return {**_run_config(cfg, method), "hyper": resolved_hyper(make_algorithm(method, cfg))}

    at8, at16 = load_config(None, ["rank=8"]), load_config(None, ["rank=16"])
    assert config_diff(at16, "fedavg", record(at8, "fedavg"), make_algorithm) == ""
    assert config_diff(at16, "fedlore", record(at8, "fedlore"), make_algorithm) == "rank: 8 -> 16"
    diag8, diag16 = (load_config(None, [f"rank={r}", "diagnostics.every=1"]) for r in (8, 16))
    assert config_diff(diag16, "fedavg", record(diag8, "fedavg"), make_algorithm) == "rank: 8 -> 16"
    assert config_diff(  # a setting every method reads stays a difference
        load_config(None, ["rounds=3"]), "fedavg", record(at8, "fedavg"), make_algorithm
    ).startswith("rounds: ")
    # FedSLoP declares that it never reads the inner optimizer's name, betas or eps
    plain = load_config(None, ["algorithms=[fedslop]"])
    for change in ("optim.name=sgd", "optim.betas=[0.5, 0.9]", "optim.eps=1e-6"):
        other = load_config(None, ["algorithms=[fedslop]", change])
        assert config_diff(other, "fedslop", record(plain, "fedslop"), make_algorithm) == ""
    # ... but FedLore reads them, each named once (not as optim.betas and hyper.betas)
    betas = load_config(None, ["optim.betas=[0.5, 0.9]"])
    assert config_diff(betas, "fedlore", record(at8, "fedlore"), make_algorithm) == (
        "optim.betas: [0.9, 0.999] -> [0.5, 0.9]"
    )


def test_compression_is_compared_as_the_method_used_it() -> None:
    """A finished run is this config's when the method compressed as it would now: a run-wide
    ``compression.*`` (or ``transport_dtype``) that ``method.<name>.*`` overrides, and a
    setting of another kind (top-k's fraction under QSGD, QSGD's levels under top-k, either
    under none), are no difference; what the method reads is, named once."""
    from fedlore.engine.run_record import _run_config, config_diff, resolved_hyper, unread_given

    def record(over: list[str]) -> dict[str, object]:
        cfg = load_config(None, over)
        return {
            **_run_config(cfg, "fedavg"),
            "hyper": resolved_hyper(make_algorithm("fedavg", cfg)),
        }

    def diff(was: list[str], now: list[str]) -> str:
        return config_diff(load_config(None, now), "fedavg", record(was), make_algorithm)

    own = ["method.fedavg.compression=qsgd"]
    # a run-wide setting of the other kind is read by another method (else it is refused)
    topk = ["algorithms=[fedavg, fedprox]", "method.fedprox.compression=topk"]
    qsgd = ["algorithms=[fedavg, fedprox]", "method.fedprox.compression=qsgd"]
    assert (
        diff(
            ["compression.kind=topk", "compression.fraction=0.1", *own, *topk],
            ["compression.kind=qsgd", *own],
        )
        == ""
    )
    assert (
        diff(
            ["compression.kind=qsgd"], ["compression.kind=qsgd", "compression.fraction=0.5", *topk]
        )
        == ""
    )
    assert (
        diff(["compression.kind=topk"], ["compression.kind=topk", "compression.levels=15", *qsgd])
        == ""
    )
    assert diff([], ["compression.kind=none", "method.fedprox.compression=topk"]) == ""
    assert diff(["compression.kind=qsgd"], ["compression.kind=qsgd", "compression.levels=15"]) == (
        "hyper.compression_levels: 127 -> 15"
    )
    assert diff(
        ["compression.kind=topk"], ["compression.kind=topk", "compression.fraction=0.5"]
    ) == ("hyper.compression_fraction: 0.01 -> 0.5")
    assert diff(["compression.kind=qsgd"], ["compression.kind=topk"]) == (
        "hyper.compression: 'qsgd' -> 'topk'; hyper.error_feedback: False -> True"
    )
    # error_feedback None is on under top-k and off under QSGD: spelling it out is no difference
    for kind, same in (("topk", "true"), ("qsgd", "false")):
        assert diff([f"compression.kind={kind}"], [f"compression.kind={kind}",
                    f"compression.error_feedback={same}"]) == ""  # fmt: skip
    off = ["compression.kind=topk", "compression.error_feedback=false"]
    assert diff(["compression.kind=topk"], off) == "hyper.error_feedback: True -> False"
    # so is the wire dtype: run-wide or the method's own, the run is the same
    bf16 = ["transport_dtype=bf16"]
    assert diff(bf16, ["method.fedavg.transport_dtype=bf16"]) == ""
    assert diff(bf16, []) == "hyper.transport_dtype: 'bf16' -> 'fp32'"
    fedavg = registry.get("algorithm", "fedavg")
    assert unread_given(fedavg, {"hyper.compression": "topk"}) == {"hyper.compression_levels"}
    assert unread_given(fedavg, {"hyper.compression": "none"}) == {
        "hyper.compression_fraction",
        "hyper.compression_levels",
        "hyper.error_feedback",
    }


def test_transport_dtype_reaches_the_methods_that_honour_it_and_is_refused_elsewhere() -> None:
    from fedlore.engine.run_record import _run_config, config_diff

    honouring = sorted(
        n
        for n in registry.names("algorithm")
        if registry.get("algorithm", n).capabilities.transport_16bit
    )
    assert {"fedlore", "fedlore_random", "fedlore_fixed", "fedfull", "fedavg", "fedprox"} <= set(
        honouring
    )
    assert {"fedit", "ffa_lora", "flexlora", "flora", "frlora", "rolora", "lora_fair"} <= set(
        honouring
    )
    assert load_config(None).transport_dtype == "fp32"
    for dtype in ("fp16", "bf16"):
        cfg = load_config(None, [f"transport_dtype={dtype}"])
        for name in honouring:
            assert make_algorithm(name, cfg).train.transport_dtype == dtype  # type: ignore[attr-defined]
        with pytest.raises(ConfigError, match=r"transport_dtype=.*local_galore"):
            make_algorithm("local_galore", cfg)  # inherits DenseServer but does not declare it
        # the setting is part of the run's recorded config: a resume under another dtype differs
        recorded = _run_config(cfg, "fedlore")  # what config.json keeps
        assert recorded["transport_dtype"] == dtype
        assert config_diff(load_config(None), "fedlore", recorded, make_algorithm) == (
            f"transport_dtype: {dtype!r} -> 'fp32'"
        )
    with pytest.raises(ConfigError, match="transport_dtype"):
        load_config(None, ["transport_dtype=fp8"])


def test_an_override_with_a_key_given_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="key 'hidden' given twice"):
        load_config(None, ["model.kwargs={hidden: [32], hidden: [64]}"])


def test_an_override_with_an_unquoted_yaml_mark_says_how_to_quote_it() -> None:
    """``personal_layers=[*]`` is a YAML alias, not a glob: the error says to quote it, in one
    line (PyYAML's message spans several)."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["method.fedper.personal_layers=[*]"])
    msg = str(err.value)
    assert "\n" not in msg and "value is not valid YAML (while scanning an alias" in msg
    assert "quote text holding YAML's marks inside the value" in msg
    assert "\"method.fedper.personal_layers=['*']\" (a list)" in msg


@pytest.mark.parametrize("item", ["=3", ".rounds=3", "data..root=x", "rounds.=3"])
def test_an_override_whose_key_has_an_empty_part_is_named(item: str) -> None:
    """'=3' and '.rounds=3' were 'unknown key' errors of the key '' listing every key."""
    with pytest.raises(ConfigError, match="has an empty part"):
        apply_overrides({}, [item])
    assert apply_overrides({}, [" rounds=3"]) == {"rounds": 3}  # spaces around are stripped
