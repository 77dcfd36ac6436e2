"""The README's "Extending fedlore" blocks run as they stand: a model, a data source and an
algorithm registered by a user, then a run of them from Python."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Extending fedlore\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_extending_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedlore import registry

    blocks = _blocks()
    assert len(blocks) == 4  # model, data source, algorithm, Python API
    monkeypatch.chdir(tmp_path)  # the run writes runs/extend_demo here
    module = types.ModuleType("readme_example")  # dataclasses look their module up
    monkeypatch.setitem(sys.modules, module.__name__, module)
    ns = module.__dict__
    try:
        for block in blocks:
            exec(compile(block, str(README), "exec"), ns)
        summaries = ns["summaries"]
        assert isinstance(summaries, dict)
        assert set(summaries) == {"fedfull", "fedfull_server_lr", "fedlore"}
        for runs in summaries.values():
            assert runs[0]["rounds"] == 5 and runs[0]["final_accuracy"] > 0.5  # 3 classes
        # the server learning rate is real: the two FedFull variants end elsewhere
        plain, halved = (summaries[m][0]["final_loss"] for m in ("fedfull", "fedfull_server_lr"))
        assert plain != halved
        assert (tmp_path / "runs" / "extend_demo" / "report.md").exists()
    finally:  # leave the registries as other tests expect them
        for kind, name in (("model", "tiny_mlp"), ("source", "iris"),
                           ("algorithm", "fedfull_server_lr")):  # fmt: skip
            registry._TABLES[kind].pop(name, None)
