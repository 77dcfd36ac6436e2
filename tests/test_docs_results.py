"""The Results pages' tables and quoted numbers are what their result files give.

``docs/results/`` never retypes a measured number: it includes Markdown tables and quotes single
numbers (the ``{result}`` role) from files of the tree. The tables and numbers that no experiment
or benchmark script wrote in that form are generated from the result files by
``scripts/results_tables.py`` (which runs ``experiments/bayes_tables.py --write`` too) and
committed beside them. Regenerating each from its data must give exactly the committed file, so
a table cannot drift from its data; and every file a page includes or quotes must exist, with
the key it quotes. (Sphinx checks the same when it builds; these run without it.)
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs" / "results").glob("*.md"))
RESULT_ROLE = re.compile(r"(?<!`)\{result\}`([^`]+)`")
INCLUDE = re.compile(r"^```\{include\}\s+(\S+)", re.M)


def load_script() -> ModuleType:
    path = ROOT / "scripts" / "results_tables.py"
    spec = importlib.util.spec_from_file_location("results_tables", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


OUTPUTS = load_script().outputs()


@pytest.mark.parametrize("path", sorted(OUTPUTS))
def test_generated_file_is_what_its_result_files_give(path: str) -> None:
    file = ROOT / path
    assert file.is_file(), f"{path} is missing: run python scripts/results_tables.py"
    assert file.read_text(encoding="utf-8") == OUTPUTS[path], (
        f"{path} differs from what its result files give: run python scripts/results_tables.py"
    )


def test_the_generated_files_cover_the_meta_bayfl_and_benchmark_tables() -> None:
    assert "experiments/results/bayes_table2/summary.md" in OUTPUTS
    assert "experiments/results/bayes_table6/summary_digits.md" in OUTPUTS
    assert "benchmarks/results/round_time.md" in OUTPUTS
    assert all(text.strip() for text in OUTPUTS.values())


def quoted(spec: str) -> Any:
    """The value ``{result}`path.json#a.b.0|fmt``` shows, read as the extension reads it."""
    spec = spec.replace("\\|", "|")  # a role inside a Markdown table escapes its pipe
    spec, _, fmt = spec.partition("|")
    path, _, keys = spec.partition("#")
    value: Any = json.loads((ROOT / path).read_text(encoding="utf-8"))
    for key in keys.split(".") if keys else []:
        value = value[int(key)] if isinstance(value, list) else value[key]
    return format(value, fmt) if fmt else str(value)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_quoted_number_resolves(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for spec in RESULT_ROLE.findall(text):
        assert quoted(spec) not in ("", "None", "nan"), f"{page.name}: {spec} gives no number"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_included_table_exists(page: Path) -> None:
    for target in INCLUDE.findall(page.read_text(encoding="utf-8")):
        assert (page.parent / target).resolve().is_file(), f"{page.name}: {target} is missing"


def test_pages_do_not_retype_numbers_in_the_generated_tables() -> None:
    """A generated table is included, never pasted: no line of one appears in a page."""
    rows = {
        line
        for path, text in OUTPUTS.items()
        if path.endswith(".md")
        for line in text.splitlines()
        if line.startswith("| ") and any(ch.isdigit() for ch in line)
    }
    for page in PAGES:
        pasted = rows & set(page.read_text(encoding="utf-8").splitlines())
        assert not pasted, f"{page.name} retypes rows of a generated table: {sorted(pasted)[:2]}"


def _strict(value: Any) -> Any:
    """``value`` as lr_grid.py writes it since table.json became strict JSON: NaN as null."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    return [_strict(v) for v in value] if isinstance(value, list) else value


