"""Every code block of the tutorials, the how-to guides, the docs' home page and the README runs
as it stands, so the docs cannot rot (the rules are also in docs/development/docs.md).

Per page, in a fresh working folder in which the repository's ``experiments/``, ``benchmarks/``,
``scripts/`` and ``docs/`` are reachable, the blocks run in page order:

* ``python``: executed, all blocks of a page in one namespace (registrations a page makes are
  undone after it).
* ``console``: each ``$ fedlore ...`` command runs in process through :func:`fedlore.cli.main`
  and must exit 0 (or the status a trailing ``# exits N`` names); ``fedlore run`` gets
  ``rounds=2`` appended (the one change, to keep CI within its time). Other commands are checked,
  not run: ``python FILE`` needs the file, ``make TARGET`` the target, a script of the
  repository (``scripts/x.sh``, ``bash scripts/x.sh``, after ``VAR=value`` assignments) its
  file; installers, Flower's servers and shell built-ins are known by name; anything else
  fails the test. Lines without ``$`` are output.
* ``yaml`` with a ``:caption: FILE`` option (MyST ``{code-block}``): written to FILE for the
  blocks after it; without a caption, a block whose keys are configuration keys is validated as
  an experiment file (every key and value, as ``fedlore run`` would).
* ``text``, ``json``, ``csv``, ``toml``, ``ini``: shown only. Any other language fails (a shell
  snippet is a ``console`` block with ``$`` prompts), so no block escapes the check.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINKED = ("experiments", "benchmarks", "scripts", "docs")
SHRINK = ["rounds=2"]
SHOWN = {"text", "json", "csv", "toml", "ini", "output", "none", ""}
ADMONITIONS = {
    "note", "tip", "warning", "important", "seealso", "attention", "caution", "hint",
    "admonition", "dropdown", "danger", "error",
}  # fmt: skip
# Commands a page may show but the test does not run (installs, servers, shell built-ins).
NOT_RUN = {
    "pip", "apt-get", "sudo", "source", "cd", "ls", "cat", "head", "tail", "export", "mkdir",
    "cp", "mv", "kill", "git", "flower-superlink", "flower-supernode", "flwr", "tensorboard",
    "mlflow", "wandb", "xdg-open", "open", "chromium", "nvidia-smi", "du", "tree", "wc", "less",
}  # fmt: skip


@dataclass
class Block:
    lang: str
    text: str
    line: int
    options: dict[str, str] = field(default_factory=dict)


def blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown page, admonitions' contents included."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,}|:{3,})\s*(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.groups()
        j = i + 1
        while j < len(lines) and not re.match(
            rf"^{re.escape(indent)}{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]
        ):
            j += 1
        body = [line[len(indent) :] for line in lines[i + 1 : j]]
        directive = re.match(r"^\{([\w-]+)\}\s*(.*)$", info)
        if directive and directive.group(1) not in ("code-block", "code", "sourcecode"):
            if directive.group(1) in ADMONITIONS:
                for inner in blocks("\n".join(body)):
                    inner.line += i + 1
                    out.append(inner)
            i = j + 1
            continue
        lang = (directive.group(2) if directive else info).strip().split(" ")[0]
        options = {}
        while directive and body and re.match(r"^:[\w-]+:", body[0]):
            key, _, value = body.pop(0)[1:].partition(":")
            options[key.strip()] = value.strip()
        out.append(Block(lang.lower(), "\n".join(body) + "\n", i + 1, options))
        i = j + 1
    return out


def pages() -> list[Path]:
    found = sorted((DOCS / "tutorials").glob("*.md")) + sorted((DOCS / "how-to").glob("*.md"))
    return [DOCS / "index.md", *found, ROOT / "README.md"]


def commands(block: Block) -> list[tuple[str, int]]:
    """``(command, expected exit status)`` of a console block (``bash`` in the README)."""
    out: list[tuple[str, int]] = []
    prompt = block.lang == "console"
    current: str | None = None
    for raw in block.text.splitlines():
        if current is not None:
            current += " " + raw.strip()
        elif prompt and raw.startswith("$ "):
            current = raw[2:].strip()
        elif not prompt and raw.strip() and not raw.lstrip().startswith("#"):
            current = raw.strip()
        else:
            continue
        if current.endswith("\\"):
            current = current[:-1].rstrip()
            continue
        status = re.search(r"#\s*exits\s+(\d+)\s*$", current)
        code = int(status.group(1)) if status else 0
        out.append((re.sub(r"\s+#.*$", "", current).strip(), code))
        current = None
    return out


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([\w-]+):", text, flags=re.M))


def run_command(command: str, expected: int, where: str) -> None:
    from fedlore import cli

    argv = shlex.split(command)
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        argv = argv[1:]  # environment assignments before the command
    head = argv[0]
    if head in ("fedlore", ".venv/bin/fedlore"):
        args = argv[1:]
        if args and args[0] == "run":
            args = [*args, *SHRINK]
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            status = cli.main(args)
        assert status == expected, f"{where}: `{command}` exited {status}, not {expected}"
    elif head == "make":
        targets = [a for a in argv[1:] if "=" not in a and not a.startswith("-")]
        unknown = set(targets) - make_targets()
        assert not unknown, f"{where}: `{command}`: no make target {sorted(unknown)}"
    elif head in ("python", "python3", ".venv/bin/python"):
        rest = [a for a in argv[1:] if not a.startswith("-")]
        if argv[1:2] == ["-m"]:
            import importlib.util

            assert importlib.util.find_spec(argv[2]), f"{where}: no module {argv[2]}"
        else:
            assert rest and Path(rest[0]).exists(), f"{where}: `{command}`: no such file"
    elif head in ("bash", "sh") or "/" in head:
        script = argv[1] if head in ("bash", "sh") and len(argv) > 1 else head
        assert (ROOT / script).is_file(), f"{where}: `{command}`: no such script"
    else:
        assert head in NOT_RUN, f"{where}: `{command}`: the docs test cannot check {head!r}"


def check_yaml(block: Block, where: str) -> None:
    from fedlore.config import Config, load_config

    caption = block.options.get("caption")
    if caption:
        path = Path(caption)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.text, encoding="utf-8")
        return
    data = yaml.safe_load(block.text)
    if isinstance(data, dict) and set(data) & (set(Config.model_fields) | {"method"}):
        probe = Path("_docs_probe.yaml")
        probe.write_text(block.text, encoding="utf-8")
        try:
            load_config(probe, [])
        finally:
            probe.unlink()


def run_page(page: Path, tmp: Path) -> None:
    from fedlore import registry

    for name in LINKED:
        (tmp / name).symlink_to(ROOT / name, target_is_directory=True)
    module = types.ModuleType(f"docs_{page.stem.replace('-', '_')}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    for kind in registry._TABLES:
        registry.names(kind)  # fill every table first: the snapshot must hold the built-ins
    saved = {kind: dict(table) for kind, table in registry._TABLES.items()}
    try:
        for block in blocks(page.read_text(encoding="utf-8")):
            where = f"{page.relative_to(ROOT)}:{block.line}"
            if block.lang == "python":
                exec(compile(block.text, where, "exec"), module.__dict__)
            elif block.lang == "console" or (page.name == "README.md" and block.lang == "bash"):
                for command, expected in commands(block):
                    run_command(command, expected, where)
            elif block.lang == "yaml":
                check_yaml(block, where)
            else:
                assert block.lang in SHOWN, (
                    f"{where}: a ```{block.lang} block; the docs test runs python, console "
                    "and yaml blocks and shows text/json/csv/toml/ini (see its docstring)"
                )
    finally:
        sys.modules.pop(module.__name__, None)
        for kind, table in registry._TABLES.items():
            table.clear()
            table.update(saved.get(kind, {}))


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run_page(page, tmp_path)


def test_the_parser_sees_every_kind_of_block() -> None:
    page = (
        "```python\nx = 1\n```\n"
        ":::{note}\n```console\n$ fedlore run a.yaml \\\n  rounds=3  # exits 2\nout\n```\n:::\n"
        "```{code-block} yaml\n:caption: a.yaml\nrounds: 1\n```\n"
        "````{tip}\n```text\nshown\n```\n````\n"
    )
    found = blocks(page)
    assert [b.lang for b in found] == ["python", "console", "yaml", "text"]
    assert found[2].options == {"caption": "a.yaml"} and found[2].text == "rounds: 1\n"
    assert commands(found[1]) == [("fedlore run a.yaml rounds=3", 2)]


def test_a_broken_example_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: an unknown key, a missing file and an unknown tool are caught."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception, match="no_such_key"):
        check_yaml(Block("yaml", "rounds: 2\nno_such_key: 1\n", 1), "x")
    with pytest.raises(AssertionError, match="no such file"):
        run_command("python benchmarks/not_there.py", 0, "x")
    with pytest.raises(AssertionError, match="cannot check"):
        run_command("rm -rf runs", 0, "x")
    with pytest.raises(AssertionError, match="no make target"):
        run_command("make deploy", 0, "x")
    with pytest.raises(AssertionError, match="no such script"):
        run_command("N=2 scripts/not_there.sh 3", 0, "x")
    run_command("BASE_PORT=9 scripts/flower_local_federation.sh 2", 0, "x")


def test_the_readme_quickstart_table_is_the_recorded_one() -> None:
    """The README quotes the quickstart's recorded report (experiments/results/quickstart/
    report.md, written by ``fedlore report``), row for row: rerecord it, then copy the table."""
    recorded = (ROOT / "experiments/results/quickstart/report.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    want = [line for line in recorded.splitlines() if line.startswith("|")]
    got = [line for line in readme.splitlines() if line.startswith("|")]
    assert want and want[0] in got, "the README lacks the quickstart table's header"
    start = got.index(want[0])
    assert got[start : start + len(want)] == want


def test_no_page_holds_control_characters() -> None:
    """A page written through an unescaped string once carried \\b, \\f and \\a in place of
    LaTeX's \\bigl, \\frac and \\alpha: no C0 control character but tab and newline."""
    bad = {
        str(p.relative_to(ROOT)): sorted(
            {hex(ord(c)) for c in p.read_text("utf-8") if ord(c) < 32 and c not in "\t\n\r"}
        )
        for p in (ROOT / "docs").rglob("*.md")
        if "_build" not in p.parts
    }
    assert {k: v for k, v in bad.items() if v} == {}
