"""The mutation-testing setup (``make mutation``, scripts/mutation.py) stays consistent with the
tree: every group's paths and tests exist, ``[tool.mutmut]`` covers exactly the groups, and a
module path picks its group. Runs no mutant."""

from __future__ import annotations

import fnmatch
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _driver() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fedlore_mutation", ROOT / "scripts/mutation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_every_group_names_existing_paths_tests_and_functions() -> None:
    """Paths and test files exist (a test may be a ``file::name`` node), and every function
    a group limits itself to is defined in its file."""
    _, groups, _ = _driver().load_config()
    assert {"robust", "optim", "tensors", "bayes_selection"} <= set(groups)
    assert any(p.startswith("src/fedlore/privacy/") for g in groups.values() for p in g["paths"])
    for name, group in groups.items():
        for path in group["paths"]:
            assert (ROOT / path).exists(), (name, path)
        for test in group["tests"]:
            assert (ROOT / test.split("::")[0]).exists(), (name, test)
        for func in group.get("functions", []):
            text = "".join((ROOT / p).read_text("utf-8") for p in group["paths"])
            assert f"def {func.rpartition('.')[2]}(" in text, (name, func)


def test_mutmut_settings_cover_exactly_the_groups() -> None:
    """``mutmut run`` at the root mutates what the groups mutate and selects their tests: every
    group path matches a root ``only_mutate`` glob and every glob matches a group path; every
    group test is (inside) a root selection and every root selection holds a group test."""
    driver = _driver()
    mutmut, groups, _ = driver.load_config()
    globs = mutmut["only_mutate"]
    files = {
        str(f.relative_to(ROOT)) if (ROOT / p).is_dir() else p
        for g in groups.values()
        for p in g["paths"]
        for f in ((ROOT / p).rglob("*.py") if (ROOT / p).is_dir() else [ROOT / p])
    }
    assert all(any(fnmatch.fnmatch(f, glob) for glob in globs) for f in files)
    # every module a root glob takes (a file split out of a grouped one, say) is in a group
    under_globs = {
        str(f.relative_to(ROOT))
        for f in (ROOT / "src").rglob("*.py")
        if f.name != "__init__.py"
        and any(fnmatch.fnmatch(str(f.relative_to(ROOT)), g) for g in globs)
    }
    assert under_globs <= files, sorted(under_globs - files)
    assert all(any(fnmatch.fnmatch(f, glob) for f in files) for glob in globs)
    tests = {t for g in groups.values() for t in g["tests"]}
    selected = set(mutmut["pytest_add_cli_args_test_selection"])
    assert all(t in selected or any(t.startswith(s + "/") for s in selected) for t in tests)
    assert all(any(t == s or t.startswith(s + "/") for t in tests) for s in selected)


def test_modules_choose_their_groups() -> None:
    """A group's name, one of its files, a folder it lies in or one inside it picks it."""
    driver = _driver()
    _, groups, _ = driver.load_config()
    assert driver.choose(groups, ["src/fedlore/robust.py"]) == ["robust"]
    assert driver.choose(groups, ["src/fedlore/optim/subspace.py"]) == ["optim"]
    privacy = [n for n, g in groups.items() if g["paths"][0].startswith("src/fedlore/privacy/")]
    assert privacy and driver.choose(groups, ["src/fedlore/privacy"]) == privacy
    assert driver.choose(groups, ["tensors", "src/fedlore/algorithms/bayes.py"]) == [
        "tensors",
        "bayes_selection",
    ]
    assert driver.choose(groups, ["src/fedlore/"]) == list(groups)
    assert driver.choose(groups, []) == list(groups)
    with pytest.raises(SystemExit, match="no group"):
        driver.choose(groups, ["src/fedlore/run.py"])


def test_mutant_names_map_to_functions() -> None:
    """mutmut's names (``module.x_func__mutmut_N``, ``module.xǁClassǁmethod__mutmut_N``) map
    back to the functions a group lists, and a group's filters name its functions' mutants."""
    driver = _driver()
    assert driver.function_of("fedlore.robust.x_combine_updates__mutmut_3") == "combine_updates"
    name = "fedlore.algorithms.bayes.x\u01c1MetaBayFL\u01c1select_lr__mutmut_12"
    assert driver.function_of(name) == "MetaBayFL.select_lr"
    group = {"paths": ["src/fedlore/algorithms/bayes.py"], "functions": ["pick_lowest"]}
    assert driver.mutant_filters(group) == ["fedlore.algorithms.bayes.x_pick_lowest__mutmut_*"]
    assert driver.module_of("src/fedlore/privacy/__init__.py") == "fedlore.privacy"


def test_a_file_new_to_a_group_is_mutated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group's folder keeps mutmut's results between runs; a source file that mutmut copied
    there unmutated (no ``.meta`` beside it: it joined the group later) is removed so that the
    next run mutates it, while a mutated file and its results stay."""
    driver = _driver()
    monkeypatch.setattr(driver, "WORK", tmp_path)
    group = {"paths": ["src/fedlore/robust.py", "src/fedlore/optim/"], "tests": ["tests"]}
    mutants = tmp_path / "g" / "mutants" / "src" / "fedlore"
    (mutants / "optim").mkdir(parents=True)
    stale = [mutants / "robust.py", mutants / "optim" / "subspace.py"]
    kept = mutants / "optim" / "projected_adam.py"
    for f in [*stale, kept, kept.with_name(kept.name + ".meta")]:
        f.write_text("# copy\n", "utf-8")
    work = driver.prepare("g", group, {"paths_to_mutate": ["src"]}, {})
    assert work == tmp_path / "g" and (work / "pyproject.toml").exists()
    assert not any(f.exists() for f in stale)
    assert kept.exists() and kept.with_name(kept.name + ".meta").exists()