def test_the_generators_read_old_and_strict_lr_grid_tables_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lr_grid.py's table.json held NaN for a diverged point (text_rivals, FedSLoP's pre-training
    grid); it now holds null and names the point under ``diverged_grid_seed42``. The committed
    tables keep the old form: rewritten in the new one, they give the same generated files, and
    those are strict JSON (a diverged rate's score null, never NaN)."""
    import results_rivals  # on sys.path: load_script() put scripts/ there

    results = ROOT / "experiments" / "results"
    names = ["subspace_rivals", "text_rivals", "pretrain_rivals"]
    for name in [*names, *(f"{n}/fedslop_grid" for n in names)]:
        if not (results / name / "table.json").exists():
            continue
        table = json.loads((results / name / "table.json").read_text())
        for row in table["methods"].values():
            grid = row["selection_grid_seed42"]
            row["diverged_grid_seed42"] = {k: "blew up" for k, v in grid.items() if v != v}
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "table.json").write_text(json.dumps(_strict(table), allow_nan=False))
    assert "null" in (tmp_path / "text_rivals" / "table.json").read_text()  # a diverged point
    monkeypatch.setattr(results_rivals, "EXP", tmp_path)
    generated = results_rivals.subspace_rivals()
    assert generated == {k: v for k, v in OUTPUTS.items() if k in generated} and generated
    for text in generated.values():
        json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not strict JSON"))
    pretrain = json.loads(generated["experiments/results/pretrain_rivals/summary.json"])
    assert pretrain["fedslop_selection_seed42"]["3"] is None  # the rate that diverged


def test_a_strict_lr_grid_table_reads_as_the_older_form(tmp_path: Path) -> None:
    """results_common.read_grid: a mean over no finite seed and a diverged point, null in a
    strict table, read as NaN as they were written before; an edge that is none stays None."""
    import results_common

    row = {
        "mean": None, "std": None, "loss_mean": None, "loss_std": None, "lr": 0.1,
        "final_accuracy": {"42": None}, "selection_grid_seed42": {"0.1": None, "1": 50.0},
        "chosen_at_grid_edge": None, "diverged_by_seed": {"42": "blew up"},
    }  # fmt: skip
    (tmp_path / "table.json").write_text(json.dumps({"methods": {"m": row}}))
    got = results_common.read_grid(tmp_path / "table.json")["methods"]["m"]
    assert all(got[k] != got[k] for k in ("mean", "std", "loss_mean", "loss_std"))
    assert got["final_accuracy"]["42"] != got["final_accuracy"]["42"]
    assert got["selection_grid_seed42"]["1"] == 50.0 and got["lr"] == 0.1
    assert got["chosen_at_grid_edge"] is None and got["diverged_by_seed"] == {"42": "blew up"}


def test_dump_json_loads_lr_select_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every generated summary.json went through dump_json, which loaded (and ran) the
    experiments' lr_select.py again for each file; once per process now."""
    import results_common

    loads: list[str] = []
    real = importlib.util.spec_from_file_location

    def counted(name: str, *args: Any, **kwargs: Any) -> Any:
        loads.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "spec_from_file_location", counted)
    getattr(results_common.experiment_module, "cache_clear", lambda: None)()  # a fresh start
    texts = [results_common.dump_json({"a": [1.0, math.nan], "b": i}) for i in range(3)]
    assert texts[0] == '{\n "a": [\n  1.0,\n  null\n ],\n "b": 0\n}\n'
    assert loads == ["lr_select"]


FASHION_MNIST_TRAIN = 60_000
"""Fashion-MNIST's training images (every Meta-BayFL table's source before ``data.fraction``)."""


def flat(path: str) -> str:
    """A file's text with every run of whitespace (and a YAML comment's ``#``) one space."""
    return " ".join((ROOT / path).read_text(encoding="utf-8").replace("\n#", " ").split())


def about(x: float) -> str:
    """``x`` to the nearest ten, as the pages write "about 290"."""
    return f"{round(x, -1):,.0f}"


