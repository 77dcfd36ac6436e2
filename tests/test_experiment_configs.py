"""The configs that reproduce a seed table use the seed's settings (issue 16)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedlore.config import load_config

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
SEED_TABLES = sorted(
    [*EXPERIMENTS.glob("bayes_table*.yaml")]
    + [EXPERIMENTS / f for f in ("vision_table1.yaml", "text_table2.yaml", "pretrain_table3.yaml")]
    + [EXPERIMENTS / "pretrain_ablation.yaml"]
)
LR_GRID_TABLES = ("vision_table1.yaml", "text_table2.yaml", "pretrain_table3.yaml")


@pytest.mark.parametrize("path", SEED_TABLES, ids=lambda p: p.name)
def test_seed_tables_average_with_the_seeds_uniform_weights(path: Path) -> None:
    """Seed 000 (Algorithm 1: (1/N) Σ ΔZ_i) and seed 001 (Eq. 22: 1/N Σ w_i) average uniformly."""
    assert load_config(path).weighting == "uniform"


@pytest.mark.parametrize("name", LR_GRID_TABLES)
def test_grid_tables_hold_out_a_selection_split(name: str) -> None:
    assert load_config(EXPERIMENTS / name).data.selection_fraction > 0


def test_the_library_default_stays_the_fl_convention() -> None:
    assert load_config(None).weighting == "num_examples"


@pytest.mark.parametrize(
    "path", sorted(EXPERIMENTS.glob("bayes_table*.yaml")), ids=lambda p: p.name
)
def test_seed_001_tables_train_the_seeds_local_epochs(path: Path) -> None:
    """Seed 001's clients train T local epochs (Algorithm 1 line 7), 10 per round (Fig. 3)."""
    cfg = load_config(path)
    assert (cfg.local_epochs, cfg.local_steps) == (10, None)


@pytest.mark.parametrize("name", [*LR_GRID_TABLES, "pretrain_ablation.yaml"])
def test_seed_000_tables_list_its_five_trials(name: str) -> None:
    """Seed 000 reports five trials with seeds {42, 43, 44, 45, 46} (Hardware and
    Reproducibility)."""
    assert load_config(EXPERIMENTS / name).seeds == [42, 43, 44, 45, 46]


@pytest.mark.parametrize(
    ("rivals", "table"),
    [
        ("subspace_rivals.yaml", "vision_table1.yaml"),
        ("text_rivals.yaml", "text_table2.yaml"),
        ("pretrain_rivals.yaml", "pretrain_table3.yaml"),
    ],
)
def test_the_subspace_rivals_run_on_the_table_analogues(rivals: str, table: str) -> None:
    """Issue 35: FedLore and its low-rank rivals on the Table 1, 2 and 3 settings, seeds
    42-44, uniform weights and a selection split (for experiments/lr_grid.py). Every setting
    that decides a run's results is the table's, so a shared method's run is the table's own
    run (the same folder, reported rather than trained again)."""
    from fedlore.engine.run_record import _run_config
    from fedlore.engine.rundir import run_dir

    cfg = load_config(EXPERIMENTS / rivals)
    base = load_config(EXPERIMENTS / table)
    assert cfg.algorithms == ["fedlore", "fedgalore", "fedslop", "local_galore", "fedit", "fedfull"]
    assert cfg.seeds == [42, 43, 44] and cfg.weighting == "uniform"
    assert cfg.data.selection_fraction > 0
    for method in ("fedlore", "local_galore", "fedit", "fedfull"):
        assert _run_config(cfg, method) == _run_config(base, method)
        assert run_dir(cfg, method, 42) == run_dir(base, method, 42)


def test_bayesian_fedlore_runs_on_the_table_3_digits_analogue() -> None:
    """Issue 35 part 2: the four BNN methods side by side on bayes_table3_digits' setting at input
    noise 0.1 (seed 001's local protocol: 10 local epochs, seeds 42-44, 1/N weights)."""
    cfg = load_config(EXPERIMENTS / "bayes_fedlore.yaml")
    base = load_config(EXPERIMENTS / "bayes_table3_digits.yaml")
    assert cfg.algorithms == ["bayfl", "meta_bayfl", "fedlore_bayfl", "fedlore_bayes"]
    assert cfg.data.noise == 0.1 and cfg.rank == 8
    assert (cfg.seeds, cfg.local_epochs, cfg.weighting) == ([42, 43, 44], 10, "uniform")
    assert (cfg.model, cfg.partition, cfg.rounds) == (base.model, base.partition, base.rounds)


