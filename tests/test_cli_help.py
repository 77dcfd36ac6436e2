"""``fedlore --help`` and every subcommand's help list every option with a one-line meaning,
and the docs' command-line reference is generated from the same parser (issue: the help and
the reference must not drift apart)."""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

import pytest

from fedlore.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    assert stop.value.code == 0
    return out.getvalue()


def test_every_option_of_every_command_has_a_one_line_meaning() -> None:
    parser = build_parser()
    subs = _subparsers(parser)
    assert {"run", "report", "partition", "fortunes-c4"} <= set(subs)
    for name, sub in [("fedlore", parser), *subs.items()]:
        assert sub.description or name == "fedlore", f"{name} has no description"
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            meaning = action.help
            label = "/".join(action.option_strings) or action.dest
            assert meaning and meaning.strip(), f"{name}: {label} has no help"
            assert "\n" not in meaning, f"{name}: {label}: the help is more than one line"
    for action in parser._actions:  # each subcommand's line in `fedlore --help`
        if isinstance(action, argparse._SubParsersAction):
            listed = {choice.dest for choice in action._choices_actions}
            assert listed == set(subs), "a subcommand without a help line"
            assert all(choice.help for choice in action._choices_actions)


@pytest.mark.parametrize("command", ["", "run", "report", "partition", "track", "fortunes-c4"])
def test_the_printed_help_lists_each_option_with_its_meaning(command: str) -> None:
    parser = build_parser()
    sub = _subparsers(parser)[command] if command else parser
    text = " ".join(_help([command, "--help"] if command else ["--help"]).split())
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for flag in action.option_strings:
            assert flag in text, f"fedlore {command} --help omits {flag}"
        first_words = " ".join(str(action.help).split()[:4])
        assert first_words in text, f"fedlore {command} --help omits {first_words!r}"
    if not command:  # the top level names every subcommand with its meaning
        for name in _subparsers(parser):
            assert name in text


def test_the_reference_page_is_generated_from_this_parser() -> None:
    page = (ROOT / "docs" / "reference" / "cli.rst").read_text(encoding="utf-8")
    assert ".. argparse::" in page and ":module: fedlore.cli" in page
    assert ":func: build_parser" in page


def test_version_names_fedlore_torch_flwr_and_python() -> None:
    import re
    import sys

    line = _help(["--version"]).strip()
    python = ".".join(str(v) for v in sys.version_info[:3])
    assert re.fullmatch(rf"fedlore \S+ \(torch \S+, flwr \S+, Python {python}\)", line), line


def test_python_m_fedlore_is_the_command_and_importing_the_package_loads_no_torch() -> None:
    """The entry point (``fedlore.console``, also ``python -m fedlore``) imports nothing heavy
    before it installs its Ctrl-C handler: ``import fedlore`` leaves torch unloaded."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    code = "import sys, fedlore, fedlore.console; print('torch' in sys.modules, fedlore.Arrays)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("False "), out  # fedlore.Arrays still resolves, lazily
    done = subprocess.run(
        [sys.executable, "-m", "fedlore", "--version"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.startswith("fedlore "), done


@pytest.mark.parametrize("flag", ["--ov", "--over", "--res", "--base"])
def test_abbreviated_options_are_refused_not_guessed(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse guesses `--ov` means --overwrite, which replaces finished results: only whole
    option names are accepted, by every command and the experiment drivers."""
    from fedlore.cli import main

    command = "report" if flag == "--base" else "run"
    args = [str(tmp_path)] if command == "report" else [f"output_dir={tmp_path}", "rounds=1"]
    with pytest.raises(SystemExit) as stop:
        main([command, flag, *args] if flag != "--base" else [command, *args, flag, "x"])
    assert stop.value.code == 2 and not any(tmp_path.iterdir())
    assert "unrecognized arguments" in capsys.readouterr().err
    for driver in ("sweep", "lr_grid", "carry"):
        text = (ROOT / "experiments" / f"{driver}.py").read_text()
        assert "allow_abbrev=False" in text, driver


def test_resume_and_overwrite_together_are_refused_with_nothing_to_continue(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both flags said `finished already ... (--overwrite trains it again)` of a finished run:
    one of them was ignored. Together they continue an interrupted --overwrite
    (tests/reliability/test_reruns.py); with none there, the pair is refused before anything
    runs, saying what each does."""
    from fedlore.cli import main

    assert main(["run", f"output_dir={tmp_path}", "rounds=1", "--resume", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "--resume with --overwrite continues an interrupted --overwrite" in err
    assert "holds none" in err and "Give one of them" in err
    assert not any(tmp_path.iterdir())
    from fedlore.config import ConfigError, load_config
    from fedlore.experiment import run_experiment

    cfg = load_config(None, [f"output_dir={tmp_path}", "rounds=1"])
    with pytest.raises(ConfigError, match="--resume with --overwrite continues"):
        run_experiment(cfg, resume=True, overwrite=True)  # the Python API too
    assert not any(tmp_path.iterdir())


def test_a_stray_argument_gets_the_commands_own_usage(capsys: pytest.CaptureFixture[str]) -> None:
    from fedlore.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["report", "a", "b"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fedlore report") and "unrecognized arguments: b" in err


def test_an_unknown_option_before_the_command_gets_fedlores_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``fedlore --verb report DIR``: the option was given to fedlore, not to ``report``, so
    the error shows fedlore's usage (the command's own usage misled: ``report`` has no such
    place for options); after the command it is the command's."""
    from fedlore.cli import main

    for argv, usage in (
        (["--verb", "report", "a"], "usage: fedlore [-h]"),
        (["report", "--verb", "a"], "usage: fedlore report"),
    ):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(usage) and "unrecognized arguments: --verb" in err


def test_a_closed_pipe_ends_the_command_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fedlore report DIR | head`: the reader left before the table was written. That is no
    error to report ("fedlore: error: Broken pipe" was printed): status 141, as a tool ended
    by SIGPIPE, and nothing on stderr. A broken pipe that is not stdout's (a worker's, a
    socket's) is still an error, said in one line."""
    import subprocess
    import sys

    from fedlore.cli import main

    def closed(*_: object, **__: object) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("fedlore.results.report.report", closed)
    assert main(["report", str(tmp_path)]) == 2  # stdout is fine: another pipe broke
    assert capsys.readouterr().err == "fedlore: error: Broken pipe\n"
    script = (
        "import sys, fedlore.cli as c\n"
        "def flood(*a, **k):\n"
        "    for _ in range(10**5): print('x' * 80)\n"
        "c.build_parser  # loaded\n"
        "import fedlore.results.report as r; r.report = flood\n"
        "sys.exit(c.main(['report', sys.argv[1]]))\n"
    )
    reader = subprocess.Popen(
        ["head", "-c", "10"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], stdout=reader.stdin, stderr=subprocess.PIPE
    )
    assert reader.stdin is not None
    reader.stdin.close()
    reader.wait()
    assert done.returncode == 141 and done.stderr == b"", done.stderr