def test_the_meta_bayfl_pages_state_the_clients_sizes_their_configs_give() -> None:
    """The client sizes the Meta-BayFL pages (and the digits config's header) state are what the
    configs build: per client, its images and its training share after the local 80/20 split
    (the share a local epoch passes over), and the steps of 10 local epochs on digits."""
    from fedlore.config import load_config
    from fedlore.data.federation import build_federation

    digits = load_config(ROOT / "experiments" / "bayes_table3_digits.yaml")
    feds = [build_federation(digits, seed) for seed in digits.seeds]
    clients = [
        (len(tr), len(te))
        for f in feds
        for tr, te in zip(f.train_indices, f.test_indices, strict=True)
    ]
    held = sum(tr + te for tr, te in clients) / len(clients)
    train = sum(tr for tr, _ in clients) / len(clients)
    assert digits.local_epochs is not None
    epochs = digits.local_epochs
    steps = sum(epochs * math.ceil(tr / digits.batch_size) for tr, _ in clients) / len(clients)
    said = f"about {about(held)} per client, {about(train)} of them for training:"
    page = flat("docs/results/meta-bayfl-epochs.md")
    assert (held, train) > (280, 225) and f"{said} 10 epochs are about {about(steps)} steps" in page
    assert f"{said} 10 local epochs are about {about(steps)} steps" in flat(
        "experiments/bayes_table3_digits.yaml"
    )
    for name, page, says in (
        ("bayes_table3", "meta-bayfl-epochs", "{held:,.0f} images per client, {train:,.0f} for"),
        ("bayes_table3", "meta-bayfl-tables", "a client's {train:,.0f} training images"),
        ("bayes_table6", "meta-bayfl-epochs", "about {held10} images per client ({train10} for"),
    ):
        cfg = load_config(ROOT / "experiments" / f"{name}.yaml")
        data = cfg.data
        assert data.name == "fashion_mnist"
        held = FASHION_MNIST_TRAIN * data.fraction * (1 - data.server_fraction) / cfg.num_clients
        train = held * (1 - data.test_fraction)
        text = says.format(held=held, train=train, held10=about(held), train10=about(train))
        assert text in flat(f"docs/results/{page}.md"), (page, text)


def test_a_torn_result_file_is_one_line_and_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """scripts/results_tables.py over a torn result file: one line naming it, exit 2, and no
    generated file written (it was a traceback that named no file)."""
    import results_common

    script = load_script()
    torn = tmp_path / "table.json"
    torn.write_text('{"methods": {"fedavg": ')
    monkeypatch.setattr(script, "ROOT", tmp_path)
    monkeypatch.setattr(script, "bayes_tables", lambda: SimpleNamespace(outputs=lambda _: {}))
    made = (lambda: {"first.md": "made\n"}, lambda: {"second.md": results_common.read(torn)})
    monkeypatch.setattr(script, "GENERATORS", made)
    assert script.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{torn}: Expecting value" in err
    assert not (tmp_path / "first.md").exists()
    monkeypatch.setattr(script, "GENERATORS", made[:1])
    assert script.main([]) == 0 and (tmp_path / "first.md").read_text() == "made\n"


def test_an_interrupt_while_the_tables_are_written_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C in scripts/results_tables.py was a traceback: now one line, exit 130, and the file
    written before it whole, the one being written as it was."""
    script = load_script()
    monkeypatch.setattr(script, "ROOT", tmp_path)
    monkeypatch.setattr(script, "bayes_tables", lambda: SimpleNamespace(outputs=lambda _: {}))
    (tmp_path / "second.md").write_text("published\n")
    monkeypatch.setattr(
        script, "GENERATORS", (lambda: {"first.md": "made\n", "second.md": "new\n"},)
    )
    written = script.write_text

    def ctrl_c_on_second(path: Path, text: str) -> None:
        if path.name == "second.md":
            raise KeyboardInterrupt
        written(path, text)

    monkeypatch.setattr(script, "write_text", ctrl_c_on_second)
    assert script.main([]) == 130
    assert capsys.readouterr().err.strip() == script.INTERRUPTED
    assert (tmp_path / "first.md").read_text() == "made\n"
    assert (tmp_path / "second.md").read_text() == "published\n"