def test_apfl_and_perfedavg_run_on_the_table_6_digits_setting() -> None:
    """APFL and Per-FedAvg beside FedAvg and Ditto on the personalized-baselines page's digits
    setting (bayes_table6.yaml with data.name=digits, data.fraction=1.0): every setting that
    decides FedAvg's and Ditto's runs is that table's, the run's name aside, and the two new
    methods train by plain SGD at the table's SGD rate."""
    from fedlore.engine.run_record import _run_config

    cfg = load_config(EXPERIMENTS / "pfl_baselines.yaml")
    base = load_config(EXPERIMENTS / "bayes_table6.yaml", ["data.name=digits", "data.fraction=1.0"])
    assert cfg.algorithms == ["fedavg", "ditto", "apfl", "perfedavg"]
    assert (cfg.seeds, cfg.local_epochs, cfg.weighting) == ([42, 43, 44], 10, "uniform")
    for method in ("fedavg", "ditto"):
        ours, theirs = _run_config(cfg, method), _run_config(base, method)
        assert {**ours, "name": None} == {**theirs, "name": None}
    assert cfg.method["apfl"] == cfg.method["perfedavg"] == cfg.method["fedavg"] == {"lr": 0.05}


def test_the_owed_reruns_script_names_real_configs_methods_and_committed_run_folders() -> None:
    """``experiments/reruns.sh`` (the reruns issues 33 and 35 still owe): every config it runs
    exists and loads, every method of its grids and sweeps is registered and in its config's
    methods, and every runs folder is under ``experiments/runs/`` (committed, so that a fresh
    clone continues the grids), never the ignored ``runs/``."""
    import re
    import subprocess

    from fedlore import registry

    script = EXPERIMENTS / "reruns.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    text = script.read_text().replace("\\\n", " ")
    known = set(registry.names("algorithm"))
    seven = "1e-4,3e-4,5e-4,8e-4,1e-3,3e-3,5e-3"
    lines = [x for x in text.splitlines() if not x.lstrip().startswith("#")]
    commands = [x for x in lines if "lr_grid.py" in x or re.match(r"\s*sweep [\w/]", x)]
    assert len(commands) >= 13
    assert f"SEVEN={seven}" in text
    for line in commands:
        (config,) = re.findall(r"experiments/[\w/]+\.yaml", line)
        cfg = load_config(EXPERIMENTS.parent / config)
        named = set()
        for methods in re.findall(r"--(?:grid|methods) ([\w,]+)", line):
            named |= set(methods.split(","))
        assert named <= known, (line, named - known)
        if "lr_grid.py" in line:  # a grid for every method of the config
            assert '--set "algorithms=' in line or set(cfg.algorithms) <= named, line
            runs = re.findall(r"--runs (\S+)", line)
            assert runs and all(r.startswith("experiments/runs/") for r in runs), line
    (runs_root,) = re.findall(r'--runs "(experiments/runs/)\$name"', text)  # every sweep's
    assert runs_root == "experiments/runs/"


def test_the_owed_reruns_script_skips_exactly_the_tables_published_at_its_protocol() -> None:
    """``experiments/reruns.sh`` skips a table published under ``experiments/results/`` (its runs
    committed) without checking its runs again: every table it makes has its published copy,
    which exists, except the two still owed at seed 001's protocol (Table II, ResNet-20's Table
    IV), whose published tables are the earlier protocol's and must not stop the reruns."""
    import re
    import subprocess

    script = EXPERIMENTS / "reruns.sh"
    text = script.read_text()
    tables = re.findall(r"^\s*made ([\w/.-]+\.md)", text, re.M)
    tables += [f"{n}/table.md" for n in re.findall(r"^sweep ([\w/.-]+) ", text, re.M)]
    assert len(tables) == 14, tables
    body = re.search(r"^published\(\) \{.*?^\}", text, re.M | re.S)
    assert body is not None
    owed = {"bayes_table2/table.md", "bayes_table4/resnet20/table.md"}
    for table in tables:
        got = subprocess.run(
            ["bash", "-c", f'{body.group(0)}\npublished "$1"', "-", table],
            capture_output=True,
            text=True,
            check=False,
        )
        if table in owed:
            assert got.returncode == 1 and not got.stdout, table
        else:
            copy = EXPERIMENTS.parent / got.stdout.strip()
            assert got.returncode == 0 and copy.is_file(), (table, got.stdout)
            assert copy.read_text().startswith("|"), copy  # a table, not another file
