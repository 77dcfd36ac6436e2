"""A finished (or checkpointed) run's global model, back in Python: :func:`load_trained`.

A run folder holds what is needed: ``config.json`` (the settings, validated again), the folder
names (method and seed) and ``checkpoint.pt`` (the server state after the last complete round,
written with ``checkpoint: true``, the default). The run's model is built as the run built it
(the same federation, so the same input shape, classes and tokenizer: the data must be where
the run read it), and the method's global arrays are loaded into it: for a Bayesian method the
Bayesian model (means and scales), for a LoRA method the model with its adapters, for FedLore
the dense weights. Evaluating it on the central test set gives the run's last evaluation again;
for a finished run with ``early_stopping.restore_best`` the model is its best round's (kept in
the checkpoint), whose evaluation the summary's ``final_*`` values are.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from fedlore.config import Config, ConfigError, validate
from fedlore.data.federation import Federation
from fedlore.engine.checkpoint_io import load_tensors
from fedlore.engine.early_stopping import ENTRY
from fedlore.experiment import build
from fedlore.tensors import load_model_arrays
from fedlore.types import State

SEED_FOLDER = re.compile(r"^seed-(-?\d+)$")


@dataclass(frozen=True)
class TrainedRun:
    """A run's global model as it stood after ``round``.

    Attributes:
        model: the global model, in evaluation mode, on the device asked for.
        method: the method's registered name.
        seed: the run's seed.
        round: the last complete round of the checkpoint (counting from 0); the best round
            for a finished run with ``early_stopping.restore_best``.
        finished: whether the run has its ``summary.json`` (else the model is an unfinished
            run's last checkpoint).
        cfg: the run's config (its method and seed only).
        fed: the seed's federation (``fed.central_test`` is what ``accuracy`` was measured on).
    """

    model: nn.Module
    method: str
    seed: int
    round: int
    finished: bool
    cfg: Config
    fed: Federation


def load_trained(folder: str | Path, device: str = "cpu") -> TrainedRun:
    """The global model of the run in ``folder`` (``<output_dir>/<name>/<method>/seed-<s>``).

    Args:
        folder: the run's folder.
        device: where to put the model (``cpu``, ``cuda``, ``auto``).

    Raises:
        FileNotFoundError: the folder, its ``config.json`` or its ``checkpoint.pt`` is missing
            (a run with ``checkpoint: false`` keeps no model).
        ConfigError: the recorded settings no longer validate, or the folder is not named
            ``<method>/seed-<s>``.
    """
    folder = Path(folder)
    found = SEED_FOLDER.match(folder.name)
    if found is None:
        raise ConfigError(f"{folder}: not a run folder (expected <method>/seed-<s>)")
    seed, method = int(found.group(1)), folder.parent.name
    record_path, ckpt = folder / "config.json", folder / "checkpoint.pt"
    for need in (record_path, ckpt):
        if not need.is_file():
            why = " (the run kept no model: checkpoint: false)" if need is ckpt else ""
            raise FileNotFoundError(f"{need}: no such file{why}")
    record = json.loads(record_path.read_text())
    settings = {k: v for k, v in record.items() if k in Config.model_fields}
    cfg = validate({**settings, "algorithms": [method], "seeds": [seed], "device": device})
    exp = build(cfg, method, seed)
    raw = load_tensors(ckpt, exp.device)
    finished = (folder / "summary.json").is_file()
    server, rnd = raw["server"], int(raw["round"])
    best = raw.get(ENTRY, {})
    if finished and cfg.early_stopping.restore_best and "best_state" in best:
        server, rnd = best["best_state"], int(best["best_round"])  # the run's result
    state = State(dict(server["arrays"]), dict(server["values"]))
    load_model_arrays(exp.eval_model, exp.algorithm.global_arrays(state))
    exp.eval_model.eval()
    return TrainedRun(exp.eval_model, method, seed, rnd, finished, cfg, exp.fed)
