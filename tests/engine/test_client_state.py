"""``client_state_bytes``: what each client keeps between rounds, measured where it is kept.

The optimizer-state column counts moment tensors only, so SCAFFOLD's control variate c_i,
FedDyn's h_k, Ditto's personal model and FedPer's head (each a client's memory cost between
rounds) showed as "0 B" before. The transports now measure every client's state as they store
it; these tests check the measured sizes against the model's own tensors, that the row takes the
largest client, the summary the largest round, and the report shows a column for it (and none
for runs written before it was measured), and that it stays out of the clear under DP.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.config import load_config
from fedlore.data.federation import build_federation
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.experiment_parts import model_factory
from fedlore.results.markdown import to_markdown
from fedlore.results.summary import derive_summary
from fedlore.tensors import state_bytes
from fedlore.types import State

SMALL = [
    "num_clients=3",
    "rounds=2",
    "local_steps=2",
    "batch_size=16",
    "model.kwargs={hidden: [8]}",
    "partition.min_size=10",
    "progress=false",
]


def _rows(tmp_path: Path, method: str, *extra: str) -> tuple[list[dict[str, Any]], Any]:
    cfg = load_config(None, [*SMALL, f"output_dir={tmp_path}", f"algorithms=[{method}]", *extra])
    summary = run_one(cfg, method, 3)
    path = run_dir(cfg, method, 3) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()], (cfg, summary)


def _param_bytes(cfg: Any, prefix: str = "") -> int:
    """Bytes of the model's trainable parameters (those whose name starts with ``prefix``)."""
    fed = build_federation(cfg, 3)
    model = model_factory(cfg, fed, 3)()
    return sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith(prefix)
    )


@pytest.mark.parametrize(
    ("method", "kept"),
    [
        ("fedavg", None),  # keeps nothing
        ("scaffold", ""),  # c_i: one tensor per trainable parameter
        ("feddyn", ""),  # h_k: likewise
        ("ditto", ""),  # the personal model
        ("fedper", "head."),  # the personalization layers only
        ("fedrep", "head."),  # likewise
        ("moon", ""),  # its model of the previous round
        ("perfedavg", None),  # keeps nothing: it personalizes the received model when scored
    ],
)
def test_each_round_records_the_state_its_clients_keep(
    tmp_path: Path, method: str, kept: str | None
) -> None:
    rows, (cfg, summary) = _rows(tmp_path, method)
    want = 0 if kept is None else _param_bytes(cfg, kept)
    assert want == 0 or want > 100
    assert [r["client_state_bytes"] for r in rows] == [want, want]
    assert summary["client_state_bytes"] == want
    # the optimizer-state column still counts moments only: plain SGD keeps none
    assert all(r["optimizer_state_bytes"] == 0 for r in rows)


def test_apfl_keeps_its_local_model_and_its_mixing_weight(tmp_path: Path) -> None:
    """APFL's state is v_i (the whole model: personal.*) and alpha_i (one number of the model's
    dtype, apfl.alpha): the transport counts both."""
    rows, (cfg, summary) = _rows(tmp_path, "apfl")
    want = _param_bytes(cfg) + 4  # fp32 v_i, and alpha_i as a 0-d fp32 tensor
    assert [r["client_state_bytes"] for r in rows] == [want, want]
    assert summary["client_state_bytes"] == want


@pytest.mark.parametrize(
    "mode",
    [
        ["dp.clip_norm=1", "dp.noise_multiplier=1"],
        ["secure_aggregation=true"],
        ["dp.clip_norm=1", "dp.noise_multiplier=1", "dp.mode=local"],
    ],
    ids=["dp", "secagg", "local-dp"],
)
def test_under_dp_the_state_size_is_not_sent_in_the_clear(tmp_path: Path, mode: list[str]) -> None:
    rows, (_, summary) = _rows(tmp_path, "fedavg", "weighting=uniform", *mode)
    assert all("client_state_bytes" not in r for r in rows)
    assert "client_state_bytes" not in summary


def test_state_bytes_counts_every_tensor_at_its_own_width() -> None:
    state = State(
        {
            "a": torch.zeros(3, 4, dtype=torch.float64),
            "b": torch.zeros(5, dtype=torch.bfloat16),
            "c": torch.zeros(2, dtype=torch.int64),
        },
        {"seen": 1},
    )
    assert state_bytes(state) == 3 * 4 * 8 + 5 * 2 + 2 * 8
    assert state_bytes(None) == 0
    assert state_bytes(State({}, {})) == 0


def _row(rnd: int, kept: int | None) -> dict[str, Any]:
    row: dict[str, Any] = {"round": rnd, "bytes_up": 1, "bytes_down": 1, "wall_s": 0.1}
    row.update({"accuracy": 0.5, "loss": 1.0, "optimizer_state_bytes": 0})
    if kept is not None:
        row["client_state_bytes"] = kept
    return row


def test_the_summary_takes_the_largest_round_and_old_runs_have_none() -> None:
    assert (
        derive_summary("m", 1, [_row(0, 10), _row(1, 30), _row(2, 20)])["client_state_bytes"] == 30
    )
    assert "client_state_bytes" not in derive_summary("m", 1, [_row(0, None), _row(1, None)])


def _table_row(kept: float | None) -> dict[str, Any]:
    return {
        "method": "m",
        "n_seeds": 1,
        "final_accuracy_pct_mean": 50.0,
        "final_accuracy_pct_std": 0.0,
        "best_accuracy_pct_mean": 50.0,
        "best_accuracy_pct_std": 0.0,
        "mb_up_mean": 1.0,
        "mb_down_mean": 1.0,
        "optimizer_state_bytes_mean": 0.0,
        "client_state_bytes_mean": kept,
        "wall_s_per_round_mean": 0.1,
        "wall_s_per_round_std": 0.0,
        "rejected_total_mean": 0.0,
        "skipped_steps_total_mean": 0.0,
    }


def test_the_report_shows_the_column_when_a_run_measured_it() -> None:
    shown = to_markdown([_table_row(2440.0), _table_row(0.0)])
    header = shown.splitlines()[0]
    assert "| optimizer state | client state |" in header
    assert "| 0 B | 2.44 KB |" in shown.splitlines()[2]
    assert "| 0 B | 0 B |" in shown.splitlines()[3]
    assert "client state" not in to_markdown([_table_row(None)])  # runs from before


def test_client_seconds_per_round_leave_out_round_0_as_the_round_seconds_do() -> None:
    """Round 0 pays the first run's one-time start-up in its clients as well (newcomer finding:
    flower-sim showed 0.317 s of client training against 0.038 s a round): both averages start
    at round 1, and a one-round run keeps its round 0."""
    rows = [{**_row(r, None), "client_train_s": t} for r, t in ((0, 1.0), (1, 0.1), (2, 0.3))]
    assert derive_summary("m", 1, rows)["client_train_s_per_round"] == pytest.approx(0.2)
    assert derive_summary("m", 1, rows[:1])["client_train_s_per_round"] == 1.0


def test_a_round_records_its_largest_client_and_nothing_when_none_measured() -> None:
    """The row's value is the most any accepted client keeps (clients differ: a client at its
    first contact keeps less under some methods), not the first's or the mean."""
    from fedlore.engine.loop import _largest
    from fedlore.types import Reply

    replies = [Reply({}, {"client_state_bytes": b}) for b in (40, 90, 10)]
    assert _largest(replies, "client_state_bytes") == {"client_state_bytes": 90}
    assert _largest([Reply({}, {})], "client_state_bytes") == {}
