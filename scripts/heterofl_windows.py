"""A finished HeteroFL run's complexity levels scored at the windows of other rounds
(``docs/explanation/methods/heterofl.md``, "Per level"): for each level below rate 1 and each
round ``s`` given, the sub-model of the final global model in rolling extraction's window of
round ``s`` (under ``static`` extraction: the static sub-model shifted by ``s`` units in every
layer, the same window), its BatchNorm statistics re-queried from the last round's clients able
to run it, scored on the central test set, through the method's own query and per-level
evaluation (``tests/algorithms/test_heterofl_levels_resnet.py`` checks them by hand).

    python scripts/heterofl_windows.py RUN ROUNDS

``RUN``: a run's method folder, ``<output_dir>/<name>/heterofl`` (its ``seed-*/`` folders with
``config.json``, ``checkpoint.pt`` and ``metrics.jsonl``); ``ROUNDS``: comma-separated, e.g.
``0,1,2,4``. One line per seed: per level, the row's accuracy (%) and each round's.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from fedlore.algorithms import heterofl_levels as levels
from fedlore.algorithms.heterofl import HeteroFL
from fedlore.config import Config
from fedlore.config_load import validate
from fedlore.data.federation import build_federation
from fedlore.engine.callbacks import Checkpointer
from fedlore.experiment_parts import level_scores, make_algorithm
from fedlore.models import build_model
from fedlore.types import Reply, State


def windows(folder: Path, rounds: list[int]) -> dict[str, dict[str, float]]:
    """Per level below rate 1 (as text), ``{"row": the last row's accuracy, "<s>": ...}`` (%)."""
    raw = json.loads((folder / "config.json").read_text())  # the run's record: its config,
    # without what it derived and where it ran (fingerprint, hyper, data_folders, ran_*)
    raw = {k: v for k, v in raw.items() if k in Config.model_fields}
    cfg = validate(raw | {"method": {"heterofl": raw["method"]}})
    algo = make_algorithm("heterofl", cfg)
    assert isinstance(algo, HeteroFL) and algo.eval_levels
    algo = dataclasses.replace(algo, extraction="rolling")  # static shifted by s = round s's
    last = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x][-1]
    final = Checkpointer.load(folder / "checkpoint.pt")[1]
    fed = build_federation(cfg, int(folder.name.split("-")[1]))
    model = build_model(cfg.model.name, fed.input_shape, fed.num_classes, **cfg.model.kwargs)
    out = {r: {"row": 100 * float(v["accuracy"])} for r, v in last["levels"].items() if r != "1.0"}
    for s in rounds:
        state = State(dict(final.arrays), dict(final.values) | {levels.ROUND: s})
        replies: list[tuple[int, Reply | None]] = []
        for c in sorted(int(c) for c in last["width_rate"]):
            msg = algo.query(state, s, c)
            reply = None if msg is None else levels.answer(algo, msg, model, fed.client(c))
            replies.append((c, reply))
        state, _ = algo.absorb_query(state, replies, s)
        scores = level_scores(algo, state, model, fed, cfg.eval.batch_size, 1)
        for r, acc in out.items():
            acc[str(s)] = 100 * float(scores[r]["accuracy"] or 0.0)
    return out


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    rounds = [int(s) for s in argv[1].split(",")]
    for folder in sorted(Path(argv[0]).glob("seed-*")):
        res = windows(folder, rounds)
        print(folder.name, {r: {k: round(v, 2) for k, v in a.items()} for r, a in res.items()})


if __name__ == "__main__":
    main(sys.argv[1:])
